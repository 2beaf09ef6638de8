"""Triton: RoCo's steady decoding step in one launch per layer (issue 31).

For each batch row b (pool slot `rows[b]`) and KV head h, one program holds the head's live entries
`[0, n)` in one tile and:

- UPDATE: folds the step's observation into the stored statistics (sum, sum of squares, count: RoCo's
  `update_scores` for one query) and writes them back;
- RANK: mean and standard deviation of the attention each entry received (`roco.statistics`, with
  IEEE division and square root and no fused multiply-add, as PyTorch's kernels round them); the
  eviction scope is every entry but the first `sinks` places and those whose stream position is within
  `recent` of the newest's; the `count` entries of the scope with the largest std (the older first
  among equal ones: `roco.most_volatile`'s int64 key, std bits above the age) leave the scope. They are
  found by a bitwise search for the count-th largest key: first over the std's bits, then, among the
  entries tied at that std, over their age. No sort, no host synchronisation;
- FIND: the lowest mean in the scope leaves, the oldest among equal means (`replace.drop_index`);
- MOVE: the newest entry (`n - 1`) is written over it: keys, values, positions, RoPE positions (ranks
  renumbered with RENUMBER) and the three statistics (`replace._move`).

`kvpot.methods.roco.steady_reference` is the PyTorch path this must match exactly (tests/test_roco_kernel.py).
The tile spans the live entries, so `MAX_ENTRIES` bounds what one launch takes; above it RoCo keeps
its PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpot.kernels.replace import LAST, _move, _order_key

MAX_ENTRIES = 16384  # one tile of int32/float32 arrays in registers (32 warps): RoCo budgets up to 16K
TOP = tl.constexpr(1 << 30)  # the highest bit of a non-negative float32's bits, and of an age below 2**31
FIELD = tl.constexpr(0xFFFF)  # three counts (each at most MAX_ENTRIES) share one int64 sum, 16 bits apiece


@triton.jit
def _kth_largest(values, chosen, k):
    """The k-th largest of the non-negative int32 `values` where `chosen` (0 if fewer than k): the largest
    t with at least k chosen values >= t, built from the top bit down. Bit 30 alone, then two bits a step,
    whose three candidates are counted in one reduction: 16 reductions in all (each a barrier)."""
    top = tl.full((), TOP, tl.int32)
    t = tl.where(tl.sum((chosen & (values >= top)).to(tl.int32), axis=0) >= k, top, tl.full((), 0, tl.int32))
    unit = tl.full((), TOP >> 2, tl.int32)  # the lower bit of the pair
    for _ in range(15):
        c1 = t + unit
        c2 = c1 + unit
        c3 = c2 + unit  # below 2**31: t holds no bit under the pair
        packed = ((values >= c1).to(tl.int64) + ((values >= c2).to(tl.int64) << 16)
                  + ((values >= c3).to(tl.int64) << 32))
        counts = tl.sum(tl.where(chosen, packed, 0), axis=0)
        t = tl.where((counts >> 32) >= k, c3, tl.where(((counts >> 16) & FIELD) >= k, c2,
                                                       tl.where((counts & FIELD) >= k, c1, t)))
        unit = unit >> 2
    return t


@triton.jit(do_not_specialize=["n", "sinks", "recent", "count", "stride_ob", "stride_oh", "stride_ks",
                               "stride_vs", "stride_ps", "stride_rs", "stride_ss"])
def _roco_kernel(
    OBS,  # [B, KV, >= n] float32 the step's observation (attention received, heads of a group averaged)
    SUM, SQUARES, COUNT,  # [S, KV, C] float32 RoCo's stored statistics (read and rewritten)
    POS,  # [S, KV, C] int64 stream positions, the newest entry at n - 1
    RP,  # [S, KV, C] int64 RoPE positions (ranks with RENUMBER)
    K, V,  # [S, KV, C, D] keys and values (last stride 1)
    ROWS,  # [B] int64 each batch row's slot (HAS_ROWS; else row b is slot b)
    DROP,  # [B, KV] int64 the entry each head drops (written)
    n, sinks, recent, count,  # live entries, protected sinks / recent, volatile entries kept out of the scope
    stride_ob, stride_oh, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_rs, stride_rh, stride_ss, stride_sh,
    KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    RENUMBER: tl.constexpr, HAS_ROWS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    head = slot * stride_ss + h * stride_sh  # the three statistics share one layout
    sums, squares, counts = SUM + head, SQUARES + head, COUNT + head
    pos = POS + slot * stride_ps + h * stride_ph
    j = tl.arange(0, BLOCK_N)
    live = j < n
    # UPDATE (one query saw every entry): sum += o, squares += o * o, count += 1
    o = tl.load(OBS + b.to(tl.int64) * stride_ob + h * stride_oh + j, mask=live, other=0.0)
    s = tl.load(sums + j, mask=live, other=0.0) + o
    q = tl.load(squares + j, mask=live, other=0.0) + o * o
    c = tl.load(counts + j, mask=live, other=0.0) + 1.0
    tl.store(sums + j, s, mask=live)
    tl.store(squares + j, q, mask=live)
    tl.store(counts + j, c, mask=live)
    # RANK: mean and std as `statistics` computes them
    c = tl.maximum(c, 1.0)
    mean = tl.math.div_rn(s, c)
    std = tl.sqrt_rn(tl.maximum(tl.math.div_rn(q, c) - mean * mean, 0.0))
    p = tl.load(pos + j, mask=live, other=0)
    newest_pos = tl.load(pos + n - 1)
    scope = live & (j >= sinks) & (p <= newest_pos - recent)
    if count > 0:
        bits = std.to(tl.int32, bitcast=True)  # a non-negative float orders as its bits
        age = (newest_pos - p).to(tl.int32)  # the older, the larger (stream positions of one head differ)
        t = _kth_largest(bits, scope, count)
        tied = scope & (bits == t)
        # both counts in one reduction (each at most MAX_ENTRIES < 2**16): above t, and tied at t
        both = tl.sum((scope & (bits > t)).to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)
        need = count - (both & FIELD)
        oldest = tl.full((), 0, tl.int32)  # every tied entry goes out of the scope, unless more than `need` tie
        if (both >> 16) > need:
            oldest = _kth_largest(age, tied, need)
        volatile = scope & ((bits > t) | (tied & (age >= oldest)))
        mean = tl.where(volatile, float("inf"), mean)
    # FIND: the lowest mean in the scope, the oldest among equal ones (`replace._order_key`: one reduction;
    # an empty scope gives place 0, as the comparisons it replaces did)
    key = tl.where(scope, _order_key(mean, p), LAST)
    _, drop = tl.min(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
    drop = drop.to(tl.int64)
    tl.store(DROP + b.to(tl.int64) * KV + h, drop)
    # MOVE: the newest entry's (updated) statistics, then the rest of it, over the dropped one
    tl.debug_barrier()  # every statistic is written back before the newest one's is read
    newest = n - 1
    tl.store(squares + drop, tl.load(squares + newest))
    tl.store(counts + drop, tl.load(counts + newest))
    _move(K + slot * stride_ks + h * stride_kh, V + slot * stride_vs + h * stride_vh, pos,
          RP + slot * stride_rs + h * stride_rh, sums, drop, n, newest_pos, stride_kn, stride_vn,
          D, BLOCK_N, BLOCK_D, RENUMBER, True)


def fits(n: int) -> bool:
    """Whether one launch takes `n` live entries per head."""
    return n <= MAX_ENTRIES


def roco_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
              sums: torch.Tensor, squares: torch.Tensor, counts: torch.Tensor, observation: torch.Tensor, n: int,
              rows: torch.Tensor | None = None, sinks: int = 0, recent: int = 0, volatile: int = 0,
              renumber: bool = False, warps: int | None = None) -> torch.Tensor:
    """RoCo's steady step in place: fold `observation` into the statistics, drop each row's and head's
    entry by mean within the scope, write the newest entry (`n - 1`) over it. Returns the drops [B, KV, 1].

    keys/values [S, KV, C, D] (last stride 1), positions/rope_positions [S, KV, C] int64 and the statistics
    sums/squares/counts [S, KV, C] float32 (entries of a head contiguous; the three alike), observation
    [B, KV, >= n] float32 (last stride 1), rows [B] int64 each batch row's slot (None: row b is slot b),
    `volatile` the number of largest-std entries kept out of the scope (already capped at n). `warps` per
    program (default from the tile; the results do not depend on it: tuning only)."""
    slots, kv, capacity, d = keys.shape
    batch = slots if rows is None else rows.numel()
    if not fits(n) or n < 2:
        raise ValueError(f"roco_step: {n} live entries; one launch takes 2 to {MAX_ENTRIES}")
    for t in (positions, rope_positions, sums, squares, counts):
        if t.stride(-1) != 1:
            raise ValueError("roco_step: a head's entries must be contiguous")
    if squares.stride() != sums.stride() or counts.stride() != sums.stride():
        raise ValueError("roco_step: the three statistics must share one layout")
    if observation.shape[:2] != (batch, kv) or observation.shape[2] < n or observation.stride(2) != 1:
        raise ValueError(f"roco_step: observation must be [{batch}, {kv}, >= {n}] with contiguous entries")
    drop = torch.empty(batch, kv, dtype=torch.long, device=keys.device)
    block = max(16, triton.next_power_of_2(n))
    _roco_kernel[(batch, kv)](
        observation, sums, squares, counts, positions, rope_positions, keys, values,
        positions if rows is None else rows, drop, n, sinks, recent, volatile,
        observation.stride(0), observation.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        sums.stride(0), sums.stride(1),
        KV=kv, D=d, BLOCK_N=block, BLOCK_D=triton.next_power_of_2(d), RENUMBER=renumber, HAS_ROWS=rows is not None,
        num_warps=max(4, min(32, block // 512)) if warps is None else warps,
        enable_fp_fusion=False,  # fused multiply-adds round otherwise
    )
    return drop.view(batch, kv, 1)


@triton.jit
def _kth_kernel(VALUES, CHOSEN, K, OUT, BLOCK: tl.constexpr):
    j = tl.arange(0, BLOCK)
    tl.store(OUT, _kth_largest(tl.load(VALUES + j), tl.load(CHOSEN + j) != 0, tl.load(K)))


def kth_largest(values: torch.Tensor, chosen: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`_kth_largest` alone (its test): values [N] int32 >= 0, chosen [N] int32 (0: not), k [1] int32, N a
    power of two -> [1] int32."""
    out = torch.zeros(1, dtype=torch.int32, device=values.device)
    _kth_kernel[(1,)](values, chosen, k, out, BLOCK=values.numel())
    return out
