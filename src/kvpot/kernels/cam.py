"""Triton: CaM's steady decoding step in one launch per layer (issue 31).

For each batch row b (pool slot `rows[b]`) and KV head h, one program:

- UPDATE: adds the step's observation to each live entry's accumulated attention A (Algorithm 1's A-bar);
- FIND: the oldest entry after the first `start` places leaves (StreamingLLM's ring: the smallest stream
  position, `replace.drop_index` by age);
- MERGE (Algorithm 1, in expectation): the m entries whose stream positions follow the dropped one's
  (the window's positions are consecutive) are its targets; `p = clamp(A_i / mean(A_targets), 0, 1)`
  (0/0 -> 0, x/0 -> 1) and each target's value becomes `V_j + p V_i / m`, rounded as
  `cam.merge_into_next` rounds it (p and p V_i in the cache's dtype, the sum in float32);
- MOVE: the newest entry (`n - 1`, maybe a target, so after the merge) is written over the dropped one:
  keys, values, positions, RoPE positions (ranks renumbered with RENUMBER) and A (`replace._move`).

`kvpot.methods.cam.steady_reference` is the PyTorch path this must match (tests/test_cam_kernel.py): the
kept entries exactly, merged values within one rounding of the cache's dtype (the mean over the targets
sums in another order). Nothing synchronises with the host: a step captures it in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpot.kernels.replace import BLOCK, LAST, _move


@triton.jit(do_not_specialize=["n", "start", "m", "stride_ob", "stride_oh", "stride_ks", "stride_vs", "stride_ps",
                               "stride_rs", "stride_as"])
def _cam_kernel(
    OBS,  # [B, KV, >= n] float32 the step's observation (attention received, heads of a group averaged)
    A,  # [S, KV, C] float32 accumulated attention (read and rewritten)
    POS,  # [S, KV, C] int64 stream positions, the newest entry at n - 1
    RP,  # [S, KV, C] int64 RoPE positions (ranks with RENUMBER)
    K, V,  # [S, KV, C, D] keys and values (last stride 1)
    ROWS,  # [B] int64 each batch row's slot (HAS_ROWS; else row b is slot b)
    DROP,  # [B, KV] int64 the entry each head drops (written)
    TARGETS,  # [B, KV, BLOCK_M] int64 scratch: the places of the merge targets, by position offset
    n, start, m,  # live entries, the protected start, the merge budget (targets per dropped entry)
    stride_ob, stride_oh, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_rs, stride_rh, stride_as, stride_ah,
    KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MERGE: tl.constexpr, RENUMBER: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    at = b.to(tl.int64) * KV + h
    obs = OBS + b.to(tl.int64) * stride_ob + h * stride_oh
    acc = A + slot * stride_as + h * stride_ah
    pos = POS + slot * stride_ps + h * stride_ph
    k = K + slot * stride_ks + h * stride_kh
    v = V + slot * stride_vs + h * stride_vh
    # UPDATE and FIND: A += observation; the smallest stream position past the start
    best_p = tl.full((), LAST, tl.int64)
    best_j = tl.full((), 0, tl.int32)
    for lo in range(0, n, BLOCK_N):
        j = lo + tl.arange(0, BLOCK_N)
        live = j < n
        tl.store(acc + j, tl.load(acc + j, mask=live, other=0.0) + tl.load(obs + j, mask=live, other=0.0), mask=live)
        key = tl.where(live & (j >= start), tl.load(pos + j, mask=live, other=0), LAST)
        oldest = tl.min(key, axis=0)
        first = tl.min(tl.where(key == oldest, j, 2147483647), axis=0)
        better = oldest < best_p
        best_p = tl.where(better, oldest, best_p)
        best_j = tl.where(better, first, best_j)
    drop = best_j.to(tl.int64)
    tl.store(DROP + at, drop)
    tl.debug_barrier()  # A is written back before it is read at other places
    if MERGE:
        # the targets: the entries at stream positions gone + 1 .. gone + m, each put at its offset's place
        scratch = TARGETS + at * BLOCK_M
        for lo in range(0, n, BLOCK_N):
            j = lo + tl.arange(0, BLOCK_N)
            offset = tl.load(pos + j, mask=j < n, other=0) - best_p
            tl.store(scratch + offset - 1, j.to(tl.int64), mask=(j < n) & (offset >= 1) & (offset <= m))
        tl.debug_barrier()  # the targets are written before they are read
        t = tl.arange(0, BLOCK_M)
        inside_m = t < m
        target = tl.load(scratch + t, mask=inside_m, other=0)
        mean = tl.math.div_rn(tl.sum(tl.load(acc + target, mask=inside_m, other=0.0), axis=0), m.to(tl.float32))
        ratio = tl.math.div_rn(tl.load(acc + drop), mean)
        p = tl.where(ratio != ratio, 0.0, tl.minimum(tl.maximum(ratio, 0.0), 1.0))  # NaN (0/0) -> 0, inf -> 1
        dd = tl.arange(0, BLOCK_D)
        inside = dd < D
        gone = tl.load(v + drop * stride_vn + dd, mask=inside, other=0.0)
        dtype = V.dtype.element_ty
        share = (p.to(dtype).to(tl.float32) * gone.to(tl.float32)).to(dtype).to(tl.float32)  # matmul in dtype
        share = tl.math.div_rn(share, m.to(tl.float32))
        rows = v + target[:, None] * stride_vn + dd[None, :]
        both = inside_m[:, None] & inside[None, :]
        kept = tl.load(rows, mask=both, other=0.0).to(tl.float32)
        tl.store(rows, (kept + share[None, :]).to(dtype), mask=both)
        tl.debug_barrier()  # the merged targets are written before the newest entry (maybe one) moves
    _move(k, v, pos, RP + slot * stride_rs + h * stride_rh, acc, drop, n, tl.load(pos + n - 1), stride_kn, stride_vn,
          D, BLOCK_N, BLOCK_D, RENUMBER, True)


def cam_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
             accumulated: torch.Tensor, observation: torch.Tensor, n: int, rows: torch.Tensor | None = None,
             start: int = 0, m: int = 1, merge: bool = True, renumber: bool = False) -> torch.Tensor:
    """CaM's steady step in place: fold `observation` into the accumulated attention, drop each row's oldest
    entry past `start`, merge its value into the `m` entries that follow it in stream order (`merge`), write
    the newest entry (`n - 1`) over it. Returns the drops [B, KV, 1].

    keys/values [S, KV, C, D] (last stride 1), positions/rope_positions/accumulated [S, KV, C] (entries of a
    head contiguous), observation [B, KV, >= n] float32 (last stride 1), rows [B] int64 each batch row's slot
    (None: row b is slot b). The window after the dropped entry must hold the m positions that follow it."""
    slots, kv, capacity, d = keys.shape
    batch = slots if rows is None else rows.numel()
    if n < 2 or not 1 <= m < n:
        raise ValueError(f"cam_step: {n} live entries and m = {m}; need 1 <= m < n")
    for t in (positions, rope_positions, accumulated):
        if t.stride(-1) != 1:
            raise ValueError("cam_step: a head's entries must be contiguous")
    if observation.shape[:2] != (batch, kv) or observation.shape[2] < n or observation.stride(2) != 1:
        raise ValueError(f"cam_step: observation must be [{batch}, {kv}, >= {n}] with contiguous entries")
    drop = torch.empty(batch, kv, dtype=torch.long, device=keys.device)
    block_m = max(2, triton.next_power_of_2(m))
    targets = torch.empty(batch, kv, block_m, dtype=torch.long, device=keys.device) if merge else drop
    _cam_kernel[(batch, kv)](
        observation, accumulated, positions, rope_positions, keys, values, positions if rows is None else rows,
        drop, targets, n, start, m, observation.stride(0), observation.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        accumulated.stride(0), accumulated.stride(1),
        KV=kv, D=d, BLOCK_N=min(BLOCK, triton.next_power_of_2(n)), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=block_m, MERGE=merge, RENUMBER=renumber, HAS_ROWS=rows is not None,
        enable_fp_fusion=False,  # A's sum and the merge round as PyTorch's separate kernels do
    )
    return drop.view(batch, kv, 1)
