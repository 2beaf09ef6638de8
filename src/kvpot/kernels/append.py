"""Triton cache append of a batched decoding step: one launch a layer for what `append_rows_reference`
(`kvpot.kernels.append_reference`) does in a dozen (the index broadcasts and scatters of keys, values, both
position arrays, the query position and the count).

One program per batch row writes every KV head of its token: the row's slot, entry and positions are read
once, and the row's count is written by the program that read it. Rows naming one slot (padding rows on the
scratch slot) write the same entry, count and positions; which row's key and value land there is unspecified,
as with the reference's scatter on CUDA (padding: nothing reads them). No host synchronisation: safe to capture
in a CUDA graph (issue 43: the batched step's small kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpot.errors import KvpotError
from kvpot.kernels.common import next_power_of_2


@triton.jit
def _append_kernel(NEW_K, NEW_V, K, V, POS, ROPE, QPOS, LENGTHS, ROWS, INDEX, STREAM,
                   s_nk_b, s_nk_h, s_nv_b, s_nv_h, s_k_s, s_k_h, s_k_n, s_v_s, s_v_h, s_v_n,
                   s_p_s, s_p_h, s_r_s, s_r_h,
                   KV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ROTATED: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(ROWS + b).to(tl.int64)
    n = tl.load(INDEX + b).to(tl.int64)
    position = tl.load(STREAM + b).to(tl.int64)
    rope = position if ROTATED else n
    offs = tl.arange(0, BLOCK_D)
    live = offs < D
    for h in tl.static_range(KV):
        key = tl.load(NEW_K + b * s_nk_b + h * s_nk_h + offs, mask=live)
        value = tl.load(NEW_V + b * s_nv_b + h * s_nv_h + offs, mask=live)
        tl.store(K + slot * s_k_s + h * s_k_h + n * s_k_n + offs, key.to(K.dtype.element_ty), mask=live)
        tl.store(V + slot * s_v_s + h * s_v_h + n * s_v_n + offs, value.to(V.dtype.element_ty), mask=live)
        tl.store(POS + slot * s_p_s + h * s_p_h + n, position)
        tl.store(ROPE + slot * s_r_s + h * s_r_h + n, rope)
    tl.store(QPOS + slot, rope)
    tl.store(LENGTHS + slot, (n + 1).to(LENGTHS.dtype.element_ty))


def append_rows(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
                query_position: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, index: torch.Tensor,
                new_keys: torch.Tensor, new_values: torch.Tensor, stream_positions: torch.Tensor,
                rotated: bool) -> None:
    """`append_rows_reference`'s writes in one launch (same arguments). The head dim and the last dimension
    of every buffer must be contiguous; positions are int64."""
    batch, kv, d = new_keys.shape
    if keys.shape[1] != kv or keys.shape[-1] != d or values.shape != keys.shape or new_values.shape != new_keys.shape:
        raise KvpotError(f"append: new keys {tuple(new_keys.shape)} and values {tuple(new_values.shape)} do not fit "
                         f"a pool of {tuple(keys.shape)}")
    for name, t in (("keys", keys), ("values", values), ("new keys", new_keys), ("new values", new_values),
                    ("positions", positions), ("rope positions", rope_positions)):
        if t.stride(-1) != 1:
            raise KvpotError(f"append: the {name}' last dimension must be contiguous")
    for name, t in (("rows", rows), ("index", index), ("stream positions", stream_positions),
                    ("query positions", query_position), ("lengths", lengths)):
        if t.dim() != 1 or (t.stride(0) != 1 and t.numel() > 1):
            raise KvpotError(f"append: {name} must be a contiguous vector")
    if batch == 0:
        return
    _append_kernel[(batch,)](
        new_keys, new_values, keys, values, positions, rope_positions, query_position, lengths, rows, index,
        stream_positions, new_keys.stride(0), new_keys.stride(1), new_values.stride(0), new_values.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        KV=kv, D=d, BLOCK_D=next_power_of_2(d), ROTATED=rotated, num_warps=1 if d <= 128 else 2)
