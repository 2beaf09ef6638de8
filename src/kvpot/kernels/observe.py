"""Triton kernels for the attention observations eviction methods score with (H2O, TOVA, D2O,
SnapKV, InfiniPot's catalyst, CItruS): the attention probabilities of chosen query rows, summed
over those rows and over the query heads of each KV group, for every key.

`kvpot.attention.observe` is the PyTorch reference (tests/test_observe_kernel.py). It materialises
`[heads, rows, n]` float32 scores and softmaxes them, which for a 2,048-token chunk over 6K keys is
~9x the chunk's attention itself. Here each program holds one block of keys and streams the query
rows of its KV group past it, so scores never leave registers:

- `_columns_kernel`: `sum over rows and heads of exp2(s - lse)`, given each row's log2-sum-exp
  (the attention kernel's, `kvpot.kernels.sdpa`, for probabilities over every key the row sees;
  causal for the forward's own keys, lower-right aligned as in `attend`);
- `_row_lse_kernel`: each row's log2-sum-exp over the first `n` keys only, for observations
  normalised over the cached entries (CItruS eq. 1), where the attention's own lse does not apply.

Scores are in log2 units (`scale * log2(e)` folded in), so `exp2` is the only exponential. The
query heads of a group are folded into rows: row `r` of a program's group is head `g = r // R`,
query row `r % R`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvpot.kernels.common import half_scores, load_keys, load_query

LOG2E = 1.0 / math.log(2.0)
BLOCK_M = 64  # folded query rows per step
BLOCK_N = 64  # keys per program (columns) / per step (row lse)


@triton.jit(do_not_specialize=["R", "N", "G", "ROW0", "CACHED"])
def _columns_kernel(
    Q,  # [H, Q, D] rotated queries (H = KV * G); rows ROW0 .. ROW0+R-1 are observed
    K,  # [KV, >=N, D] rotated keys
    LSE,  # [H, R] float32 log2-sum-exp of each observed row
    OUT,  # [KV, N] float32: sum over the group's heads and the rows of each key's probability
    R, N, G, ROW0, CACHED, scale,  # scale: softmax scale * log2(e)
    stride_qh, stride_qr, stride_kh, stride_kn, stride_lh,
    CAUSAL: tl.constexpr, IEEE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    kv = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    dd = tl.arange(0, D)
    k = tl.load(K + kv * stride_kh + cols[:, None] * stride_kn + dd[None, :], mask=col_ok[:, None], other=0.0)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for m0 in range(0, G * R, BLOCK_M):
        folded = m0 + tl.arange(0, BLOCK_M)
        ok = folded < G * R
        head = kv * G + folded // R
        row = folded % R
        q = tl.load(Q + head[:, None] * stride_qh + (ROW0 + row)[:, None] * stride_qr + dd[None, :],
                    mask=ok[:, None], other=0.0)
        lse = tl.load(LSE + head * stride_lh + row, mask=ok, other=float("inf"))
        if IEEE:  # float32 models: full-precision products (the default would round to tf32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] float32
        p = tl.exp2(s - lse[:, None])
        keep = ok[:, None] & col_ok[None, :]
        if CAUSAL:  # the forward's own keys: row i sees key CACHED + j for j <= i
            keep = keep & ((cols[None, :] < CACHED) | (cols[None, :] - CACHED <= (ROW0 + row)[:, None]))
        acc += tl.sum(tl.where(keep, p, 0.0), axis=0)
    tl.store(OUT + kv * N + cols, acc, mask=col_ok)


@triton.jit(do_not_specialize=["R", "N", "G", "ROW0"])
def _row_lse_kernel(
    Q,  # [H, Q, D] rotated queries
    K,  # [KV, >=N, D] rotated keys; the first N are the row's whole support
    LSE,  # [H, R] float32 out: log2-sum-exp of each row over keys [0, N)
    R, N, G, ROW0, scale,
    stride_qh, stride_qr, stride_kh, stride_kn,
    IEEE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    kv = tl.program_id(1)
    folded = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = folded < G * R
    head = kv * G + folded // R
    row = folded % R
    dd = tl.arange(0, D)
    q = tl.load(Q + head[:, None] * stride_qh + (ROW0 + row)[:, None] * stride_qr + dd[None, :],
                mask=ok[:, None], other=0.0)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + kv * stride_kh + cols[:, None] * stride_kn + dd[None, :], mask=(cols < N)[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where((cols < N)[None, :], s, float("-inf"))
        new_top = tl.maximum(top, tl.max(s, axis=1))
        total = total * tl.exp2(top - new_top) + tl.sum(tl.exp2(s - new_top[:, None]), axis=1)
        top = new_top
    tl.store(LSE + head * R + row, top + tl.log2(total), mask=ok)


def supports(query: torch.Tensor) -> bool:
    """Shapes these kernels take: one sequence, a power-of-two head dim from 16 to 256."""
    d = query.shape[-1]
    return query.shape[0] == 1 and 16 <= d <= 256 and d & (d - 1) == 0


def observe_columns(query: torch.Tensor, key: torch.Tensor, start: int, stop: int, scaling: float,
                    lse: torch.Tensor | None = None, n_keys: int | None = None) -> torch.Tensor:
    """Per key, the attention probability summed over query rows `start:stop` and each group's heads.

    query [1, heads, q, d] rotated; key [1, kv_heads, n, d] rotated (the last `q` are this forward's
    own, causal). `lse` [1, heads, q] float32 natural-log log-sum-exp of every row over all keys it
    sees (the attention's): probabilities over every visible key. `lse=None`: probabilities over the
    first `n_keys` keys only (all cached, so no causal mask), whose lse is computed here.
    Returns float32 [1, kv_heads, n] (n_keys with `lse=None`), summed (not averaged).
    """
    _, heads, q, d = query.shape
    kv, n = key.shape[1], key.shape[2]
    group, rows = heads // kv, stop - start
    query, key = query[0], key[0]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    scale = scaling * LOG2E
    ieee = query.dtype == torch.float32
    if lse is None:
        n = n if n_keys is None else n_keys
        lse2 = torch.empty(heads, rows, dtype=torch.float32, device=query.device)
        _row_lse_kernel[(triton.cdiv(group * rows, BLOCK_M), kv)](
            query, key, lse2, rows, n, group, start, scale,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            IEEE=ieee, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        )
        causal = False
    else:
        lse2 = lse[0, :, start:stop].float() * LOG2E
        causal = True
    out = torch.empty(kv, n, dtype=torch.float32, device=query.device)
    _columns_kernel[(triton.cdiv(n, BLOCK_N), kv)](
        query, key, lse2, out, rows, n, group, start, key.shape[1] - q, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), lse2.stride(0),
        CAUSAL=causal, IEEE=ieee, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    return out[None]



@triton.jit(do_not_specialize=["N", "G"])
def _varlen_columns_kernel(
    Q,  # [T, H, D] packed queries (H = KV * G), rotated unless ROPE
    K,  # [S, KV, N, D] pool keys, rotated unless ROPE
    LSE,  # [T, H] float32 natural log-sum-exp of each token (the varlen attention's)
    SLOTS, STARTS, CACHED, ROW0, COUNT, MEAN,  # [R], [R + 1], [R], [R], [R], [R] int
    COS, SIN,  # [P, D] RoPE table (ROPE)
    KPOS,  # [S, KV, N] int RoPE position of each entry (ROPE); a token's query takes its own entry's
    OUT,  # [R, KV, N] float32
    N, G, scale,  # scale: softmax scale * log2(e)
    stride_qt, stride_qh, stride_ks, stride_kh, stride_kn, stride_lt, stride_ps, stride_ph, stride_pn, stride_t,
    stride_or, stride_oh,
    ROPE: tl.constexpr, IEEE: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KEYS_BY_ROW: tl.constexpr = False,  # K is [R, KV, N, D]: each row's keys rotated already
):
    block, kv, r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(COUNT + r).to(tl.int32)
    first = tl.load(STARTS + r).to(tl.int64)
    cached = tl.load(CACHED + r).to(tl.int32)
    n = cached + (tl.load(STARTS + r + 1).to(tl.int32) - first.to(tl.int32))
    if count > 0 and block * BLOCK_N < n:  # rows that observe nothing, and keys past the row's, end at once
        slot = tl.load(SLOTS + r).to(tl.int64)
        row0 = tl.load(ROW0 + r).to(tl.int32)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        dh = tl.arange(0, HALF)
        if KEYS_BY_ROW:
            K += r.to(tl.int64) * stride_ks + kv * stride_kh
        else:
            K += slot * stride_ks + kv * stride_kh
        KPOS += slot * stride_ps + kv * stride_ph
        k1, k2 = load_keys(K, KPOS, COS, SIN, cols, col_ok, dh, stride_kn, stride_pn, stride_t, HALF,
                           ROPE and not KEYS_BY_ROW)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(0, G * count, BLOCK_M):
            folded = m0 + tl.arange(0, BLOCK_M)
            ok = folded < G * count
            head = kv * G + folded // count
            row = row0 + folded % count  # the token's index in its row
            token = first + row
            q_ptr = Q + token[:, None] * stride_qt + head[:, None] * stride_qh + dh[None, :]
            q1, q2 = load_query(q_ptr, KPOS, COS, SIN, cached + row, ok, dh, stride_pn, stride_t, HALF, ROPE)
            q1 = q1.to(K.dtype.element_ty)
            q2 = q2.to(K.dtype.element_ty)
            lse = tl.load(LSE + token * stride_lt + head, mask=ok, other=float("inf")) * 1.4426950408889634
            p = tl.exp2(half_scores(q1, q2, k1, k2, IEEE) * scale - lse[:, None])
            # every cached key is seen; the row's own keys causally (token i sees own key j <= i)
            keep = ok[:, None] & col_ok[None, :] & ((cols[None, :] < cached) | (cols[None, :] - cached <= row[:, None]))
            acc += tl.sum(tl.where(keep, p, 0.0), axis=0)
        divisor = G * tl.where(tl.load(MEAN + r) != 0, count, 1)
        tl.store(OUT + r * stride_or + kv * stride_oh + cols, acc / divisor.to(tl.float32), mask=col_ok)


def observe_varlen(query: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                   cached: torch.Tensor, row0: torch.Tensor, count: torch.Tensor, mean: torch.Tensor,
                   scaling: float, out: torch.Tensor, lse: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                   sin: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                   row_keys: torch.Tensor | None = None) -> None:
    """`kvpot.kernels.observe_reference.observe_varlen_reference` in one launch: each row's observed tokens'
    attention probabilities (`exp(s - lse)`, `lse` [T, heads] from `kvpot.kernels.varlen`) over its slot's
    keys, summed over the rows (or averaged) and averaged over each group's heads, into `out` [R, kv, capacity].
    With `cos`, keys and queries are rotated on load as the varlen kernel does; `row_keys` holds each row's keys
    rotated ahead (`kvpot.kernels.varlen.rotate_rows`). Every bound is read on the device and the grid is sized from
    the keys' capacity: safe to capture in a CUDA graph."""
    if lse is None:
        raise ValueError("observe_varlen needs the attention's log-sum-exp of every token")
    heads, d = query.shape[1:]
    kv, capacity = keys.shape[1], keys.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    rope = cos is not None
    # float32 at head dim 256 failed on an H200 with 64 x 64 tiles (records/engine-core-h200/packed/): half the tiles
    block = BLOCK_N if d * query.element_size() <= 512 else BLOCK_N // 2
    tables = (cos, sin, key_positions) if rope else (keys, keys, slots)
    rope_strides = (*key_positions.stride(), cos.stride(0)) if rope else (0, 0, 0, 0)
    source = keys if row_keys is None else row_keys
    _varlen_columns_kernel[(triton.cdiv(capacity, block), kv, slots.shape[0])](
        query, source, lse, slots, starts, cached, row0, count, mean, *tables, out, capacity, heads // kv,
        scaling * LOG2E, query.stride(0), query.stride(1), *source.stride()[:3], lse.stride(0), *rope_strides,
        out.stride(0), out.stride(1),
        ROPE=rope, IEEE=query.dtype == torch.float32, HALF=d // 2, BLOCK_M=block, BLOCK_N=block,
        KEYS_BY_ROW=row_keys is not None,
    )
