"""The model's rotary embedding (RoPE), evaluated at positions kvpot chooses.

Below `positions` (the policies) and `cache` (which rotates keys): both need `Rope`, and neither
may import the other at run time.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rope:
    """The model's rotary embedding, evaluated at positions kvpot chooses.

    cos/sin come from the model's own `rotary_emb` module, so every RoPE variant it implements
    (default, llama3, linear, yarn, longrope, dynamic) is reproduced bit for bit. For static
    variants a cos/sin table is grown on demand and indexed; `dynamic` and `longrope` frequencies
    depend on the longest sequence the module has seen, so they are evaluated on each call, with
    the same call history the model would give them (keys at insertion for `absolute`).
    """

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        self.scaling = float(getattr(rotary, "attention_scaling", 1.0))
        rope_type = str(getattr(rotary, "rope_type", "default"))
        # these variants change frequencies with the longest position seen, so no table
        self.dynamic = "dynamic" in rope_type or rope_type == "longrope"
        # one cos/sin table per device ([table_len, head_dim] each): a model split over GPUs rotates
        # each layer's keys where the layer runs, and one shared table would move on every layer
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def unscale(self, x: torch.Tensor) -> torch.Tensor:
        """Undo the `attention_scaling` the model applied at position 0."""
        return x if self.scaling == 1.0 else x / self.scaling

    def cos_sin(
        self, positions: torch.Tensor, like: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape `[*positions.shape, head_dim]` in `like.dtype`.

        `max_position` (an upper bound of `positions`, known on the host) sizes the table without
        a device-to-host sync.
        """
        if self.dynamic:
            flat = positions.reshape(-1, positions.shape[-1])  # [rows, n]
            cos, sin = self.rotary(like, flat)  # (on the rotary module's device when it is dispatched)
            return cos.to(like.device).view(*positions.shape, -1), sin.to(like.device).view(*positions.shape, -1)
        cos, sin = self._ensure_table(max_position + 1, like)
        return cos[positions], sin[positions]

    def table(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos/sin table `[>= length, head_dim]` in `like.dtype`, or None for dynamic variants
        (their frequencies depend on the call history, so no fixed table exists). Kernels that
        apply RoPE while loading index it."""
        if self.dynamic:
            return None
        return self._ensure_table(length, like)

    def _ensure_table(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The table on `like`'s device, at least `length` rows, in `like.dtype`."""
        table = self._tables.get(like.device)
        have = 0 if table is None else table[0].shape[0]
        if have >= length and table[0].dtype == like.dtype:
            return table
        size = max(length, 2 * have, 4096)
        grid = torch.arange(size, device=like.device).unsqueeze(0)  # [1, size]
        cos, sin = self.rotary(like, grid)  # (a dispatched rotary module answers on its own device)
        table = self._tables[like.device] = (cos[0].to(like.device), sin[0].to(like.device))  # [size, head_dim]
        return table

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """Rotate `x` [b, heads, n, d] by `positions` [b, kv_heads, n].

        When `heads` is a multiple of `kv_heads` (queries of a GQA group), each query head takes
        the positions of its KV head, without repeating the tensor.
        """
        b, heads, n, d = x.shape
        kv_heads = positions.shape[1]
        if not self.dynamic and _kernel_rotates(x, positions):  # one launch where Triton runs
            from kvpot.kernels.rope import rotate_tokens

            return rotate_tokens(x, positions, *self._ensure_table(max_position + 1, x))
        cos, sin = self.cos_sin(positions, x, max_position)  # [b, kv_heads, n, d]
        grouped = x.view(b, kv_heads, heads // kv_heads, n, d)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        out = grouped * cos + rotate_half(grouped) * sin
        return out.view(b, heads, n, d)


def _kernel_rotates(x: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether the rotation runs as one Triton launch (`kvpot.kernels.rope`, PyTorch's result bit for bit) instead
    of about a dozen PyTorch operations."""
    from kvpot import kernels

    if not kernels.available(x.device) or torch.compiler.is_compiling():  # compiled, inductor fuses the ops
        return False
    from kvpot.kernels.rope import supports

    return supports(x, positions)
