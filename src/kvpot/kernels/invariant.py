"""Triton: a linear layer whose every row comes out the same whatever the batch around it (batch-invariant
decoding, `Engine(batch_invariant=True)`).

cuBLAS picks its algorithm from the product's shape: a decoding step of 8 rows and one of 1 row sum each
row's products in different orders (different tiles, split-K or not), so in bf16 a request's tokens drift
with the batch it decodes in (84% of SmolLM2's answers identical batched against alone on an H100,
`records/engine-core-h100/varlen/`). Here the tiling is fixed: every row is multiplied in a
`[BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]` matrix-unit product, `K` walked in `BLOCK_K` steps in the same
order, into a float32 accumulator, with no split of `K`. A row's output then depends on that row and the
weights alone: not on how many rows there are, nor where the row sits in its tile (a matrix unit computes
each output element from its own row and column). One row pads its tile with 15 masked rows; the work is
memory-bound at decoding's batch sizes, so the padding costs the weights' read, not compute. The tile's other
sizes follow the weight's shape alone (`tiles`).

`invariant_mean`: the mean over the last dimension (an RMSNorm's variance) in a fixed order. torch's reduction
kernel gives one row's reduction more threads than each of eight rows' (its block widens as the outputs get
fewer), so its sums' order, and a norm's last bits, follow the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows a tile: the smallest matrix-unit tile, fixed
BLOCK_MEAN = 256  # a row's lanes in `invariant_mean`


def tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(columns a tile, K a step, warps, pipeline stages) for an [n, k] weight. From the weight's shape alone, never
    from the row count: a row's sums keep one order at any batch (and change when these do). From the H100 sweep
    (`benchmarks/engine-core-h100/invariant_sweep.py`, records/engine-core-h100/invariant/): for each product of the
    llama3-8b and SmolLM2 steps, the shape fastest at 1 and 8 rows. Those products summed over the 8B step:
    ~10.5 ms at 1 row and 10.7 at 8 against 24.0 and 24.0 with (64, 64, 4, 3) (cuBLAS 5.5), but ~40 against 34 ms
    at 64 rows. Every shape swept kept a row's bits alone and among 64 rows."""
    if n >= 32768:  # a vocabulary head
        return 128, 64, 4, 3
    if k < 1024:
        return 16, 256, 4, 4
    if n > 8192:  # an MLP's up and gate projections
        return 64, 128, 4, 3
    return 16, 512, 4, 3


@triton.jit(do_not_specialize=["M", "N", "K"])
def _linear_kernel(
    X,  # [M, K] input rows (stride_xm apart, last stride 1)
    W,  # [N, K] weights (stride_wn apart, last stride 1)
    BIAS,  # [N] (HAS_BIAS)
    Y,  # [M, N] output, contiguous, x's dtype
    M, N, K, stride_xm, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # row tiles first: one weight tile's readers
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # run together and share it through the L2
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = X + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
    w_ptrs = W + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [BLOCK_K, BLOCK_N]: W's tile, transposed
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        inside = (k + ks) < K
        x = tl.load(x_ptrs, mask=(rows[:, None] < M) & inside[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=inside[:, None] & (cols[None, :] < N), other=0.0, eviction_policy="evict_first")
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     shape: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with each row's result independent of the other rows: x [..., K], weight
    [N, K] (rows contiguous), bias [N] or None -> [..., N] in x's dtype. Sums in float32 (exact float32
    products for float32 inputs). `shape`: (columns a tile, K a step, warps, stages), tuning only; the default
    comes from `tiles`."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"invariant_linear: x's last dimension must be {k}, got {tuple(x.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("invariant_linear: the weight's rows must be contiguous")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = shape or tiles(n, k)
    # pipeline stages within ~96 KB of shared memory (float32 tiles are twice bf16's; an A100 has 164 KB, consumer
    # GPUs ~100): stages overlap loads and leave the sums' order alone
    stages = max(1, min(stages, (96 * 1024) // ((BLOCK_M + block_n) * block_k * x.element_size())))
    if m:
        _linear_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))](
            rows, weight, weight if bias is None else bias, out, m, n, k, rows.stride(0), weight.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages,
        )
    return out.view(*x.shape[:-1], n)


@triton.jit(do_not_specialize=["K"])
def _mean_kernel(X, Y, K, stride_xm, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)  # one program a row, lanes summed once at the end: a fixed order
    for k in range(0, K, BLOCK):
        acc += tl.load(X + row * stride_xm + k + lanes, mask=(k + lanes) < K, other=0.0).to(tl.float32)
    tl.store(Y + row, (tl.sum(acc, axis=0) / K).to(Y.dtype.element_ty))


def invariant_mean(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """`x.mean(-1, keepdim=keepdim)` (floating x), each row's sum in an order fixed by its length alone."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0] and k:
        _mean_kernel[(rows.shape[0],)](rows, out, k, rows.stride(0), BLOCK=BLOCK_MEAN, num_warps=4)
    elif rows.shape[0]:
        out.fill_(float("nan"))  # as torch: the mean of nothing
    return out.view(*x.shape[:-1], *((1,) if keepdim else ()))
