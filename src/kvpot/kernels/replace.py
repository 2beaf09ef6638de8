"""Triton: a steady decoding step's one-entry eviction by replacement, in one launch per layer (issue 30).

For each batch row b (pool slot `rows[b]`) and KV head h, one program:

- FIND: the entry of the live `[0, n)` that leaves: the lowest score, the oldest (smallest stream
  position) among equal scores; the first `sinks` entries and those whose stream position is within
  `recent` of the newest entry's (the last, `n - 1`) never leave. Scores `[B, H, n]` with H = KV (per
  head) or 1 (one selection shared by the heads); none (`AGE`): the oldest leaves (StreamingLLM's ring);
- MOVE: the newest entry written over it in keys, values, positions, RoPE positions and one stored
  score array; with `RENUMBER` (rank positions) the entries ranked after it move down by one.

`kvpot.methods.replace` holds the PyTorch path these must match (`drop_index`, `renumber`, `move`;
tests/test_replace_kernel.py). Nothing synchronises with the host: a step captures it in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LAST = tl.constexpr(9223372036854775807)  # int64 max: a position no entry has (loses every tie); constexpr: a global a jit function reads
BLOCK = 1024  # entries per loop step


@triton.jit
def _move(k, v, pos, rp, sc, drop, n, newest_pos, stride_kn, stride_vn,
          D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, RENUMBER: tl.constexpr,
          HAS_SC: tl.constexpr):
    """One head's newest entry (n - 1) written over entry `drop` (pointers at the head's entries)."""
    newest = n - 1
    if RENUMBER:
        rank = tl.load(rp + drop)
        moved = tl.load(rp + newest)
        moved = moved - (moved > rank).to(tl.int64)
        tl.debug_barrier()  # every thread has read both ranks before any is rewritten
        for start in range(0, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            live = j < n
            r = tl.load(rp + j, mask=live, other=0)
            r = tl.where(j == drop, moved, r - (r > rank).to(tl.int64))
            tl.store(rp + j, r, mask=live)
    else:
        tl.store(rp + drop, tl.load(rp + newest))
    tl.store(pos + drop, newest_pos)
    if HAS_SC:
        tl.store(sc + drop, tl.load(sc + newest))
    dd = tl.arange(0, BLOCK_D)
    inside = dd < D
    tl.store(k + drop * stride_kn + dd, tl.load(k + newest * stride_kn + dd, mask=inside), mask=inside)
    tl.store(v + drop * stride_vn + dd, tl.load(v + newest * stride_vn + dd, mask=inside), mask=inside)


@triton.jit(do_not_specialize=["n", "sinks", "recent", "stride_sb", "stride_sh", "stride_ss", "stride_ks",
                               "stride_vs", "stride_rs", "stride_cs"])
def _replace_kernel(
    SCORES,  # [B, H, n] float32 ranking (H = KV, or 1: shared by the heads); unread with AGE
    POS,  # [S, KV, C] int64 stream positions, the newest entry at n - 1
    RP,  # [S, KV, C] int64 RoPE positions (ranks with RENUMBER)
    K, V,  # [S, KV, C, D] keys and values (last stride 1)
    SC,  # [S, KV, C] float32 a stored score that moves with its entry (HAS_SC)
    ROWS,  # [B] int64 each batch row's slot (HAS_ROWS; else row b is slot b)
    DROP,  # [B, KV] int64: written by FIND, read by MOVE without FIND
    n, sinks, recent,
    stride_sb, stride_sh, stride_ss,
    stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn,
    stride_ps, stride_ph, stride_rs, stride_rh, stride_cs, stride_ch,
    KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    AGE: tl.constexpr, RENUMBER: tl.constexpr, HAS_SC: tl.constexpr,
    HAS_ROWS: tl.constexpr, FIND: tl.constexpr, MOVE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    pos = POS + slot * stride_ps + h * stride_ph  # entries of one head: stride 1
    newest = n - 1
    newest_pos = tl.load(pos + newest)
    if FIND:
        score = SCORES + b.to(tl.int64) * stride_sb + h * stride_sh  # stride_sh 0: shared by the heads
        best_s = tl.full((), float("inf"), tl.float32)
        best_p = tl.full((), LAST, tl.int64)
        best_j = tl.full((), 0, tl.int32)
        for start in range(sinks, n, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            live = j < n
            p = tl.load(pos + j, mask=live, other=0)
            ok = live & (p <= newest_pos - recent)  # recent 0: every position is at most the newest's
            if AGE:
                s = tl.zeros([BLOCK_N], tl.float32)
            else:
                s = tl.load(score + j * stride_ss, mask=live, other=float("inf"))
            s = tl.where(ok, s, float("inf"))
            key = tl.where(ok, p, LAST)
            low = tl.min(s, axis=0)
            oldest = tl.min(tl.where(s == low, key, LAST), axis=0)
            at = tl.min(tl.where((s == low) & (key == oldest), j, 2147483647), axis=0)
            better = (low < best_s) | ((low == best_s) & (oldest < best_p))
            best_s = tl.where(better, low, best_s)
            best_p = tl.where(better, oldest, best_p)
            best_j = tl.where(better, at, best_j)
        drop = best_j.to(tl.int64)
        tl.store(DROP + b.to(tl.int64) * KV + h, drop)
    else:
        drop = tl.load(DROP + b.to(tl.int64) * KV + h)
    if MOVE:
        _move(K + slot * stride_ks + h * stride_kh, V + slot * stride_vs + h * stride_vh, pos,
              RP + slot * stride_rs + h * stride_rh, SC + slot * stride_cs + h * stride_ch, drop, n, newest_pos,
              stride_kn, stride_vn, D, BLOCK_N, BLOCK_D, RENUMBER, HAS_SC)

def replace_newest(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
                   n: int, scores: torch.Tensor | None = None, stored: torch.Tensor | None = None,
                   rows: torch.Tensor | None = None, sinks: int = 0, recent: int = 0, renumber: bool = False,
                   drop: torch.Tensor | None = None, find: bool = True, move: bool = True) -> torch.Tensor:
    """Find the entry each row and head drops and write the newest entry (`n - 1`) over it, in place.

    keys/values [S, KV, C, D] (last stride 1), positions/rope_positions [S, KV, C] int64 (entries of a head
    contiguous), `stored` [S, KV, C] float32 (one score array moved with the entries, or None), `rows` [B]
    int64 each batch row's slot (None: row b is slot b, B = S), `scores` [B, KV | 1, >= n] float32 (None:
    the oldest goes). `find=False` moves the entries `drop` [B, KV] names; `move=False` only finds.
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
    if find and scores is not None and (scores.dim() != 3 or scores.shape[0] != batch or scores.shape[1] not in (1, kv)
                                        or scores.shape[2] < n):
        raise ValueError(f"replace_newest: scores must be [{batch}, {kv} or 1, >= {n}], got {tuple(scores.shape)}")
    if drop is None:
        drop = torch.empty(batch, kv, dtype=torch.long, device=keys.device)
    elif not find and (drop.shape[:2] != (batch, kv) or not drop.is_contiguous()):
        drop = drop.expand(batch, kv, 1).reshape(batch, kv).contiguous()
    age = scores is None
    score_arg = positions if age else scores
    score_strides = (0, 0, 0) if age else (scores.stride(0), scores.stride(1) if scores.shape[1] > 1 else 0,
                                            scores.stride(2))
    _replace_kernel[(batch, kv)](
        score_arg, positions, rope_positions, keys, values, positions if stored is None else stored,
        positions if rows is None else rows, drop, n, sinks, recent,
        *score_strides,
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rope_positions.stride(0), rope_positions.stride(1),
        *((0, 0) if stored is None else (stored.stride(0), stored.stride(1))),
        KV=kv, D=d, BLOCK_N=min(BLOCK, triton.next_power_of_2(capacity)), BLOCK_D=triton.next_power_of_2(d),
        AGE=age, RENUMBER=renumber, HAS_SC=stored is not None,
        HAS_ROWS=rows is not None, FIND=find, MOVE=move,
    )
    return drop.view(batch, kv, 1)


@triton.jit
def _unit_gone(k, drop, stride_kn, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The evicted key in float32 and scaled to unit length (`F.normalize`)."""
    dd = tl.arange(0, BLOCK_D)
    gone = tl.load(k + drop * stride_kn + dd, mask=dd < D, other=0.0).to(tl.float32)
    return gone, gone / tl.maximum(tl.sqrt(tl.sum(gone * gone, axis=0)), 1e-12)


@triton.jit(do_not_specialize=["n", "stride_ks", "stride_ps"])
def _nearest_kernel(
    K,  # [S, KV, C, D] keys (last stride 1)
    POS,  # [S, KV, C] int64 stream positions (ties go to the oldest)
    ROWS,  # [B] int64 each batch row's slot (HAS_ROWS; else row b is slot b)
    DROP,  # [B, KV] int64 the entry each head evicts
    BEST, BEST_P, BEST_J,  # [B, KV, SPLITS] each split's most similar entry: similarity, position, index
    n, stride_ks, stride_kh, stride_kn, stride_ps, stride_ph,
    KV: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):
    """D2O eq. 9 over one split of the live entries: the entry most cosine-similar to the evicted one."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    at = b.to(tl.int64) * KV + h
    drop = tl.load(DROP + at)
    k = K + slot * stride_ks + h * stride_kh
    pos = POS + slot * stride_ps + h * stride_ph
    _, unit = _unit_gone(k, drop, stride_kn, D, BLOCK_D)
    dd = tl.arange(0, BLOCK_D)
    share = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * share
    hi = tl.minimum(lo + share, n)
    best = tl.full((), float("-inf"), tl.float32)
    best_p = tl.full((), LAST, tl.int64)
    best_j = tl.full((), 0, tl.int32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        live = j < hi
        rows = tl.load(k + j[:, None] * stride_kn + dd[None, :], mask=live[:, None] & (dd[None, :] < D),
                       other=0.0).to(tl.float32)
        norm = tl.maximum(tl.sqrt(tl.sum(rows * rows, axis=1)), 1e-12)
        s = tl.sum((rows / norm[:, None]) * unit[None, :], axis=1)
        ok = live & (j != drop)
        s = tl.where(ok, s, float("-inf"))
        key = tl.where(ok, tl.load(pos + j, mask=live, other=0), LAST)
        high = tl.max(s, axis=0)
        oldest = tl.min(tl.where(s == high, key, LAST), axis=0)
        first = tl.min(tl.where((s == high) & (key == oldest), j, 2147483647), axis=0)
        better = (high > best) | ((high == best) & (oldest < best_p))
        best = tl.where(better, high, best)
        best_p = tl.where(better, oldest, best_p)
        best_j = tl.where(better, first, best_j)
    out = at * SPLITS + split
    tl.store(BEST + out, best)
    tl.store(BEST_P + out, best_p)
    tl.store(BEST_J + out, best_j)


@triton.jit(do_not_specialize=["n", "beta", "stride_ks", "stride_vs", "stride_ps", "stride_rs", "stride_cs"])
def _merge_kernel(
    K, V,  # [S, KV, C, D] half-precision keys and values (last stride 1)
    POS, RP,  # [S, KV, C] int64 stream and RoPE positions
    SC,  # [S, KV, C] float32 a stored score that moves with its entry (HAS_SC)
    ROWS,  # [B] int64 each batch row's slot (HAS_ROWS; else row b is slot b)
    DROP,  # [B, KV] int64 the entry each head evicts
    TAU,  # [B, KV] float32 D2O's threshold: read (unless FIRST) and rewritten
    BEST, BEST_P, BEST_J,  # [B, KV, SPLITS] `_nearest_kernel`'s partial answers
    n, beta,
    stride_ks, stride_kh, stride_kn, stride_vs, stride_vh, stride_vn, stride_ps, stride_ph,
    stride_rs, stride_rh, stride_cs, stride_ch,
    KV: tl.constexpr, SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_ROWS: tl.constexpr, FIRST: tl.constexpr, RENUMBER: tl.constexpr, HAS_SC: tl.constexpr, MOVE: tl.constexpr,
):
    """D2O eqs. 9-12 for one head: the splits' answers reduced to the nearest other entry, the threshold's
    EMA, the weighted merge into that entry; then (MOVE) the newest entry written over the evicted one."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = b.to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(ROWS + b).to(tl.int64)
    at = b.to(tl.int64) * KV + h
    drop = tl.load(DROP + at)
    k = K + slot * stride_ks + h * stride_kh
    v = V + slot * stride_vs + h * stride_vh
    pos = POS + slot * stride_ps + h * stride_ph
    gone, _ = _unit_gone(k, drop, stride_kn, D, BLOCK_D)
    sp = tl.arange(0, SPLITS)
    s = tl.load(BEST + at * SPLITS + sp)
    p = tl.load(BEST_P + at * SPLITS + sp)
    best = tl.max(s, axis=0)
    oldest = tl.min(tl.where(s == best, p, LAST), axis=0)
    target = tl.min(tl.where((s == best) & (p == oldest), tl.load(BEST_J + at * SPLITS + sp), 2147483647), axis=0)
    target = target.to(tl.int64)
    # eq. 10: tau_t = beta * max U_t + (1 - beta) * tau_{t-1} (the first eviction: the mean, one value here)
    if FIRST:
        tau = best
    else:
        tau = beta * best + (1 - beta) * tl.load(TAU + at)
    tl.store(TAU + at, tau)
    # eq. 12: k_c <- (e k_c + exp(u) k_i) / (e + exp(u)) where u >= tau; else k_c unchanged
    weight = tl.where(best >= tau, tl.exp(best), 0.0)
    denominator = 2.718281828459045 + weight
    dd = tl.arange(0, BLOCK_D)
    inside = dd < D
    kept = tl.load(k + target * stride_kn + dd, mask=inside, other=0.0).to(tl.float32)
    merged = (kept * 2.718281828459045 + gone * weight) / denominator
    tl.store(k + target * stride_kn + dd, merged.to(K.dtype.element_ty), mask=inside)
    kept = tl.load(v + target * stride_vn + dd, mask=inside, other=0.0).to(tl.float32)
    gone_v = tl.load(v + drop * stride_vn + dd, mask=inside, other=0.0).to(tl.float32)
    merged = (kept * 2.718281828459045 + gone_v * weight) / denominator
    tl.store(v + target * stride_vn + dd, merged.to(V.dtype.element_ty), mask=inside)
    if MOVE:
        tl.debug_barrier()  # the merged target is written before the newest entry (maybe the target) moves
        _move(k, v, pos, RP + slot * stride_rs + h * stride_rh, SC + slot * stride_cs + h * stride_ch, drop, n,
              tl.load(pos + n - 1), stride_kn, stride_vn, D, BLOCK_N, BLOCK_D, RENUMBER, HAS_SC)


def merge_nearest(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, n: int, drop: torch.Tensor,
                  tau: torch.Tensor, beta: float, first: bool, rows: torch.Tensor | None = None,
                  rope_positions: torch.Tensor | None = None, stored: torch.Tensor | None = None,
                  renumber: bool = False) -> None:
    """D2O's merge of each head's evicted entry into its most similar other live entry (eqs. 9-12), in
    place: keys/values [S, KV, C, D] in half precision (where `(k e) / e` is k itself, so only the target
    is written), positions [S, KV, C], drop [B, KV(, 1)] the evicted entries, tau [B, KV] float32 the
    threshold (rewritten; `first`: this is its first eviction, tau becomes the similarity). With
    `rope_positions` (and `stored`, `renumber` as `replace_newest`), the newest entry then takes the evicted
    one's slot in the same launch. Two launches: the search split over the entries, then the rest."""
    slots, kv, capacity, d = keys.shape
    batch = slots if rows is None else rows.numel()
    if keys.dtype not in (torch.float16, torch.bfloat16) or values.dtype != keys.dtype:
        raise ValueError(f"merge_nearest: keys and values must be float16 or bfloat16, got {keys.dtype}")
    if tau.shape != (batch, kv) or tau.dtype != torch.float32 or not tau.is_contiguous():
        raise ValueError(f"merge_nearest: tau must be a contiguous float32 [{batch}, {kv}] tensor")
    drop = drop.reshape(batch, kv).contiguous()
    splits = max(1, min(32, triton.next_power_of_2(triton.cdiv(capacity, 512))))  # from shapes alone
    best = torch.empty(batch, kv, splits, dtype=torch.float32, device=keys.device)
    best_p = torch.empty(batch, kv, splits, dtype=torch.long, device=keys.device)
    best_j = torch.empty(batch, kv, splits, dtype=torch.int32, device=keys.device)
    row_arg = positions if rows is None else rows
    block_d = triton.next_power_of_2(d)
    _nearest_kernel[(batch, kv, splits)](
        keys, positions, row_arg, drop, best, best_p, best_j, n,
        keys.stride(0), keys.stride(1), keys.stride(2), positions.stride(0), positions.stride(1),
        KV=kv, SPLITS=splits, D=d, BLOCK_N=64, BLOCK_D=block_d, HAS_ROWS=rows is not None,
    )
    move = rope_positions is not None
    rp = positions if rope_positions is None else rope_positions
    sc = positions if stored is None else stored
    _merge_kernel[(batch, kv)](
        keys, values, positions, rp, sc, row_arg, drop, tau, best, best_p, best_j, n, float(beta),
        keys.stride(0), keys.stride(1), keys.stride(2), values.stride(0), values.stride(1), values.stride(2),
        positions.stride(0), positions.stride(1), rp.stride(0), rp.stride(1), sc.stride(0), sc.stride(1),
        KV=kv, SPLITS=splits, D=d, BLOCK_N=min(BLOCK, triton.next_power_of_2(capacity)), BLOCK_D=block_d,
        HAS_ROWS=rows is not None, FIRST=first, RENUMBER=renumber, HAS_SC=stored is not None, MOVE=move,
    )
