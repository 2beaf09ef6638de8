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
  found by a bitwise search for the count-th largest key (`_kth_largest`, 3 bits a reduction): first
  over the std's bits, then, among the entries tied at that std, over their age. No sort, no host
  synchronisation;
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
MOST = tl.constexpr(MAX_ENTRIES)  # the most chosen keys a search counts (2**14: each count fits 15 bits)
FIELD = tl.constexpr(0xFFFF)  # counts share an int64 sum, 16 bits apiece
ONES = tl.constexpr(0x0001000100010001)  # 1 in each of an int64's four 16-bit fields
SEARCH_BITS = 3  # bits the k-th largest search settles per reduction (2, 3 or 4; results do not depend on it)


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _histogram(keys, t, shift, BINS: tl.constexpr):
    """How many `keys` fall in each of the BINS bins of width 2**shift from t (the top bin also takes every
    key above; keys below t, -1 included, none), bin 4w + f in 16-bit field f of int64 word w: each key adds
    a one-hot value to one word, and the words are summed in one reduction (one barrier for all of them)."""
    d = tl.minimum((keys - t) >> shift, BINS - 1)  # no overflow: keys >= -1, 0 <= t < 2**31
    word = d >> 2  # negative below t: matches no word
    one = tl.full(d.shape, 1, tl.int64) << ((d & 3) << 4).to(tl.int64)
    zero = tl.full((), 0, tl.int64)
    h1, h2, h3 = zero, zero, zero
    if BINS <= 4:
        h0 = tl.sum(tl.where(word == 0, one, 0), axis=0)
    elif BINS <= 8:
        h0, h1 = tl.reduce((tl.where(word == 0, one, 0), tl.where(word == 1, one, 0)), 0, _add2)
    else:
        h0, h1, h2, h3 = tl.reduce((tl.where(word == 0, one, 0), tl.where(word == 1, one, 0),
                                    tl.where(word == 2, one, 0), tl.where(word == 3, one, 0)), 0, _add4)
    return h0, h1, h2, h3


@triton.jit
def _at_or_above(h0, h1, h2, h3):
    """From `_histogram`'s words, the keys in each bin or above, packed as the bins are: suffix sums within
    each word (field f: fields f to 3; no carry, as all fields sum to at most MOST), plus every later
    word's keys (its field 0 after the suffix) in all four fields."""
    s0, s1, s2, s3 = h0 + (h0 >> 16), h1 + (h1 >> 16), h2 + (h2 >> 16), h3 + (h3 >> 16)
    s0, s1, s2, s3 = s0 + (s0 >> 32), s1 + (s1 >> 32), s2 + (s2 >> 32), s3 + (s3 >> 32)
    t3 = s3 & FIELD
    t2 = t3 + (s2 & FIELD)
    t1 = t2 + (s1 & FIELD)
    return s0 + t1 * ONES, s1 + t2 * ONES, s2 + t3 * ONES, s3


@triton.jit
def _reaching(n0, n1, n2, n3, k):
    """How many of bins 1..15 have at least k (1 <= k <= MOST) keys at or above them (`_at_or_above`'s
    words), all fields at once: field + MOST - k lies in [0, 2**15) and has bit 14 set exactly where
    field >= k. Scalar work, but every thread repeats it (on the uniform datapath, compiled for sm_90)."""
    bias = (-k.to(tl.int64) + MOST) * ONES  # the tensor first: the interpreter would wrap constexpr - tensor
    flags = ((((n0 + bias) >> 14) & (ONES - 1))  # not bin 0: t itself
             + (((n1 + bias) >> 14) & ONES) + (((n2 + bias) >> 14) & ONES) + (((n3 + bias) >> 14) & ONES))
    flags = flags + (flags >> 32)
    flags = flags + (flags >> 16)
    return (flags & FIELD).to(tl.int32)


@triton.jit
def _field(n0, n1, n2, n3, i):
    """Bin i's field (0 <= i < 16) of the packed words."""
    w = i >> 2
    word = tl.where(w == 0, n0, tl.where(w == 1, n1, tl.where(w == 2, n2, n3)))
    return ((word >> ((i & 3) << 4).to(tl.int64)) & FIELD).to(tl.int32)


@triton.jit
def _step(keys, t, above, k, shift, BINS: tl.constexpr):
    """One step of the search over the window [t, t + BINS << shift): t moved to the highest bin with at
    least k keys at or above it; `above` (the keys at or above the window's end) to the keys at or above
    the new bin's end; and the keys at or above the new t."""
    h0, h1, h2, h3 = _histogram(keys, t, shift, BINS)
    n0, n1, n2, n3 = _at_or_above(h0, h1, h2, h3)
    c = _reaching(n0, n1, n2, n3, k)
    above = tl.where(c + 1 < BINS, _field(n0, n1, n2, n3, c + 1), above)  # the top bin ends with the window
    return t + (c << shift), above, _field(n0, n1, n2, n3, c)


@triton.jit
def _kth_search(keys, k, BITS: tl.constexpr):
    """For 1 <= k <= MOST: the k-th largest of the int32 `keys` (chosen keys non-negative, the others -1;
    0 if fewer than k are chosen), that is the largest t with at least k chosen keys >= t, and how many
    chosen keys are above t and at t. Built from the top bit down, BITS bits a step (the first step takes
    what is left of 31). The counts come with the steps (the keys at or above each bin are what a step
    counts), so the kernel needs no reduction of its own for them; and the caller masks the keys, so the
    unmasked values need not stay in registers beside them (ptxas runs short of registers here).

    Each step is one reduction over the tile, a block-wide barrier, and each depends on the one before:
    BITS = 4 takes 8 (3 + 7 x 4 bits), 3 takes 11 (1 + 10 x 3), 2 takes 16 (as the three-threshold search
    before it did). A step counts the chosen keys in each of its 2**BITS bins one-hot, bin 4w + f in 16-bit
    field f of int64 word w (2**BITS / 4 words, reduced together in one `tl.reduce`); the scalar tail
    (`_at_or_above`, `_reaching`) turns the bin counts into counts at or above each bin, all fields at once.

    Why 3 bits a step (`SEARCH_BITS`), one-hot: every warp repeats the per-key work (at bound 4,096 the
    tile is 8,192 wide: 16 keys a thread at 16 warps), so a step costs its per-key work and the reduction's
    shuffles (2 x 9 a word, in each warp) besides its barriers. Per key: a subtraction, a shift, a minimum,
    the one-hot value (a 64-bit shift) and, per word, a compare, two selects and a 64-bit add. Compiled for
    sm_90 (ptxas, the llama3-8b tile at 16 warps), a step's loop is 258 instructions a thread at 2 bits
    (the old three-threshold count of two bits: 249), 397 at 3, 675 at 4 (four words, and more spills):
    about 130 a bit at 2 and 3 bits, 170 at 4. So 3 bits cut the dependent steps from 16 to 11 for about
    the same work; 4 bits cut 3 more for a third more work a bit (which wins is the H100's to say:
    benchmarks/kernel-tuning-h100/micro.py --roco-bits times each). The scalar tail runs on the uniform
    datapath. Narrowing first (a max/min reduction to skip the chosen keys' common high bits) is left out:
    a std below 2 never sets bit 30 and the stds' exponents differ, so it would save at most one step for
    the reduction it costs; only the rare age search could gain."""
    tl.static_assert(keys.shape[0] <= MOST, "counts must fit a 16-bit field with a flag bit to spare")
    STEPS: tl.constexpr = (31 + BITS - 1) // BITS
    FIRST: tl.constexpr = 31 - BITS * (STEPS - 1)  # bits the first step takes
    zero = tl.full((), 0, tl.int32)
    t, above, at = _step(keys, zero, zero, k, 31 - FIRST, 1 << FIRST)  # no key reaches 2**31
    for i in range(1, STEPS):
        t, above, at = _step(keys, t, above, k, 31 - FIRST - BITS * i, 1 << BITS)
    return t, above, at - above  # the last bins are one value wide: above t = at or above t + 1


@triton.jit
def _kth_largest(values, chosen, k, BITS: tl.constexpr):
    """The k-th largest of the non-negative int32 `values` where `chosen`, for any k (`_kth_search`): the
    largest t with at least k chosen values >= t; 0 if fewer than k are chosen (always when k > MOST: the
    tile holds at most MOST), 2**31 - 1 if k < 1 (every t qualifies)."""
    keys = tl.where(chosen, values, -1)  # below every window: counted nowhere
    t, _, _ = _kth_search(keys, tl.minimum(tl.maximum(k, 1), MOST), BITS)
    return tl.where(k < 1, 0x7FFFFFFF, tl.where(k > MOST, 0, t))


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
    RENUMBER: tl.constexpr, HAS_ROWS: tl.constexpr, BITS: tl.constexpr, NEWEST_APART: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    head = slot * stride_ss + h * stride_sh  # the three statistics share one layout
    sums, squares, counts = SUM + head, SQUARES + head, COUNT + head
    pos = POS + slot * stride_ps + h * stride_ph
    obs = OBS + b.to(tl.int64) * stride_ob + h * stride_oh
    newest = n - 1
    # NEWEST_APART (a recent window of at least one place): the newest entry is never in the scope, so the
    # tile holds the n - 1 entries before it (at bound 4,096, a tile of 4,096 lanes, not 8,192) and the
    # newest is updated on its own
    j = tl.arange(0, BLOCK_N)
    live = j < (newest if NEWEST_APART else n)
    # UPDATE (one query saw every entry): sum += o, squares += o * o, count += 1
    o = tl.load(obs + j, mask=live, other=0.0)
    s = tl.load(sums + j, mask=live, other=0.0) + o
    q = tl.load(squares + j, mask=live, other=0.0) + o * o
    c = tl.load(counts + j, mask=live, other=0.0) + 1.0
    tl.store(sums + j, s, mask=live)
    tl.store(squares + j, q, mask=live)
    tl.store(counts + j, c, mask=live)
    if NEWEST_APART:
        o_new = tl.load(obs + newest)
        tl.store(sums + newest, tl.load(sums + newest) + o_new)
        tl.store(squares + newest, tl.load(squares + newest) + o_new * o_new)
        tl.store(counts + newest, tl.load(counts + newest) + 1.0)
    # RANK: mean and std as `statistics` computes them
    c = tl.maximum(c, 1.0)
    mean = tl.math.div_rn(s, c)
    std = tl.sqrt_rn(tl.maximum(tl.math.div_rn(q, c) - mean * mean, 0.0))
    p = tl.load(pos + j, mask=live, other=0)
    newest_pos = tl.load(pos + n - 1)
    scope = live & (j >= sinks) & (p <= newest_pos - recent)
    if count > 0:
        keys = tl.where(scope, std.to(tl.int32, bitcast=True), -1)  # a non-negative float orders as its bits
        t, greater, ties = _kth_search(keys, count, BITS)  # 1 <= count <= n <= MAX_ENTRIES
        need = count - greater
        # the ages of the entries tied at t (the older, the larger: stream positions of one head differ)
        aged = tl.where(keys == t, (newest_pos - p).to(tl.int32), -1)
        oldest = tl.full((), 0, tl.int32)  # every tied entry goes out of the scope, unless more than `need` tie
        if ties > need:
            oldest, _, _ = _kth_search(aged, need, BITS)  # 1 <= need <= ties
        mean = tl.where((keys > t) | (aged >= oldest), float("inf"), mean)
    # FIND: the lowest mean in the scope, the oldest among equal ones (`replace._order_key`: one reduction;
    # an empty scope gives place 0, as the comparisons it replaces did)
    key = tl.where(scope, _order_key(mean, p), LAST)
    _, drop = tl.min(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
    drop = drop.to(tl.int64)
    tl.store(DROP + b.to(tl.int64) * KV + h, drop)
    # MOVE: the newest entry's (updated) statistics, then the rest of it, over the dropped one
    tl.debug_barrier()  # every statistic is written back before the newest one's is read
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
              renumber: bool = False, warps: int | None = None, bits: int = SEARCH_BITS) -> torch.Tensor:
    """RoCo's steady step in place: fold `observation` into the statistics, drop each row's and head's
    entry by mean within the scope, write the newest entry (`n - 1`) over it. Returns the drops [B, KV, 1].

    keys/values [S, KV, C, D] (last stride 1), positions/rope_positions [S, KV, C] int64 and the statistics
    sums/squares/counts [S, KV, C] float32 (entries of a head contiguous; the three alike), observation
    [B, KV, >= n] float32 (last stride 1), rows [B] int64 each batch row's slot (None: row b is slot b),
    `volatile` the number of largest-std entries kept out of the scope (already capped at n). `warps` per
    program (default from the tile) and `bits` settled per step of the k-th largest search (2, 3 or 4):
    the results do not depend on them (tuning only)."""
    slots, kv, capacity, d = keys.shape
    batch = slots if rows is None else rows.numel()
    if not fits(n) or n < 2:
        raise ValueError(f"roco_step: {n} live entries; one launch takes 2 to {MAX_ENTRIES}")
    if bits not in (2, 3, 4):
        raise ValueError(f"roco_step: the search settles 2, 3 or 4 bits a step, not {bits}")
    if not 0 <= volatile <= n:
        raise ValueError(f"roco_step: {volatile} volatile entries of {n}")
    for t in (positions, rope_positions, sums, squares, counts):
        if t.stride(-1) != 1:
            raise ValueError("roco_step: a head's entries must be contiguous")
    if squares.stride() != sums.stride() or counts.stride() != sums.stride():
        raise ValueError("roco_step: the three statistics must share one layout")
    if observation.shape[:2] != (batch, kv) or observation.shape[2] < n or observation.stride(2) != 1:
        raise ValueError(f"roco_step: observation must be [{batch}, {kv}, >= {n}] with contiguous entries")
    drop = torch.empty(batch, kv, dtype=torch.long, device=keys.device)
    apart = recent >= 1  # the newest entry is within the recent window: outside the scope, outside the tile
    block = max(16, triton.next_power_of_2(n - 1 if apart else n))
    _roco_kernel[(batch, kv)](
        observation, sums, squares, counts, positions, rope_positions, keys, values,
        positions if rows is None else rows, drop, n, sinks, recent, volatile,
        observation.stride(0), observation.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        sums.stride(0), sums.stride(1),
        KV=kv, D=d, BLOCK_N=block, BLOCK_D=triton.next_power_of_2(d), RENUMBER=renumber, HAS_ROWS=rows is not None,
        BITS=bits, NEWEST_APART=apart,
        num_warps=max(4, min(32, block // 512)) if warps is None else warps,
        enable_fp_fusion=False,  # fused multiply-adds round otherwise
    )
    return drop.view(batch, kv, 1)


@triton.jit
def _kth_kernel(VALUES, CHOSEN, K, OUT, BLOCK: tl.constexpr, BITS: tl.constexpr, COUNTS: tl.constexpr):
    j = tl.arange(0, BLOCK)
    values, chosen, k = tl.load(VALUES + j), tl.load(CHOSEN + j) != 0, tl.load(K)
    if COUNTS:
        t, greater, ties = _kth_search(tl.where(chosen, values, -1), k, BITS)
        tl.store(OUT, t)
        tl.store(OUT + 1, greater)
        tl.store(OUT + 2, ties)
    else:
        tl.store(OUT, _kth_largest(values, chosen, k, BITS))


def kth_largest(values: torch.Tensor, chosen: torch.Tensor, k: torch.Tensor, bits: int = SEARCH_BITS) -> torch.Tensor:
    """`_kth_largest` alone (its test): values [N] int32 >= 0, chosen [N] int32 (0: not), k [1] int32, N a
    power of two up to MAX_ENTRIES, `bits` a step (2, 3 or 4) -> [1] int32."""
    return _kth(values, chosen, k, bits, False)


def kth_search(values: torch.Tensor, chosen: torch.Tensor, k: torch.Tensor, bits: int = SEARCH_BITS) -> torch.Tensor:
    """`_kth_search` alone (its test), as `kth_largest` takes its arguments, 1 <= k <= MAX_ENTRIES -> [3]
    int32: the k-th largest t, the chosen values above t, the chosen values equal to t."""
    return _kth(values, chosen, k, bits, True)


def _kth(values, chosen, k, bits, counts):
    out = torch.zeros(3 if counts else 1, dtype=torch.int32, device=values.device)
    _kth_kernel[(1,)](values, chosen, k, out, BLOCK=values.numel(), BITS=bits, COUNTS=counts)
    return out
