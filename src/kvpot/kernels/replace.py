"""Triton: a steady decoding step's one-entry eviction by replacement, in one launch per layer (issue 30).

For each batch row b (pool slot `rows[b]`) and KV head h, one program:

- FIND: the entry of the live `[0, n)` that leaves: the lowest score, the oldest (smallest stream
  position) among equal scores; the first `sinks` entries and those whose stream position is within
  `recent` of the newest entry's (the last, `n - 1`) never leave. Scores `[B, H, n]` with H = KV (per
  head) or 1 (one selection shared by the heads); none (`AGE`): the oldest leaves (StreamingLLM's ring).
  The score may be folded from the step's observation `[B, KV, n]` in the same pass: `ADD` adds it into
  the stored score and ranks by the sum (H2O's and D2O's accumulated attention, written back), `HEADS`
  ranks by its sum over the KV heads, added in head order (TOVA's shared selection: every head's program
  adds the same numbers in the same order, so all agree on the drop). One reduction per tile: the score
  and the stream position packed into one int64 (`_order_key`; stream positions below 2**32);
- MOVE: the newest entry written over it in keys, values, positions, RoPE positions and one stored
  score array; with `RENUMBER` (rank positions) the entries ranked after it move down by one.

D2O's step (`d2o_step`) is one launch too: every split of a head's entries finds the drop, searches its
share for the most similar key (eq. 9), and the split that finishes last (an atomic count per head)
reduces the splits' answers, merges (eqs. 10-12), folds the observation into the scores and moves.

`kvpot.methods.replace` holds the PyTorch path these must match (`drop_index`, `renumber`, `move`;
tests/test_replace_kernel.py). Nothing synchronises with the host: a step captures it in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# int64 max: a position no entry has (loses every tie); constexpr: a global a jit function reads
LAST = tl.constexpr(9223372036854775807)
BLOCK = 1024  # entries per loop step of a move's renumbering (kernels/cam.py)
TILE = 8192  # entries per loop step: a steady step's n (bound + 1) in one tile up to a bound of 8191


def tile(n: int) -> tuple[int, int]:
    """The find's tile over `n` live entries and its warps (one pass where it fits: no loop-carried latency)."""
    block = min(TILE, triton.next_power_of_2(max(n, 16)))
    return block, max(4, min(16, block // 512))


@triton.jit
def _move(k, v, pos, rp, sc, drop, n, newest_pos, stride_kn, stride_vn,
          D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RENUMBER: tl.constexpr,
          HAS_SC: tl.constexpr):
    """One head's newest entry (n - 1) written over entry `drop` (pointers at the head's entries). Everything
    it reads (the newest entry, the ranks' first tile) is loaded before anything is written: one round trip
    to memory, then the stores."""
    newest = n - 1
    dd = tl.arange(0, BLOCK_D)
    inside = dd < D
    key = tl.load(k + newest * stride_kn + dd, mask=inside)
    value = tl.load(v + newest * stride_vn + dd, mask=inside)
    if HAS_SC:
        score = tl.load(sc + newest)
    if RENUMBER:
        j = tl.arange(0, BLOCK_N)
        first = tl.load(rp + j, mask=j < n, other=0)
        rank = tl.load(rp + drop)
        moved = tl.load(rp + newest)
        moved = moved - (moved > rank).to(tl.int64)
        tl.debug_barrier()  # every thread has read both ranks (and the first tile) before any is rewritten
        tl.store(rp + j, tl.where(j == drop, moved, first - (first > rank).to(tl.int64)), mask=j < n)
        for start in range(BLOCK_N, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            live = j < n
            r = tl.load(rp + j, mask=live, other=0)
            r = tl.where(j == drop, moved, r - (r > rank).to(tl.int64))
            tl.store(rp + j, r, mask=live)
    else:
        tl.store(rp + drop, tl.load(rp + newest))
    tl.store(pos + drop, newest_pos)
    if HAS_SC:
        tl.store(sc + drop, score)
    tl.store(k + drop * stride_kn + dd, key, mask=inside)
    tl.store(v + drop * stride_vn + dd, value, mask=inside)


@triton.jit
def _order_key(s, p):
    """(score, stream position) as one int64 that orders as the pair: the lower score first, the older
    among equal scores (p in [0, 2**32)). -0.0 is 0.0; negative floats' bits reversed to order as ints."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (bits.to(tl.int64) << 32) | p


@triton.jit
def _find(pos, score, stride_ss, sc, obs, stride_oh, n, sinks, recent, newest_pos,
          KV: tl.constexpr, BLOCK_N: tl.constexpr, AGE: tl.constexpr, ADD: tl.constexpr, HEADS: tl.constexpr,
          WRITE: tl.constexpr):
    """One head's drop (int64) among its `n` live entries (pointers at the head's entries; `obs` at head 0
    of the row with HEADS). Ranked by `score` (strided), or the age (AGE), or `sc` + `obs` (ADD: the sums
    written back into `sc` with WRITE), or the sum of `obs` over the KV heads in head order (HEADS)."""
    best = tl.full((), LAST, tl.int64)
    best_j = tl.full((), 0, tl.int32)
    for start in range(0, n, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        live = j < n
        p = tl.load(pos + j, mask=live, other=0)
        ok = live & (j >= sinks) & (p <= newest_pos - recent)  # recent 0: every position is at most the newest's
        if AGE:
            s = tl.zeros([BLOCK_N], tl.float32)
        elif ADD:
            s = tl.load(sc + j, mask=live, other=0.0) + tl.load(obs + j, mask=live, other=0.0)
            if WRITE:
                tl.store(sc + j, s, mask=live)
        elif HEADS:
            s = tl.load(obs + j, mask=live, other=0.0)
            for head in tl.static_range(1, KV):
                s = s + tl.load(obs + head * stride_oh + j, mask=live, other=0.0)
        else:
            s = tl.load(score + j * stride_ss, mask=live, other=0.0)
        key = tl.where(ok, _order_key(s, p), LAST)
        low, at = tl.min(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = low < best  # an earlier tile keeps a tie: the first place, as an arg-min
        best = tl.where(better, low, best)
        best_j = tl.where(better, start + at, best_j)
    return best_j.to(tl.int64)


@triton.jit(do_not_specialize=["n", "sinks", "recent", "stride_sb", "stride_sh", "stride_ss", "stride_ks",
                               "stride_vs", "stride_rs", "stride_cs", "stride_ob", "stride_oh"])
def _replace_kernel(
    SCORES,  # [B, H, n] float32 ranking (H = KV, or 1: shared by the heads); read without AGE, ADD, HEADS
    OBS,  # [B, KV, n] float32 the step's observation (ADD, HEADS; last stride 1)
    POS,  # [S, KV, C] int64 stream positions, the newest entry at n - 1
    RP,  # [S, KV, C] int64 RoPE positions (ranks with RENUMBER)
    K, V,  # [S, KV, C, D] keys and values (last stride 1)
    SC,  # [S, KV, C] float32 a stored score that moves with its entry (HAS_SC; ADD: the sum it ranks by)
    ROWS,  # [B] int64 each batch row's slot (HAS_ROWS; else row b is slot b)
    DROP,  # [B, KV] int64: written by FIND, read by MOVE without FIND
    n, sinks, recent,
    stride_sb, stride_sh, stride_ss, stride_ob, stride_oh,
    stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_rs, stride_rh, stride_cs, stride_ch,
    KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    AGE: tl.constexpr, ADD: tl.constexpr, HEADS: tl.constexpr, RENUMBER: tl.constexpr, HAS_SC: tl.constexpr,
    HAS_ROWS: tl.constexpr, FIND: tl.constexpr, MOVE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    pos = POS + slot * stride_ps + h * stride_ph  # entries of one head: stride 1
    sc = SC + slot * stride_cs + h * stride_ch
    newest_pos = tl.load(pos + n - 1)
    if FIND:
        score = SCORES + b.to(tl.int64) * stride_sb + h * stride_sh  # stride_sh 0: shared by the heads
        obs = OBS + b.to(tl.int64) * stride_ob  # HEADS: every head's program reads them all
        if not HEADS:
            obs += h * stride_oh
        drop = _find(pos, score, stride_ss, sc, obs, stride_oh, n, sinks, recent, newest_pos,
                     KV, BLOCK_N, AGE, ADD, HEADS, MOVE)
        tl.store(DROP + b.to(tl.int64) * KV + h, drop)
        if ADD:
            tl.debug_barrier()  # the newest entry's summed score is written before MOVE reads it
    else:
        drop = tl.load(DROP + b.to(tl.int64) * KV + h)
    if MOVE:
        _move(K + slot * stride_ks + h * stride_kh, V + slot * stride_vs + h * stride_vh, pos,
              RP + slot * stride_rs + h * stride_rh, sc, drop, n, newest_pos,
              stride_kn, stride_vn, D, BLOCK_N, BLOCK_D, RENUMBER, HAS_SC)


def replace_newest(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
                   n: int, scores: torch.Tensor | None = None, stored: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None, sinks: int = 0, recent: int = 0, renumber: bool = False,
                   drop: torch.Tensor | None = None, find: bool = True, move: bool = True,
                   observation: torch.Tensor | None = None, fold: str | None = None) -> torch.Tensor:
    """Find the entry each row and head drops and write the newest entry (`n - 1`) over it, in place.

    keys/values [S, KV, C, D] (last stride 1), positions/rope_positions [S, KV, C] int64 (entries of a head
    contiguous), `stored` [S, KV, C] float32 (one score array moved with the entries, or None), `rows` [B]
    int64 each batch row's slot (None: row b is slot b, B = S), `scores` [B, KV | 1, >= n] float32 (None:
    the oldest goes). `find=False` moves the entries `drop` [B, KV] names; `move=False` only finds.
    `fold` ranks by the step's `observation` [B, KV, >= n] float32 instead of `scores`: "add" (`stored` +=
    observation over the live entries, ranked by the sums; with `move=False` nothing is written) or
    "heads" (its sum over the KV heads: one selection shared by the heads).
    Returns the dropped entries [B, KV, 1] int64.
    """
    slots, kv, capacity, d = keys.shape
    batch = slots if rows is None else rows.numel()
    for buf in (positions, rope_positions) + (() if stored is None else (stored,)):
        if buf.shape != (slots, kv, capacity) or buf.stride(-1) != 1:
            raise ValueError(f"replace_newest: buffers must be [{slots}, {kv}, {capacity}] with entries contiguous")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or values.shape[:3] != keys.shape[:3]:
        raise ValueError("replace_newest: keys and values must share [S, KV, C] and be contiguous in the last dim")
    if not 0 < n <= capacity:
        raise ValueError(f"replace_newest: n={n} live entries do not fit a capacity of {capacity}")
    if fold is not None:
        _check_fold(fold, observation, stored, batch, kv, n)
    elif find and scores is not None and (scores.dim() != 3 or scores.shape[0] != batch
                                          or scores.shape[1] not in (1, kv) or scores.shape[2] < n):
        raise ValueError(f"replace_newest: scores must be [{batch}, {kv} or 1, >= {n}], got {tuple(scores.shape)}")
    if drop is None:
        drop = torch.empty(batch, kv, dtype=torch.long, device=keys.device)
    elif not find and (drop.shape[:2] != (batch, kv) or not drop.is_contiguous()):
        drop = drop.expand(batch, kv, 1).reshape(batch, kv).contiguous()
    age = fold is None and scores is None
    score_arg = positions if scores is None or fold is not None else scores
    score_strides = (0, 0, 0) if score_arg is positions else (
        scores.stride(0), scores.stride(1) if scores.shape[1] > 1 else 0, scores.stride(2))
    obs = positions if observation is None else observation
    block, warps = tile(n)
    _replace_kernel[(batch, kv)](
        score_arg, obs, positions, rope_positions, keys, values, positions if stored is None else stored,
        positions if rows is None else rows, drop, n, sinks, recent,
        *score_strides, *((0, 0) if observation is None else (observation.stride(0), observation.stride(1))),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        *((0, 0) if stored is None else (stored.stride(0), stored.stride(1))),
        KV=kv, D=d, BLOCK_N=block, BLOCK_D=triton.next_power_of_2(d),
        AGE=age, ADD=fold == "add", HEADS=fold == "heads", RENUMBER=renumber, HAS_SC=stored is not None,
        HAS_ROWS=rows is not None, FIND=find, MOVE=move, num_warps=warps,
    )
    return drop.view(batch, kv, 1)


def _check_fold(fold: str, observation, stored, batch: int, kv: int, n: int) -> None:
    if fold not in ("add", "heads"):
        raise ValueError(f"replace_newest: fold must be 'add' or 'heads', got {fold!r}")
    if (observation is None or observation.dtype != torch.float32 or observation.dim() != 3
            or observation.shape[:2] != (batch, kv) or observation.shape[2] < n or observation.stride(-1) != 1):
        shape = None if observation is None else tuple(observation.shape)
        raise ValueError(f"replace_newest: the observation must be float32 [{batch}, {kv}, >= {n}] with entries "
                         f"contiguous, got {shape}")
    if fold == "add" and (stored is None or stored.dtype != torch.float32):
        raise ValueError("replace_newest: fold='add' adds into a float32 stored score")


@triton.jit
def _unit_gone(k, drop, stride_kn, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The evicted key in float32 and scaled to unit length (`F.normalize`)."""
    dd = tl.arange(0, BLOCK_D)
    gone = tl.load(k + drop * stride_kn + dd, mask=dd < D, other=0.0).to(tl.float32)
    return gone, gone / tl.maximum(tl.sqrt(tl.sum(gone * gone, axis=0)), 1e-12)


@triton.jit
def _nearest_split(k, pos, drop, n, split, stride_kn,
                   SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """D2O eq. 9 over split `split` of one head's live entries (pointers at the head's entries): the entry
    most cosine-similar to entry `drop`, the oldest among equal ones -> (similarity, position, index).
    Each lane keeps its own best over the split's tiles and the lanes are reduced once at the end: a
    reduction is a barrier, and one per tile made the search latency-bound (H100: 4x slower)."""
    _, unit = _unit_gone(k, drop, stride_kn, D, BLOCK_D)
    dd = tl.arange(0, BLOCK_D)
    share = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * share
    hi = tl.minimum(lo + share, n)
    lane = tl.full([BLOCK_N], LAST, tl.int64)  # (-similarity, position) packed: the lowest is the nearest
    lane_j = tl.zeros([BLOCK_N], tl.int32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        live = j < hi
        rows = tl.load(k + j[:, None] * stride_kn + dd[None, :], mask=live[:, None] & (dd[None, :] < D),
                       other=0.0).to(tl.float32)
        norm = tl.maximum(tl.sqrt(tl.sum(rows * rows, axis=1)), 1e-12)
        s = tl.sum((rows / norm[:, None]) * unit[None, :], axis=1)
        p = tl.load(pos + j, mask=live, other=0)
        key = tl.where(live & (j != drop), _order_key(-s, p), LAST)
        better = key < lane
        lane = tl.where(better, key, lane)
        lane_j = tl.where(better, j, lane_j)
    top = tl.min(lane, axis=0)
    best_j = tl.min(tl.where(lane == top, lane_j, 2147483647), axis=0)
    bits = (top >> 32).to(tl.int32)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # `_order_key`'s map is its own inverse
    best = -(bits.to(tl.float32, bitcast=True))
    empty = top == LAST  # no entry in this split: it loses to every other split
    return (tl.where(empty, float("-inf"), best), tl.where(empty, LAST, top & 0xFFFFFFFF),
            tl.where(empty, 0, best_j))


@triton.jit
def _merge_into(k, v, drop, tau, best_s, best_p, best_j, beta, stride_kn, stride_vn,
                SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FIRST: tl.constexpr):
    """D2O eqs. 10-12 for one head (pointers at its entries; `tau` its threshold; `best_*` its SPLITS
    answers of `_nearest_split`, read past the L1: other programs wrote them): the nearest other entry,
    the threshold's EMA, the weighted merge of entry `drop` into it (the target alone is written)."""
    gone, _ = _unit_gone(k, drop, stride_kn, D, BLOCK_D)
    sp = tl.arange(0, SPLITS)
    s = tl.load(best_s + sp, cache_modifier=".cg")
    p = tl.load(best_p + sp, cache_modifier=".cg")
    best = tl.max(s, axis=0)
    oldest = tl.min(tl.where(s == best, p, LAST), axis=0)
    j = tl.load(best_j + sp, cache_modifier=".cg")
    target = tl.min(tl.where((s == best) & (p == oldest), j, 2147483647), axis=0).to(tl.int64)
    # eq. 10: tau_t = beta * max U_t + (1 - beta) * tau_{t-1} (the first eviction: the mean, one value here)
    if FIRST:
        t = best
    else:
        t = beta * best + (1 - beta) * tl.load(tau)
    tl.store(tau, t)
    # eq. 12: k_c <- (e k_c + exp(u) k_i) / (e + exp(u)) where u >= tau; else k_c unchanged
    weight = tl.where(best >= t, tl.exp(best), 0.0)
    denominator = 2.718281828459045 + weight
    dd = tl.arange(0, BLOCK_D)
    inside = dd < D
    kept = tl.load(k + target * stride_kn + dd, mask=inside, other=0.0).to(tl.float32)
    merged = (kept * 2.718281828459045 + gone * weight) / denominator
    tl.store(k + target * stride_kn + dd, merged.to(k.dtype.element_ty), mask=inside)
    kept = tl.load(v + target * stride_vn + dd, mask=inside, other=0.0).to(tl.float32)
    gone_v = tl.load(v + drop * stride_vn + dd, mask=inside, other=0.0).to(tl.float32)
    merged = (kept * 2.718281828459045 + gone_v * weight) / denominator
    tl.store(v + target * stride_vn + dd, merged.to(v.dtype.element_ty), mask=inside)


def d2o_splits(n: int) -> int:
    """`d2o_step`'s programs per head for `n` live entries: 16, fewer only below 64 entries a split. On an
    H100 (8 KV heads, 4,097-5,424 entries, `records/kernel-tuning-h100/`) a split searched about 256
    keys in 18 us, so its share sets the launch's time: 16 splits took 30-35 us a launch, 8 took 48-65;
    32 took 38-44, because past one program per multiprocessor every added split repeats the find."""
    return max(1, min(16, triton.next_power_of_2(triton.cdiv(n, 64))))


def _check_merge(keys, values, tau, batch: int, kv: int) -> None:
    if keys.dtype not in (torch.float16, torch.bfloat16) or values.dtype != keys.dtype:
        raise ValueError(f"d2o_step: keys and values must be float16 or bfloat16, got {keys.dtype}")
    if tau.shape != (batch, kv) or tau.dtype != torch.float32 or not tau.is_contiguous():
        raise ValueError(f"d2o_step: tau must be a contiguous float32 [{batch}, {kv}] tensor")


@triton.jit(do_not_specialize=["n", "ranked", "sinks", "recent", "beta", "stride_ob", "stride_oh", "stride_ks",
                               "stride_vs", "stride_ps", "stride_rs", "stride_cs"])
def _d2o_kernel(
    K, V,  # [S, KV, C, D] half-precision keys and values (last stride 1)
    POS, RP,  # [S, KV, C] int64 stream and RoPE positions (the newest entry at n - 1)
    SC,  # [S, KV, C] float32 the accumulated attention (eq. 6): ranked by with the step's added, written back
    OBS,  # [B, KV, n] float32 the step's observation (last stride 1)
    ROWS,  # [B] int64 each batch row's slot (HAS_ROWS; else row b is slot b)
    DROP,  # [B, KV] int64 out: the entry each head evicted
    TAU,  # [B, KV] float32 D2O's threshold: read (unless FIRST) and rewritten
    BEST, BEST_P, BEST_J,  # [B, KV, SPLITS] scratch: each split's nearest entry (similarity, position, index)
    COUNT,  # [B, KV] int32 splits finished per head: zero before, reset to zero by the last
    n, ranked, sinks, recent, beta,  # ranked: the entries the find ranks (n - 1 when the newest is recent)
    stride_ob, stride_oh, stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_rs, stride_rh, stride_cs, stride_ch,
    KV: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr, FIRST: tl.constexpr,
    RENUMBER: tl.constexpr,
):
    """D2O's steady step for one split of one head: the drop (every split finds the same), this split's
    nearest entry to it; the last split to finish merges, adds the observation into the scores and moves."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    at = b.to(tl.int64) * KV + h
    k = K + slot * stride_ks + h * stride_kh
    v = V + slot * stride_vs + h * stride_vh
    pos = POS + slot * stride_ps + h * stride_ph
    sc = SC + slot * stride_cs + h * stride_ch
    obs = OBS + b.to(tl.int64) * stride_ob + h * stride_oh
    newest_pos = tl.load(pos + n - 1)
    # the scores are read, not written, until every split has found the drop from them. Every split repeats
    # the find: over the entries before the newest where a recent window keeps the newest out of reach
    # (at bound 4,096: one 4,096-lane tile, not 8,192)
    drop = _find(pos, sc, 0, sc, obs, 0, ranked, sinks, recent, newest_pos, KV, BLOCK_R, False, True, False,
                 False)
    best, best_p, best_j = _nearest_split(k, pos, drop, n, split, stride_kn, SPLITS, D, BLOCK_N, BLOCK_D)
    out = at * SPLITS + split
    tl.store(BEST + out, best)
    tl.store(BEST_P + out, best_p)
    tl.store(BEST_J + out, best_j)
    tl.debug_barrier()  # this program's answer is written before the count says so (released by the atomic)
    if tl.atomic_add(COUNT + at, 1, sem="acq_rel") == SPLITS - 1:  # the last: every split has answered
        tl.store(COUNT + at, 0)
        tl.store(DROP + at, drop)
        _merge_into(k, v, drop, TAU + at, BEST + at * SPLITS, BEST_P + at * SPLITS, BEST_J + at * SPLITS, beta,
                    stride_kn, stride_vn, SPLITS, D, BLOCK_D, FIRST)
        for start in range(0, n, BLOCK_F):  # eq. 6: the step's attention added to every live entry's score
            j = start + tl.arange(0, BLOCK_F)
            live = j < n
            tl.store(sc + j, tl.load(sc + j, mask=live, other=0.0) + tl.load(obs + j, mask=live, other=0.0), mask=live)
        tl.debug_barrier()  # the merged target and the newest entry's score are written before the move
        _move(k, v, pos, RP + slot * stride_rs + h * stride_rh, sc, drop, n, newest_pos, stride_kn, stride_vn,
              D, BLOCK_F, BLOCK_D, RENUMBER, True)


def d2o_step(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
             stored: torch.Tensor, observation: torch.Tensor, n: int, tau: torch.Tensor, beta: float, first: bool,
             count: torch.Tensor, rows: torch.Tensor | None = None, sinks: int = 0, recent: int = 0,
             renumber: bool = False, splits: int | None = None, warps: int | None = None,
             block_n: int = 32) -> torch.Tensor:
    """D2O's steady decoding step in one launch: `stored` [S, KV, C] float32 (the accumulated attention)
    += `observation` [B, KV, >= n] float32 over the `n` live entries; each head drops the lowest sum
    (`replace_newest`'s rule with `sinks`, `recent`), merged into its most similar other entry (eqs. 9-12:
    `tau` [B, KV] float32 the threshold, rewritten; `first`: its first eviction, tau becomes the similarity;
    in half precision, where `(k e) / e` is k, only the target is written); the newest entry takes its slot.
    keys/values [S, KV, C, D] half precision, positions/rope_positions [S, KV, C] int64, rows [B] int64 the
    slots (None: all S), `count` [B, KV] int32 zeros (left at zero). Returns the dropped entries [B, KV, 1].
    Launch shape (the results do not depend on it; tuning only): `splits` programs per head (a power of
    two; default `d2o_splits(n)`), `warps` per program (default `tile(n)`'s), `block_n` keys per step
    of the nearest-key search (defaults: the fastest on an H100 at the `llama3-8b` step,
    `records/kernel-tuning-h100/`)."""
    slots, kv, capacity, d = keys.shape
    batch = slots if rows is None else rows.numel()
    _check_merge(keys, values, tau, batch, kv)
    _check_fold("add", observation, stored, batch, kv, n)
    for buf in (positions, rope_positions, stored):
        if buf.shape != (slots, kv, capacity) or buf.stride(-1) != 1:
            raise ValueError(f"d2o_step: buffers must be [{slots}, {kv}, {capacity}] with entries contiguous")
    if count.shape != (batch, kv) or count.dtype != torch.int32 or not count.is_contiguous():
        raise ValueError(f"d2o_step: count must be a contiguous int32 [{batch}, {kv}] tensor of zeros")
    splits = d2o_splits(n) if splits is None else splits
    if splits < 1 or splits & (splits - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"d2o_step: splits ({splits}) and block_n ({block_n} >= 16) must be powers of two")
    best = torch.empty(batch, kv, splits, dtype=torch.float32, device=keys.device)
    best_p = torch.empty(batch, kv, splits, dtype=torch.long, device=keys.device)
    best_j = torch.empty(batch, kv, splits, dtype=torch.int32, device=keys.device)
    drop = torch.empty(batch, kv, dtype=torch.long, device=keys.device)
    block, tiled = tile(n)
    warps = tiled if warps is None else warps
    ranked = n - 1 if recent >= 1 else n  # the newest entry within the recent window is never dropped
    _d2o_kernel[(batch, kv, splits)](
        keys, values, positions, rope_positions, stored, observation, positions if rows is None else rows, drop,
        tau, best, best_p, best_j, count, n, ranked, sinks, recent, float(beta),
        observation.stride(0), observation.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        stored.stride(0), stored.stride(1),
        KV=kv, SPLITS=splits, D=d, BLOCK_F=block, BLOCK_R=tile(ranked)[0], BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(d),
        HAS_ROWS=rows is not None, FIRST=first, RENUMBER=renumber, num_warps=warps,
    )
    return drop.view(batch, kv, 1)
