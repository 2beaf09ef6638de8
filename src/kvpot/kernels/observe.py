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
