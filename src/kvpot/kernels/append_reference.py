"""Plain-PyTorch cache append of a batched decoding step: the reference `kvpot.kernels.append` must match,
and the path used where Triton cannot run (CPU).

Each of B rows writes its new token's key and value at entry `index[b]` of its pool slot `rows[b]`, with the
token's stream position and its RoPE position (the stream position where keys are stored rotated, the
entry's index otherwise), sets the slot's query position, and counts the entry in `lengths`. Several rows
may name one slot (padding rows on the scratch slot): they write the same index, count and positions, and one
of their keys and values (which one is unspecified on CUDA; nothing reads a padding row's entry). No host value
decides an index or a shape: safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch


def append_rows_reference(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                          rope_positions: torch.Tensor, query_position: torch.Tensor, lengths: torch.Tensor,
                          rows: torch.Tensor, index: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor,
                          stream_positions: torch.Tensor, rotated: bool) -> None:
    """keys/values [S, kv_heads, capacity, d], positions/rope_positions [S, kv_heads, capacity] int64,
    query_position and lengths [S]; rows, index (`lengths[rows]`, taken by the caller) and stream_positions [B]
    int64; new_keys/new_values [B, kv_heads, d]. `rotated`: the keys are stored rotated (their RoPE position is
    the stream position)."""
    kv = keys.shape[1]
    heads = torch.arange(kv, device=keys.device).view(1, -1)
    rope_new = stream_positions if rotated else index
    at = (rows[:, None], heads, index[:, None])  # [B, kv_heads] each
    keys[at] = new_keys.to(keys.dtype)
    values[at] = new_values.to(values.dtype)
    positions[at] = stream_positions[:, None].expand(-1, kv)
    rope_positions[at] = rope_new[:, None].expand(-1, kv)
    query_position[rows] = rope_new
    lengths[rows] = (index + 1).to(lengths.dtype)
