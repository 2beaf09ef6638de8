"""Plain-PyTorch observation over packed rows of a mixed step: the reference `kvpot.kernels.observe.observe_varlen`
must match, and the path used where Triton cannot run (CPU).

A fixed-shape mixed step (`kvpot.engine.packed`) packs prompt chunks of several requests into one forward, as the
varlen attention does (`kvpot.kernels.varlen_reference`): row `r` holds packed tokens `[starts[r], starts[r + 1])`
over pool slot `slots[r]`, whose first `cached[r]` entries were there before the forward. A chunk whose method
observes its attention (InfiniPot's catalyst, an H2O chunk) asks for the rows `[row0[r], row0[r] + count[r])` of
its tokens; `count[r] == 0` asks for nothing. The answer is `kvpot.attention.observe`'s for that request with
`head_reduce="mean"` and `over="all"`: each key's attention probability summed over the rows (averaged where
`mean[r]`), averaged over each KV group's query heads. Here it is that function, called row by row, so a CPU run
gets exactly what the chunk alone gets.
"""

from __future__ import annotations

import torch

from kvpot.attention import AttentionRequest, observe
from kvpot.rope import rotate_half


def observe_varlen_reference(query: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                             cached: torch.Tensor, row0: torch.Tensor, count: torch.Tensor, mean: torch.Tensor,
                             scaling: float, out: torch.Tensor, lse: torch.Tensor | None = None,
                             cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                             key_positions: torch.Tensor | None = None, row_keys: torch.Tensor | None = None) -> None:
    """query [T, heads, d], keys [S, kv_heads, capacity, d] (each row's own tokens appended), both rotated, or
    un-rotated with `cos`/`sin` tables [P, d] and `key_positions` [S, kv_heads, capacity]: keys rotated at their
    positions and each token's query at its own entry's, as `Rope.rotate` does. slots, starts [R + 1], cached,
    row0, count, mean [R] int; out [R, kv_heads, capacity] float32, rows that observe written in
    `[:cached[r] + their tokens]`. `lse` (the kernel's normaliser) and `row_keys` (its keys rotated ahead) are
    not needed here."""
    group = query.shape[1] // keys.shape[1]
    bounds = [t.tolist() for t in (slots, starts, cached, row0, count, mean)]
    for r, (slot, cache, first, observed, reduce) in enumerate(zip(bounds[0], bounds[2], bounds[3], bounds[4],
                                                                   bounds[5])):
        if observed == 0:
            continue
        begin, stop = bounds[1][r], bounds[1][r + 1]
        n = cache + stop - begin
        request = AttentionRequest(rows=(first, first + observed), row_reduce="mean" if reduce else "sum",
                                   head_reduce="mean")
        rows = query[begin:stop].transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, d]
        row_keys = keys[slot : slot + 1, :, :n]
        if cos is not None:
            positions = key_positions[slot : slot + 1, :, :n]  # [1, kv, n]
            row_keys = _rotate(row_keys, cos[positions], sin[positions])
            own = positions[:, :, cache:].repeat_interleave(group, dim=1)  # [1, heads, tokens]
            rows = _rotate(rows, cos[own], sin[own])
        out[r, :, :n] = observe(rows, row_keys, request, scaling)[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`Rope.rotate`'s arithmetic (its PyTorch path), so the references round as the one-sequence path does."""
    return x * cos + rotate_half(x) * sin
