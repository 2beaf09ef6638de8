"""RoPE for InfLLM's runtime: most positions it rotates at are a run (a window, a chunk of queries) or one
position (the shared distant one), so the model's cos/sin table is sliced, not indexed.

rot(x, p) = x * cos_p + rotate_half(x) * sin_p, and rotate_half(x) = (-x2, x1) is the halves of x swapped
(one flip) times the sign (-1, +1), folded into a signed sine: three kernels per rotation where the
indexed form takes eight. Tables are the model's own (`Rope.table`, in the tensor's dtype, as the model
rotates); RoPE variants without a table (dynamic, longrope) take `Rope.cos_sin` at every call.
"""

from __future__ import annotations

import torch

from kvpot.rope import Rope, rotate_half


class Turner:
    """rotate(x [..., n, d], positions [n]) and its run / single-position forms, up to `bound`."""

    def __init__(self, rope: Rope, like: torch.Tensor, bound: int, tables: dict):
        self.rope, self.like, self.bound = rope, like, bound
        self.tables = tables  # (device, dtype) -> (cos, signed sin), shared by a runtime's turners

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(positions, self.like, self.bound)
        return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)

    def span(self, x: torch.Tensor, start: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., n, d] rotated at positions start .. start + n - 1 (into `out` when given: x may then be
        a strided view, e.g. overlapping windows of a layer's buffer, and `out` fixes the layout)."""
        table = self._table(x.dtype)
        n = x.shape[-2]
        if table is None:
            turned = self(x, torch.arange(start, start + n, device=x.device))
            return turned if out is None else out.copy_(turned)
        cos, sin = table
        return self._turn(x, cos[start : start + n], sin[start : start + n], out)

    def at(self, x: torch.Tensor, position: int) -> torch.Tensor:
        """x [..., d] rotated at one position."""
        table = self._table(x.dtype)
        if table is None:
            return self(x.unsqueeze(-2), torch.full((1,), position, device=x.device)).squeeze(-2)
        cos, sin = table
        return self._turn(x, cos[position], sin[position])

    def cos0(self, dtype: torch.dtype) -> torch.Tensor:
        """cos at position 0 [d]: a key's rotation there (the RoPE's scaling; sin(0) = 0)."""
        table = self._table(dtype)
        if table is None:
            zero = torch.zeros(1, dtype=torch.long, device=self.like.device)
            return self.rope.cos_sin(zero, self.like, self.bound)[0][0].to(dtype)
        return table[0][0]

    @staticmethod
    def _turn(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, out: torch.Tensor | None = None
              ) -> torch.Tensor:
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2, x1)
        if out is None:
            return torch.addcmul(x * cos, swapped, signed_sin)
        return torch.mul(x, cos, out=out).addcmul_(swapped, signed_sin)  # the same arithmetic, element by element

    def _table(self, dtype: torch.dtype):
        if self.rope.dynamic:
            return None
        key = (self.like.device, dtype)
        table = self.tables.get(key)
        if table is None or table[0].shape[0] < self.bound:
            cos, sin = self.rope.table(self.bound, self.like)
            half = sin.shape[-1] // 2
            signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
            table = self.tables[key] = (cos.to(dtype), signed.to(dtype))
        return table
