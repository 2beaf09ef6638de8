"""Triton kernels for InfiniteHiP (Lee et al. 2025): the stage scan and the block-sparse attention.

`kvpot.methods.infinitehip.reference` is the reference these kernels must match (tests/test_kernels.py checks them over a
named list of shapes). Both kernels read un-rotated keys `[kv_heads, n, d]` straight from the
cache and apply RoPE while loading, from the model's cos/sin table `[positions, d]`, so no rotated
copy of the context is ever written. GQA is read per KV head: the `g` query heads of a group are
the rows of one program, so each key is loaded once per group.

- `stage_scan`: for every (query block, selection head, candidate chunk), Algorithm 3's halving
  search for the chunk's representative key and that key's score (max over the block's queries
  and each group's heads; with a shared selection, also over KV heads). Candidate ranges end
  before the block's window starts, so they are causal for every query of the block and need no
  diagonal mask.
- `sparse_attention`: exact softmax attention of each block's queries over sinks + the last
  stage's selected ranges + the window, with streaming positions (Sec. 4 "Dynamic RoPE") or true
  ones. The keys a block reads are a virtual list — sinks, then the selected ranges, then the
  window — that each program indexes arithmetically, so nothing is gathered beforehand. Long
  lists (decoding) are split across programs FlashDecoding-style and merged by
  `kvpot.kernels.common.merge`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpot.kernels.common import merge, multiprocessors, next_power_of_2

STYLES = {"absolute": 0, "relative": 1, "chunk": 2}
# `do_not_specialize` below names the integer arguments that change as decoding goes on (context
# length, range counts, offsets). Triton would otherwise specialise each kernel on such a value being
# 1 or a multiple of 16 and compile a new variant mid-generation: a 1.8 s stall at the first context
# length divisible by 16 in a llama3-8b run. They only bound masks and loops; the hint buys nothing.


# ---------------------------------------------------------------------------- stage scan


@triton.jit
def _probe(q1, q2, K, COS, SIN, idx, side, offs_c, c_ok, row_ok, h, N, stride_kh, stride_kn, stride_t,
           STYLE: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr):
    """Scores [BLOCK_C] of keys `idx` of head `h` against query halves q1/q2 [BLOCK_M, HALF]: max over valid rows."""
    dh = tl.arange(0, HALF)
    key = tl.minimum(tl.maximum(idx, 0), N - 1)  # empty ranges point anywhere: keep loads in bounds
    if STYLE == 0:  # absolute: the key at its own position
        pos = key
    elif STYLE == 1:  # relative: left half's key at 0, right half's at 1
        pos = tl.zeros_like(key) + side
    else:  # chunk-indexed: the key at its candidate's index
        pos = offs_c.to(tl.int64)
    t_ptr = pos[:, None] * stride_t + dh[None, :]
    cos1 = tl.load(COS + t_ptr, mask=c_ok[:, None], other=0.0).to(tl.float32)
    cos2 = tl.load(COS + t_ptr + HALF, mask=c_ok[:, None], other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + t_ptr, mask=c_ok[:, None], other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + t_ptr + HALF, mask=c_ok[:, None], other=0.0).to(tl.float32)
    k_ptr = K + h * stride_kh + key[:, None] * stride_kn + dh[None, :]
    k1 = tl.load(k_ptr, mask=c_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_C, HALF]
    k2 = tl.load(k_ptr + HALF, mask=c_ok[:, None], other=0.0).to(tl.float32)
    r1 = (k1 * cos1 - k2 * sin1).to(q1.dtype)  # rotate_half: (-x2, x1)
    r2 = (k2 * cos2 + k1 * sin2).to(q1.dtype)
    return _best_row(q1, q2, r1, r2, row_ok, IEEE)


@triton.jit
def _best_row(q1, q2, k1, k2, row_ok, IEEE: tl.constexpr):
    """max over valid rows of q . k, the head split in halves: q1/q2 [BLOCK_M, HALF], k1/k2 [BLOCK_C, HALF]."""
    if IEEE:
        sc = tl.dot(q1, tl.trans(k1), input_precision="ieee") + tl.dot(q2, tl.trans(k2), input_precision="ieee")
    else:
        sc = tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))  # [BLOCK_M, BLOCK_C]
    sc = tl.where(row_ok[:, None], sc, float("-inf"))
    return tl.max(sc, axis=0)


@triton.jit
def _probe_turned(qa, qb, K, idx, c_ok, row_ok, h, N, stride_kh, stride_kn, HALF: tl.constexpr,
                  IEEE: tl.constexpr):
    """Scores [BLOCK_C] of un-rotated keys `idx` against queries already turned by the keys' rotation
    (`_turn`): the same numbers as `_probe` at one shared position, with no per-key RoPE work."""
    dh = tl.arange(0, HALF)
    key = tl.minimum(tl.maximum(idx, 0), N - 1)
    k_ptr = K + h * stride_kh + key[:, None] * stride_kn + dh[None, :]
    k1 = tl.load(k_ptr, mask=c_ok[:, None], other=0.0).to(qa.dtype)  # [BLOCK_C, HALF]
    k2 = tl.load(k_ptr + HALF, mask=c_ok[:, None], other=0.0).to(qa.dtype)
    return _best_row(qa, qb, k1, k2, row_ok, IEEE)


@triton.jit
def _probe_pair(q1, q2, ql1, ql2, qr1, qr2, K, COS, SIN, left, right, offs_c, c_ok, row_ok, h, N, stride_kh,
                stride_kn, stride_t, TURN: tl.constexpr, STYLE: tl.constexpr, HALF: tl.constexpr,
                IEEE: tl.constexpr):
    """One halving step's two probes of ranges [left, right): the middle keys of the left and right halves
    (the left one at position 0, the right one at 1 in the relative style, where `TURN` uses the turned
    queries ql/qr)."""
    center = (left + right) // 2
    if TURN:
        probe_l = _probe_turned(ql1, ql2, K, (left + center) // 2, c_ok, row_ok, h, N, stride_kh, stride_kn,
                                HALF, IEEE)
        probe_r = _probe_turned(qr1, qr2, K, (center + right) // 2, c_ok, row_ok, h, N, stride_kh, stride_kn,
                                HALF, IEEE)
    else:
        probe_l = _probe(q1, q2, K, COS, SIN, (left + center) // 2, 0, offs_c, c_ok, row_ok, h, N, stride_kh,
                         stride_kn, stride_t, STYLE, HALF, IEEE)
        probe_r = _probe(q1, q2, K, COS, SIN, (center + right) // 2, 1, offs_c, c_ok, row_ok, h, N, stride_kh,
                         stride_kn, stride_t, STYLE, HALF, IEEE)
    return probe_l, probe_r


@triton.jit
def _turn(q1, q2, COS, SIN, pos, stride_t, HALF: tl.constexpr):
    """Queries q' with q'.k = q.rot(k, pos) for every key k: rot(k) = (k1 c1 - k2 s1, k2 c2 + k1 s2), so
    q'1 = q1 c1 + q2 s2 and q'2 = q2 c2 - q1 s1 (the cos/sin row of `pos`, scaled variants included)."""
    dh = tl.arange(0, HALF)
    c1 = tl.load(COS + pos * stride_t + dh).to(tl.float32)[None, :]
    c2 = tl.load(COS + pos * stride_t + HALF + dh).to(tl.float32)[None, :]
    s1 = tl.load(SIN + pos * stride_t + dh).to(tl.float32)[None, :]
    s2 = tl.load(SIN + pos * stride_t + HALF + dh).to(tl.float32)[None, :]
    a, b = q1.to(tl.float32), q2.to(tl.float32)
    return (a * c1 + b * s2).to(q1.dtype), (b * c2 - a * s1).to(q1.dtype)


@triton.jit
def _key_scores(Q, K, COS, SIN, idx, side, offs_c, c_ok, rows, row_ok, b, s, N,
                stride_qh, stride_qb, stride_qm, stride_kh, stride_kn, stride_t, KV: tl.constexpr,
                SHARED: tl.constexpr, STYLE: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Scores [BLOCK_C] of keys `idx`: max over valid rows (and over KV heads when SHARED)."""
    dh = tl.arange(0, HALF)
    best = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for i in range(KV if SHARED else 1):  # a loop over KV heads (KV is a compile-time constant)
        h = i if SHARED else s
        q_ptr = Q + h * stride_qh + b * stride_qb + rows[:, None] * stride_qm + dh[None, :]
        q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HALF]
        q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0)
        best = tl.maximum(best, _probe(q1, q2, K, COS, SIN, idx, side, offs_c, c_ok, row_ok, h, N,
                                       stride_kh, stride_kn, stride_t, STYLE, HALF, IEEE))
    return best


@triton.jit(do_not_specialize=["N", "C"])
def _scan_kernel(
    Q,  # [KV, B, M, D] rotated queries of each block (M = group heads x block rows)
    K,  # [KV, N, D] un-rotated keys
    COS, SIN,  # [P, D] RoPE table
    STARTS, ENDS,  # [S, B, C] int64 candidate ranges [start, end); empty = padding
    ROWS_VALID,  # [B, R] int8: 1 where the block's row is a real query
    REP,  # [S, B, C] int64 out: representative key of each range
    SCORE,  # [S, B, C] float32 out: its score (-inf for empty ranges)
    N, B, C, M, R,
    stride_qh, stride_qb, stride_qm, stride_kh, stride_kn, stride_t,
    KV: tl.constexpr,  # KV heads
    STEPS: tl.constexpr,  # ceil(log2(chunk)) halvings
    SHARED: tl.constexpr, STYLE: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    s = pid // B
    b = pid % B
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    base = (s * B + b) * C
    left = tl.load(STARTS + base + offs_c, mask=c_ok, other=0)
    right = tl.load(ENDS + base + offs_c, mask=c_ok, other=0)
    valid = left < right
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    row_ok = row_ok & (tl.load(ROWS_VALID + b * R + rows % R, mask=row_ok, other=0) != 0)
    for _ in range(STEPS):
        active = right - left > 1
        center = (left + right) // 2
        score_l = _key_scores(Q, K, COS, SIN, (left + center) // 2, 0, offs_c, c_ok, rows, row_ok, b, s, N,
                              stride_qh, stride_qb, stride_qm, stride_kh, stride_kn, stride_t, KV,
                              SHARED, STYLE, HALF, IEEE, BLOCK_M, BLOCK_C)
        score_r = _key_scores(Q, K, COS, SIN, (center + right) // 2, 1, offs_c, c_ok, rows, row_ok, b, s, N,
                              stride_qh, stride_qb, stride_qm, stride_kh, stride_kn, stride_t, KV,
                              SHARED, STYLE, HALF, IEEE, BLOCK_M, BLOCK_C)
        go_left = score_l >= score_r
        right = tl.where(active & go_left, center, right)
        left = tl.where(active & (score_l < score_r), center, left)
    final = _key_scores(Q, K, COS, SIN, left, 0, offs_c, c_ok, rows, row_ok, b, s, N,
                        stride_qh, stride_qb, stride_qm, stride_kh, stride_kn, stride_t, KV,
                        SHARED, STYLE, HALF, IEEE, BLOCK_M, BLOCK_C)
    tl.store(REP + base + offs_c, left, mask=c_ok)
    tl.store(SCORE + base + offs_c, tl.where(valid, final, float("-inf")), mask=c_ok)


@triton.jit(do_not_specialize=["N", "C", "C_PER"])
def _scan_step_kernel(
    Q,  # [KV, B, M, D] rotated queries of each block (M = group heads x block rows)
    K,  # [KV, N, D] un-rotated keys
    COS, SIN,  # [P, D] RoPE table
    STARTS, ENDS,  # [S, B, C] int64 candidate ranges [start, end) (read by the first step)
    LR_IN, LR_OUT,  # [2, S, B, C] int64: each search's (left, right) before / after this step's decision
    SC_IN, SC_OUT,  # [HP, S, B, C, 2] float32: each head's scores of the last / this step's two probes
    ROWS_VALID,  # [B, R] int8: 1 where the block's row is a real query
    N, B, C, M, R, S, C_PER,  # C_PER: candidates per program along grid axis 1 (a multiple of BLOCK_C)
    stride_qh, stride_qb, stride_qm, stride_kh, stride_kn, stride_t,
    HP: tl.constexpr,  # heads whose scores one selection takes the max of (KV heads when shared, else 1)
    FIRST: tl.constexpr, LAST: tl.constexpr,  # the first step reads STARTS/ENDS; the last probes `left` only
    TURN: tl.constexpr,  # relative style: turn the queries once by each side's rotation, keys stay raw
    STYLE: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One halving step of every search, for one (selection, block, head) and a span of candidates.

    The head's queries are loaded once and stay resident while the program walks its candidates;
    the decision between halves needs every head's score of the previous step, so steps are
    separate launches (see `stage_scan`).
    """
    pid = tl.program_id(0)
    hp = pid % HP
    b = (pid // HP) % B
    s = pid // (HP * B)
    h = s * HP + hp  # shared: S == 1, the program's head; per head: HP == 1, the selection's head
    dh = tl.arange(0, HALF)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    row_ok = row_ok & (tl.load(ROWS_VALID + b * R + rows % R, mask=row_ok, other=0) != 0)
    q_ptr = Q + h * stride_qh + b * stride_qb + rows[:, None] * stride_qm + dh[None, :]
    q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HALF], resident for the whole span
    q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0)
    ql1, ql2, qr1, qr2 = q1, q2, q1, q2
    if TURN:  # left probes sit at position 0, right ones at 1: rotate two query copies, not every key
        ql1, ql2 = _turn(q1, q2, COS, SIN, 0, stride_t, HALF)
        qr1, qr2 = _turn(q1, q2, COS, SIN, 1, stride_t, HALF)
    base = (s * B + b) * C
    lo = tl.program_id(1) * C_PER
    for c0 in range(lo, tl.minimum(lo + C_PER, C), BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        if FIRST:
            left = tl.load(STARTS + base + offs_c, mask=c_ok, other=0)
            right = tl.load(ENDS + base + offs_c, mask=c_ok, other=0)
        else:  # the previous step's decision, from every head's scores (the same in every head's program)
            left = tl.load(LR_IN + base + offs_c, mask=c_ok, other=0)
            right = tl.load(LR_IN + S * B * C + base + offs_c, mask=c_ok, other=0)
            score_l = tl.full([BLOCK_C], float("-inf"), tl.float32)
            score_r = tl.full([BLOCK_C], float("-inf"), tl.float32)
            for i in range(HP):
                at = SC_IN + 2 * (i * S * B * C + base + offs_c)
                score_l = tl.maximum(score_l, tl.load(at, mask=c_ok, other=float("-inf")))
                score_r = tl.maximum(score_r, tl.load(at + 1, mask=c_ok, other=float("-inf")))
            active = right - left > 1
            center = (left + right) // 2
            go_left = score_l >= score_r
            right = tl.where(active & go_left, center, right)
            left = tl.where(active & (score_l < score_r), center, left)
        if hp == 0:
            tl.store(LR_OUT + base + offs_c, left, mask=c_ok)
            tl.store(LR_OUT + S * B * C + base + offs_c, right, mask=c_ok)
        out = SC_OUT + 2 * (hp * S * B * C + base + offs_c)
        if LAST:  # the representative is `left`; its score is the range's
            if TURN:
                final = _probe_turned(ql1, ql2, K, left, c_ok, row_ok, h, N, stride_kh, stride_kn, HALF, IEEE)
            else:
                final = _probe(q1, q2, K, COS, SIN, left, 0, offs_c, c_ok, row_ok, h, N, stride_kh, stride_kn,
                               stride_t, STYLE, HALF, IEEE)
            tl.store(out, final, mask=c_ok)
        else:
            probe_l, probe_r = _probe_pair(q1, q2, ql1, ql2, qr1, qr2, K, COS, SIN, left, right, offs_c, c_ok,
                                           row_ok, h, N, stride_kh, stride_kn, stride_t, TURN, STYLE, HALF, IEEE)
            tl.store(out, probe_l, mask=c_ok)
            tl.store(out + 1, probe_r, mask=c_ok)


def stage_scan(queries: torch.Tensor, rows_valid: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor,
               ends: torch.Tensor, chunk: int, style: str, shared: bool, cos: torch.Tensor,
               sin: torch.Tensor, stepwise: bool | None = None, block_c: int | None = None,
               turn: bool | None = None, warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Representatives and scores of candidate ranges; the kernel form of `sparse.halving_search`.

    queries [kv, g, B, R, d] already rotated for the stage; rows_valid [B, R]; keys [kv, n, d]
    un-rotated; starts/ends [s, B, C] long; cos/sin [P, d]. Returns rep [s, B, C] long and score
    [s, B, C] float32.

    Two schedules compute the same thing. Few query rows per block (decoding) run the whole search
    in one launch, each program looping over the KV heads at every step. Wide blocks (prefill: a
    group's heads x 64 rows) would then reload their queries for every head at every step (~18 GB
    of L2 traffic per 2,048-query chunk at 1M keys), so they run `stepwise`: one launch per halving
    step, each program holding one head's queries while it walks its candidates, the steps meeting
    through per-head score buffers. In the relative style every left probe sits at position 0 and
    every right one at 1, so the stepwise schedule rotates two copies of the queries once instead of
    every key it reads (`turn`). `stepwise` (default: rows >= 64), `block_c` (candidates per tile),
    `turn` (default: relative style) and `warps` (stepwise) override the choices, for tests and tuning.
    """
    kv, g, b, r, d = queries.shape
    s, _, c = starts.shape
    m = g * r
    q = queries.permute(0, 2, 1, 3, 4).reshape(kv, b, m, d)  # [KV, B, M, D]
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    starts, ends = starts.contiguous(), ends.contiguous()
    valid_rows = rows_valid.to(torch.int8).contiguous()
    block_m = max(16, next_power_of_2(m))
    steps = max(0, math.ceil(math.log2(chunk)))
    ieee = q.dtype == torch.float32
    strides = (q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), cos.stride(0))
    if stepwise is None:
        stepwise = m >= 64
    if stepwise:
        # four resident float32 query copies of 256 rows would ask for 272 KB of shared memory on an H100
        fits = not (ieee and block_m >= 256)
        turn = style == "relative" and fits if turn is None else turn and style == "relative"
        return _stepwise_scan(q, keys, cos, sin, starts, ends, valid_rows, r, steps, style, shared, block_m,
                              block_c, turn, warps, strides)
    rep = torch.empty_like(starts)
    score = torch.empty(starts.shape, dtype=torch.float32, device=starts.device)
    if block_c is None:
        block_c = 64
        if s * b * triton.cdiv(c, block_c) < 264:  # few blocks (decoding): narrower tiles, more programs
            block_c = 16
    grid = (s * b, triton.cdiv(c, block_c))
    _scan_kernel[grid](
        q, keys, cos, sin, starts, ends, valid_rows, rep, score, keys.shape[1], b, c, m, r, *strides,
        KV=kv, STEPS=steps, SHARED=shared, STYLE=STYLES[style], HALF=d // 2, IEEE=ieee, BLOCK_M=block_m,
        BLOCK_C=block_c, num_warps=8 if block_m >= 128 else 4,
        # pipelining the head loop overlaps the heads' key loads; with wide blocks (prefill) or float32
        # its buffers outgrow shared memory (434 KB asked for on an H100), and many programs hide latency
        num_stages=1 if block_m >= 128 or ieee else 3,
    )
    return rep, score


def _stepwise_scan(q, keys, cos, sin, starts, ends, valid_rows, r, steps, style, shared, block_m, block_c, turn,
                   warps, strides):
    """`stage_scan` as steps + 1 launches of `_scan_step_kernel` (q [KV, B, M, D])."""
    kv, b, m, d = q.shape
    s, _, c = starts.shape
    hp = kv if shared else 1
    if block_c is None:
        block_c = 64  # measured on an H100 at 1M keys, records/infinitehip-kernels-h100
    programs = s * b * hp
    tiles = triton.cdiv(c, block_c)
    # split the candidates until the GPU has a few programs per multiprocessor
    splits = max(1, min(tiles, triton.cdiv(4 * multiprocessors(q.device), programs)))
    per = triton.cdiv(tiles, splits) * block_c
    splits = triton.cdiv(c, per)
    lr = torch.empty(2, 2, s, b, c, dtype=torch.long, device=q.device)  # ping-pong (left, right)
    sc = torch.empty(2, hp, s, b, c, 2, dtype=torch.float32, device=q.device)  # ping-pong probe scores
    ieee = q.dtype == torch.float32
    for t in range(steps + 1):
        _scan_step_kernel[(programs, splits)](
            q, keys, cos, sin, starts, ends, lr[(t + 1) % 2], lr[t % 2], sc[(t + 1) % 2], sc[t % 2], valid_rows,
            keys.shape[1], b, c, m, r, s, per, *strides,
            HP=hp, FIRST=t == 0, LAST=t == steps, TURN=turn, STYLE=STYLES[style], HALF=d // 2, IEEE=ieee, BLOCK_M=block_m,
            BLOCK_C=block_c, num_warps=warps or (8 if block_m >= 128 else 4), num_stages=1 if ieee else 2,
        )
    rep = lr[steps % 2, 0]
    score = sc[steps % 2, :, :, :, :, 0].amax(0)  # [s, B, C]: max over the selection's heads
    return rep, score.masked_fill(starts >= ends, float("-inf"))


@triton.jit(do_not_specialize=["N", "C", "C_PER"])
def _hip_scan_kernel(
    Q,  # [H, B, R, D] rotated queries, one row set per query head
    K,  # [KV, N, D] un-rotated keys
    COS, SIN,  # [P, D] RoPE table
    STARTS, ENDS,  # [S, B, C] int64 candidate ranges [start, end); empty = padding
    REACH,  # [S, B, C] int64: where each range's search may go (past ENDS into the window: hip-attn's region)
    ROWS_VALID,  # [B, R] int8: 1 where the block's row is a real query
    REP,  # [H, B, C] int64 out: where each head's path ended
    BEST,  # [H, B, C] float32 out: the best probe each head's path met
    N, B, C, R, C_PER, G, PER,  # G: query heads per KV head; PER: query heads per selection
    stride_qh, stride_qb, stride_qm, stride_kh, stride_kn, stride_t,
    STEPS: tl.constexpr, TURN: tl.constexpr, STYLE: tl.constexpr, HALF: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Every halving step of one query head's searches over a span of candidates, in one launch.

    hip-attn's search needs no other head's scores to decide a split (each head walks its own path and
    the heads meet once it is over), so the whole search runs here while the head's queries stay resident,
    where the paper's shared search needs one launch per step (`_scan_step_kernel`)."""
    pid = tl.program_id(0)
    b = pid % B
    hq = pid // B
    h = hq // G  # the head's KV head
    s = hq // PER  # the selection it searches for
    dh = tl.arange(0, HALF)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < R
    row_ok = row_ok & (tl.load(ROWS_VALID + b * R + rows, mask=row_ok, other=0) != 0)
    q_ptr = Q + hq * stride_qh + b * stride_qb + rows[:, None] * stride_qm + dh[None, :]
    q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, HALF]
    q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0)
    ql1, ql2, qr1, qr2 = q1, q2, q1, q2
    if TURN:  # relative style: left probes at position 0, right ones at 1
        ql1, ql2 = _turn(q1, q2, COS, SIN, 0, stride_t, HALF)
        qr1, qr2 = _turn(q1, q2, COS, SIN, 1, stride_t, HALF)
    base = (s * B + b) * C
    out = (hq * B + b) * C
    lo = tl.program_id(1) * C_PER
    for c0 in range(lo, tl.minimum(lo + C_PER, C), BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < C
        left = tl.load(STARTS + base + offs_c, mask=c_ok, other=0)
        stop = tl.load(ENDS + base + offs_c, mask=c_ok, other=0)  # in play while the left end is before it
        right = tl.load(REACH + base + offs_c, mask=c_ok, other=0)
        best = tl.full([BLOCK_C], -32000.0, tl.float32)  # hip-attn's initial score
        for _ in range(STEPS):
            active = (left < right) & (left < stop)
            center = (left + right) // 2
            probe_l, probe_r = _probe_pair(q1, q2, ql1, ql2, qr1, qr2, K, COS, SIN, left, right, offs_c, c_ok,
                                           row_ok, h, N, stride_kh, stride_kn, stride_t, TURN, STYLE, HALF, IEEE)
            go_left = probe_l > probe_r  # hip-attn goes right on a tie
            best = tl.where(active, tl.maximum(best, tl.where(go_left, probe_l, probe_r)), best)
            right = tl.where(active & go_left, center, right)
            left = tl.where(active & (probe_l <= probe_r), center, left)
        tl.store(REP + out + offs_c, left, mask=c_ok)
        tl.store(BEST + out + offs_c, best, mask=c_ok)


def hip_stage_scan(queries: torch.Tensor, rows_valid: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor,
                   ends: torch.Tensor, chunk: int, style: str, cos: torch.Tensor, sin: torch.Tensor,
                   block_c: int | None = None, turn: bool | None = None,
                   reach: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hip-attn 1.2.9's search of a stage (`InfiniteHiP(scan="hip")`); the kernel form of
    `kvpot.methods.infinitehip.hipscan.HipSearch.search`.

    queries [kv, g, B, R, d] already rotated for the stage; rows_valid [B, R]; keys [kv, n, d] un-rotated;
    starts/ends [s, B, C] long (s = 1 or kv), `reach` (default: ends) where each range's search may go while its
    left end is before its end. Each query head searches every range on its own path, scoring a range by the
    best probe it met; a selection's score is the max over its heads. Returns rep [s, B, C] (the
    path of each selection's first head) and score [s, B, C] float32 (-inf for empty ranges). `block_c`
    (candidates per tile) and `turn` (default: relative style) override the choices, for tests and tuning.
    """
    kv, g, b, r, d = queries.shape
    s, _, c = starts.shape
    heads = kv * g
    q = queries.reshape(heads, b, r, d)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    starts, ends = starts.contiguous(), ends.contiguous()
    reach = ends if reach is None else reach.contiguous()
    valid_rows = rows_valid.to(torch.int8).contiguous()
    block_m = max(16, next_power_of_2(r))
    steps = max(0, math.ceil(math.log2(chunk)))
    ieee = q.dtype == torch.float32
    turn = style == "relative" if turn is None else turn and style == "relative"
    block_c = block_c or (64 if r >= 16 else 16)
    programs = heads * b
    tiles = triton.cdiv(c, block_c)
    # split the candidates until the GPU has a few programs per multiprocessor (decoding: B = 1)
    splits = max(1, min(tiles, triton.cdiv(4 * multiprocessors(q.device), programs)))
    per = triton.cdiv(tiles, splits) * block_c
    splits = triton.cdiv(c, per)
    rep = torch.empty(heads, b, c, dtype=torch.long, device=q.device)
    best = torch.empty(heads, b, c, dtype=torch.float32, device=q.device)
    _hip_scan_kernel[(programs, splits)](
        q, keys, cos, sin, starts, ends, reach, valid_rows, rep, best, keys.shape[1], b, c, r, per, g, heads // s,
        q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), cos.stride(0),
        STEPS=steps, TURN=turn, STYLE=STYLES[style], HALF=d // 2, IEEE=ieee, BLOCK_M=block_m, BLOCK_C=block_c,
        num_warps=4, num_stages=1 if ieee else 2,
    )
    score = best.view(s, heads // s, b, c).amax(1)
    return rep.view(s, heads // s, b, c)[:, 0], score.masked_fill(starts >= ends, float("-inf"))


# ---------------------------------------------------------------------------- attention


@triton.jit(do_not_specialize=["N", "C", "offset", "SEG2", "TOTAL", "PER_SPLIT"])
def _attention_kernel(
    Q,  # [B, KV, M, D] un-rotated queries (M = group heads x block rows; row m is query m % R)
    K, V,  # [KV, N, D] keys (un-rotated) and values
    COS, SIN,  # [P, D] RoPE table
    STARTS, ENDS, SELBASE,  # [S, B, C] int64 selected ranges and each one's first streaming position
    W0, NSINK,  # [B] int64 window start and number of sinks in use
    BASE,  # [S, B] int64 streaming position of the window's first key
    OUT,  # [SPLITS, B, KV, M, D] (float32 when SPLITS > 1, else the query dtype)
    LSE,  # [SPLITS, B, KV, M] float32 log2-sum-exp of each split's scores
    SLOT,  # [>= N] int32: each key's slot in the GPU cache, -1 where it is only in (host) K/V (CACHED)
    KG, VG,  # [KV, SLOTS, D] the GPU cache of keys and values (CACHED), strides as K/V's per-head rows
    POS,  # [1] int64: the position of query 0, read on the device instead of `offset` (POS_ON_DEVICE)
    N, B, KV, M, R, C, offset, scale,  # offset: position of query 0; scale: softmax scale
    SINK, SEG2, TOTAL, PER_SPLIT,  # virtual key list: [0, SINK) sinks, [SINK, SEG2) selected, [SEG2, TOTAL) window
    stride_qb, stride_qh, stride_qm, stride_kh, stride_kn, stride_vh, stride_vn, stride_t,
    stride_os, stride_ob, stride_oh, stride_om, stride_gh, stride_gn,
    CH: tl.constexpr,  # tokens per selected range
    CACHED: tl.constexpr,  # K/V live in host memory, read through the GPU cache where SLOT says so
    POS_ON_DEVICE: tl.constexpr,  # a fixed-shape decoding step: the query's position is a device value
    SHARED: tl.constexpr, STREAMING: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tiles = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mt = pid % tiles
    h = (pid // tiles) % KV
    b = pid // (tiles * KV)
    s = 0 if SHARED else h
    if POS_ON_DEVICE:
        offset = tl.load(POS)
    dh = tl.arange(0, HALF)
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offset + b * R + rows % R  # true position of each row's query
    row_ok = (rows < M) & (t < N)
    w0 = tl.load(W0 + b)
    nsink = tl.load(NSINK + b)
    base = tl.load(BASE + s * B + b)
    last = tl.minimum(offset + b * R + R - 1, N - 1)  # the block's last query
    sel = (s * B + b) * C

    # queries rotated at their (streaming or true) positions, scaled for exp2
    qpos = base + (t - w0) if STREAMING else t
    qpos = tl.where(row_ok, qpos, 0)
    q_ptr = Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + dh[None, :]
    q1 = tl.load(q_ptr, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qt = qpos[:, None] * stride_t + dh[None, :]
    c1 = tl.load(COS + qt).to(tl.float32)
    c2 = tl.load(COS + qt + HALF).to(tl.float32)
    s1 = tl.load(SIN + qt).to(tl.float32)
    s2 = tl.load(SIN + qt + HALF).to(tl.float32)
    qk = scale * 1.4426950408889634
    q1, q2 = ((q1 * c1 - q2 * s1) * qk).to(Q.dtype.element_ty), ((q2 * c2 + q1 * s2) * qk).to(Q.dtype.element_ty)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a split with every key masked stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_M, HALF], tl.float32)
    lo = split * PER_SPLIT
    hi = tl.minimum(lo + PER_SPLIT, TOTAL)
    for it in range(0, PER_SPLIT // BLOCK_N):  # PER_SPLIT is a multiple of BLOCK_N; `hi` masks the tail
        u = lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = u < hi
        in_sink = in_range & (u < SINK)
        in_sel = in_range & (u >= SINK) & (u < SEG2)
        in_win = in_range & (u >= SEG2)
        v = tl.where(in_sel, u - SINK, 0)
        j = v // CH
        o = v % CH
        st = tl.load(STARTS + sel + j, mask=in_sel, other=0)
        en = tl.load(ENDS + sel + j, mask=in_sel, other=0)
        sb = tl.load(SELBASE + sel + j, mask=in_sel, other=0)
        key_w = w0 + (u - SEG2)
        key = tl.where(in_sink, u, tl.where(in_sel, st + o, key_w))
        ok = (in_sink & (u < nsink)) | (in_sel & (st + o < en)) | (in_win & (key_w <= last))
        ok = ok & (key < N)
        if STREAMING:
            pos = tl.where(in_sink, u, tl.where(in_sel, sb + o, base + (key_w - w0)))
        else:
            pos = key
        # lanes that are not `ok` keep garbage indices: every load through them is masked
        kt = pos[:, None] * stride_t + dh[None, :]
        if CACHED:
            slot = tl.load(SLOT + key, mask=ok, other=-1)
            on_gpu = ok & (slot >= 0)
            remote = ok & (slot < 0)
        else:
            remote = ok
        k_ptr = K + h * stride_kh + key[:, None] * stride_kn + dh[None, :]
        k1 = tl.load(k_ptr, mask=remote[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, HALF]
        k2 = tl.load(k_ptr + HALF, mask=remote[:, None], other=0.0).to(tl.float32)
        if CACHED:  # each lane reads either its cached row or its host row, the other load is masked
            g_ptr = KG + h * stride_gh + slot[:, None] * stride_gn + dh[None, :]
            k1 += tl.load(g_ptr, mask=on_gpu[:, None], other=0.0).to(tl.float32)
            k2 += tl.load(g_ptr + HALF, mask=on_gpu[:, None], other=0.0).to(tl.float32)
        kc1 = tl.load(COS + kt, mask=ok[:, None], other=0.0).to(tl.float32)
        kc2 = tl.load(COS + kt + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        ks1 = tl.load(SIN + kt, mask=ok[:, None], other=0.0).to(tl.float32)
        ks2 = tl.load(SIN + kt + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
        r1 = (k1 * kc1 - k2 * ks1).to(Q.dtype.element_ty)
        r2 = (k2 * kc2 + k1 * ks2).to(Q.dtype.element_ty)
        if IEEE:
            sc = tl.dot(q1, tl.trans(r1), input_precision="ieee") + tl.dot(q2, tl.trans(r2), input_precision="ieee")
        else:
            sc = tl.dot(q1, tl.trans(r1)) + tl.dot(q2, tl.trans(r2))  # [BLOCK_M, BLOCK_N], log2 units
        allowed = ok[None, :] & (key[None, :] <= t[:, None])
        sc = tl.where(allowed, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ptr = V + h * stride_vh + key[:, None] * stride_vn + dh[None, :]
        v1 = tl.load(v_ptr, mask=remote[:, None], other=0.0)
        v2 = tl.load(v_ptr + HALF, mask=remote[:, None], other=0.0)
        if CACHED:
            g_ptr = VG + h * stride_gh + slot[:, None] * stride_gn + dh[None, :]
            v1 += tl.load(g_ptr, mask=on_gpu[:, None], other=0.0)
            v2 += tl.load(g_ptr + HALF, mask=on_gpu[:, None], other=0.0)
        pv = p.to(V.dtype.element_ty)
        if IEEE:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1, input_precision="ieee")
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2, input_precision="ieee")
        else:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1)
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2)
        m_i = m_new

    safe = tl.where(l_i > 0, l_i, 1.0)
    o_ptr = OUT + split * stride_os + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + dh[None, :]
    tl.store(o_ptr, (acc1 / safe[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(o_ptr + HALF, (acc2 / safe[:, None]).to(OUT.dtype.element_ty), mask=row_ok[:, None])
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(safe), float("-inf"))
        lse_ptr = LSE + split * (B * KV * M) + (b * KV + h) * M + rows
        tl.store(lse_ptr, lse, mask=row_ok)


def sparse_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     starts: torch.Tensor, ends: torch.Tensor, chunk: int, window_start: torch.Tensor,
                     window_width: int, sink: int, rows: int, streaming: bool, cos: torch.Tensor,
                     sin: torch.Tensor, splits: int | None = None, offset: int | None = None,
                     memo: dict | None = None, gpu_cache=None, block_m: int | None = None,
                     position: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the last `q` queries over sinks + selected ranges + window; kernel form of
    `sparse._final_attention`.

    query [h, q, d] un-rotated, at positions offset .. offset + q - 1 (default: the last q of the
    n keys), in blocks of `rows` (the last may be partial); keys/values [kv, n, d]; starts/ends
    [s, B, C] the last stage's ranges (at most `chunk` keys each); window_start [B] long;
    window_width a host bound on any block's window (last query - window start + 1); cos/sin
    [P, d]. `splits` divides each block's key list across programs (default: enough to fill the
    GPU). `memo` (a dict kept with the selection) caches the per-range position offsets, which
    only change when the selection does (decoding reuses them between refreshes). With `gpu_cache`
    (a `kvpot.methods.infinitehip.offload.GpuKvCache`), keys/values are in pinned host memory and each key is read from
    the GPU cache when it holds it, else over the bus. `block_m` (query rows per program) overrides
    the tile, for tests and tuning. `position` ([1] long on the device) replaces `offset` for a
    fixed-shape decoding step (one query, keys/values the whole buffers: `n` is their capacity and
    the kernel masks every key after the query). Returns [h, q, d].
    """
    h, q, d = query.shape
    kv, n = keys.shape[0], keys.shape[1]
    g = h // kv
    b = math.ceil(q / rows)
    s, c = starts.shape[0], starts.shape[2]
    m = g * rows
    pad = b * rows - q
    qb = torch.nn.functional.pad(query, (0, 0, 0, pad)) if pad else query
    qb = qb.view(kv, g, b, rows, d).permute(2, 0, 1, 3, 4).reshape(b, kv, m, d)  # [B, KV, M, D]
    if memo is not None and "selbase" in memo:
        nsink, selbase, base = memo["nsink"], memo["selbase"], memo["base"]
    else:
        lengths = (ends - starts).clamp(min=0)  # [s, B, C]
        nsink = window_start.clamp(max=sink)  # [B]
        selbase = (nsink.view(1, -1, 1) + lengths.cumsum(-1) - lengths).contiguous()
        base = (nsink.view(1, -1) + lengths.sum(-1)).contiguous()  # [s, B]
        if memo is not None:
            memo.update(nsink=nsink, selbase=selbase, base=base)
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        keys, values = keys.contiguous(), values.contiguous()
    seg2 = sink + c * chunk
    total = seg2 + window_width
    if block_m is None:  # prefill blocks (a group's heads x 64 rows) in one tile: each key is loaded and
        # rotated once per block, not once per 64 rows (1M keys on an H100: 2.0 -> 1.0 ms per chunk)
        wide = m > 64 and query.dtype != torch.float32  # (float32 tiles of 256 rows: not measured)
        block_m = 16 if m <= 16 else min(256, next_power_of_2(m)) if wide else 64
    tiles = triton.cdiv(m, block_m)
    block_n = 64
    programs = b * kv * tiles
    if splits is None:  # enough programs to fill the GPU when there are few query blocks (decoding);
        # wide tiles stop at one wave: merging splits cost more than the idle tail (1.16 vs 1.02 ms)
        fill = 264 if block_m <= 64 else 132
        splits = max(1, min(triton.cdiv(fill, programs), triton.cdiv(total, 4 * block_n)))
    per_split = triton.cdiv(triton.cdiv(total, splits), block_n) * block_n
    splits = triton.cdiv(total, per_split)
    if splits > 1:
        out = torch.empty(splits, b, kv, m, d, dtype=torch.float32, device=query.device)
        lse = torch.empty(splits, b, kv, m, dtype=torch.float32, device=query.device)
    else:
        out = torch.empty(1, b, kv, m, d, dtype=query.dtype, device=query.device)
        lse = out  # unused
    if gpu_cache is not None:
        slot, kg, vg = gpu_cache.slot_of, gpu_cache.keys, gpu_cache.values
    else:
        slot, kg, vg = out, out, out  # unused
    _attention_kernel[(programs, splits)](
        qb, keys, values, cos, sin, starts.contiguous(), ends.contiguous(), selbase,
        window_start.contiguous(), nsink.contiguous(), base, out, lse, slot, kg, vg,
        out if position is None else position, n, b, kv, m, rows, c, n - q if offset is None else offset, scaling, sink,
        seg2, total, per_split,
        qb.stride(0), qb.stride(1), qb.stride(2), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), cos.stride(0), out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        kg.stride(0) if gpu_cache is not None else 0, kg.stride(1) if gpu_cache is not None else 0,
        CH=chunk, CACHED=gpu_cache is not None, POS_ON_DEVICE=position is not None, SHARED=s == 1, STREAMING=streaming,
        HALF=d // 2, SPLIT=splits > 1,
        IEEE=query.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4 if block_m <= 64 else 8,
    )
    if splits > 1:
        merged = torch.empty(b, kv, m, d, dtype=query.dtype, device=query.device)
        merge(out.view(splits, b * kv * m, d), lse.view(splits, b * kv * m), merged.view(b * kv * m, d))
    else:
        merged = out[0]
    out = merged.view(b, kv, g, rows, d).permute(1, 2, 0, 3, 4).reshape(h, b * rows, d)
    return out[:, :q]


# ---------------------------------------------------------------------------- offloading


@triton.jit(do_not_specialize=["L"])
def _fetch_kernel(
    K, V,  # [KV, N, D] keys and values in pinned host memory (read over the bus)
    KG, VG,  # [KV, SLOTS, D] the GPU cache
    TOKENS,  # [L] int64 token to copy
    SLOTS,  # [L] int64 destination slot, < 0 for "nothing to copy"
    L, stride_kh, stride_kn, stride_gh, stride_gn,
    D: tl.constexpr, BLOCK: tl.constexpr,
):
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dd = tl.arange(0, D)
    slot = tl.load(SLOTS + i, mask=i < L, other=-1)
    token = tl.load(TOKENS + i, mask=i < L, other=0)
    ok = (slot >= 0)[:, None]
    src = h * stride_kh + token[:, None] * stride_kn + dd[None, :]
    dst = h * stride_gh + slot[:, None] * stride_gn + dd[None, :]
    tl.store(KG + dst, tl.load(K + src, mask=ok), mask=ok)
    tl.store(VG + dst, tl.load(V + src, mask=ok), mask=ok)


def fetch(keys: torch.Tensor, values: torch.Tensor, gpu_keys: torch.Tensor, gpu_values: torch.Tensor,
          tokens: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy rows `tokens` [L] of host keys/values [kv, n, d] into GPU cache slots `slots` [L]
    (negative slot: skip), every KV head, in one launch (no host synchronisation)."""
    kv, _, d = keys.shape
    length = tokens.numel()
    if length == 0:
        return
    block = 32
    _fetch_kernel[(triton.cdiv(length, block), kv)](
        keys, values, gpu_keys, gpu_values, tokens.contiguous(), slots.contiguous(), length,
        keys.stride(0), keys.stride(1), gpu_keys.stride(0), gpu_keys.stride(1), D=d, BLOCK=block)


@triton.jit
def _store_kernel(
    K, V,  # [KV, N, DK] / [KV, N, DV] keys and values in pinned host memory (written over the bus)
    P, RP,  # [KV, N] int64 stream and RoPE positions, there too
    NEW_K, NEW_V,  # [KV, DK] / [KV, DV] the step's key and value rows (on the GPU)
    NEW_P, NEW_RP,  # [KV] int64 their positions
    SLOT,  # [1] int64: the entry to write (a device value: a captured step writes where the count says)
    stride_kh, stride_kn, stride_vh, stride_vn, stride_ph, stride_rh, stride_nk, stride_nv,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    h = tl.program_id(0)
    slot = tl.load(SLOT)
    dk = tl.arange(0, BLOCK_K)
    dv = tl.arange(0, BLOCK_V)
    tl.store(K + h * stride_kh + slot * stride_kn + dk, tl.load(NEW_K + h * stride_nk + dk, mask=dk < DK),
             mask=dk < DK)
    tl.store(V + h * stride_vh + slot * stride_vn + dv, tl.load(NEW_V + h * stride_nv + dv, mask=dv < DV),
             mask=dv < DV)
    tl.store(P + h * stride_ph + slot, tl.load(NEW_P + h))
    tl.store(RP + h * stride_rh + slot, tl.load(NEW_RP + h))


def store_entry(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
                slot: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position: torch.Tensor,
                rope_position: torch.Tensor) -> None:
    """Write one entry at `slot` ([1] long on the device) of a layer's host buffers: keys/values [kv, n, d]
    and positions/rope_positions [kv, n] in pinned host memory, from key/value [kv, d] and
    position/rope_position [kv] on the GPU. One launch and no host synchronisation, so a captured
    decoding step can append to an offloaded cache (a torch copy into a CPU tensor would synchronise)."""
    kv, _, dk = keys.shape
    dv = values.shape[-1]
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or positions.stride(-1) != 1 or rope_positions.stride(-1) != 1:
        raise ValueError("store_entry writes rows of contiguous last dimensions")
    key, value = key.contiguous(), value.contiguous()
    position = position.to(torch.int64).contiguous()
    rope_position = rope_position.to(torch.int64).contiguous()
    _store_kernel[(kv,)](
        keys, values, positions, rope_positions, key, value, position, rope_position, slot,
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), positions.stride(0),
        rope_positions.stride(0), key.stride(0), value.stride(0),
        DK=dk, DV=dv, BLOCK_K=next_power_of_2(dk), BLOCK_V=next_power_of_2(dv),
    )


@triton.jit
def _admit_newest_kernel(
    K, V,  # [KV, N, D] keys and values in pinned host memory
    KG, VG,  # [KV, SLOTS, D] the GPU cache
    SLOT_OF,  # [>= N] int32: each token's slot, -1 where only in host memory
    TOKEN_OF,  # [SLOTS] int64: each slot's token, -1 where free
    STAMP,  # [SLOTS] int64: each slot's last use (the LRU clock)
    TOKEN,  # [1] int64: the newest key's token
    TICK, SET_SIZE, USED, HITS,  # [] int64 counters: the clock, the last read set's size, reads, hits
    SLOTS, KV, stride_kh, stride_kn, stride_gh, stride_gn,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
):
    # counts: the step read the last step's keys (all cached) and the newest one
    size = tl.load(SET_SIZE) + 1
    tl.store(SET_SIZE, size)
    tl.store(USED, tl.load(USED) + size)
    tl.store(HITS, tl.load(HITS) + size - 1)
    tick = tl.load(TICK) + 1
    tl.store(TICK, tick)
    token = tl.load(TOKEN)
    slot = tl.load(SLOT_OF + token).to(tl.int64)
    hit = slot >= 0
    # the least recently used slot (the first of equal stamps), found whether or not it is needed
    lane = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], 9223372036854775807, tl.int64)
    where = tl.zeros([BLOCK], tl.int64)
    for start in range(0, SLOTS, BLOCK):
        offs = start + lane
        stamp = tl.load(STAMP + offs, mask=offs < SLOTS, other=9223372036854775807)
        better = stamp < best
        best = tl.where(better, stamp, best)
        where = tl.where(better, offs.to(tl.int64), where)
    low = tl.min(best, axis=0)
    victim = tl.min(tl.where(best == low, where, 9223372036854775807), axis=0)
    target = tl.where(hit, slot, victim)
    tl.store(STAMP + target, tick)
    miss = slot < 0
    old = tl.load(TOKEN_OF + victim)
    tl.store(SLOT_OF + old, -1, mask=miss & (old >= 0))  # the evicted token: host memory only
    tl.store(SLOT_OF + token, victim.to(tl.int32), mask=miss)
    tl.store(TOKEN_OF + victim, token, mask=miss)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D)[None, :]
    rows = (h < KV) & (d < D) & miss  # [BLOCK_H, D]
    src = h * stride_kh + token * stride_kn + d
    dst = h * stride_gh + victim * stride_gn + d
    tl.store(KG + dst, tl.load(K + src, mask=rows), mask=rows)
    tl.store(VG + dst, tl.load(V + src, mask=rows), mask=rows)


def admit_newest(keys: torch.Tensor, values: torch.Tensor, cache, token: torch.Tensor) -> None:
    """`GpuKvCache.touch_newest` in one launch: count a step that read the last step's keys plus the
    newest key `token` ([1] long on the device), stamp it if cached, else give it the least recently
    used slot and copy its key and value rows in (keys/values [kv, n, d], in host memory). Replaces
    about 35 small launches a layer in a decoding step."""
    kv, _, d = keys.shape
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or values.stride() != keys.stride():
        raise ValueError("admit_newest reads keys and values of one layout, rows contiguous")
    if cache.keys.stride() != cache.values.stride() or d != next_power_of_2(d):
        raise ValueError("admit_newest needs a GPU cache of one layout and a power-of-two head dim")
    _admit_newest_kernel[(1,)](
        keys, values, cache.keys, cache.values, cache.slot_of, cache.token_of, cache.stamp, token, cache.tick,
        cache.set_size, cache.used, cache.hits, cache.slots, kv, keys.stride(0), keys.stride(1),
        cache.keys.stride(0), cache.keys.stride(1), D=d, BLOCK_H=next_power_of_2(kv), BLOCK=1024, num_warps=4,
    )
