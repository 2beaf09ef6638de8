"""Triton: one token's linear layer, y = W x (+ b), read at the memory's speed (issue 30).

At batch 1 a decoding step's matrix products are matrix-vector products: every weight is read once and
used for one multiply-add, so their time is the weights' bytes over the memory bandwidth. On an H100
the `llama3-8b` step's products took 5.56 ms through cuBLAS (`records/decode-compiled-h100/`): 14.0 GB
at 2.5 TB/s, where the memory gives 3.35. cuBLAS' batch-1 kernels are general matrix products, tiled for
reuse that a single row never has; the small products (a KV projection is 8 MB) end before the memory is
busy.

Each program here owns `BLOCK_N` output rows and streams their weights in `[BLOCK_N, BLOCK_K]` tiles
(each row's `BLOCK_K` weights contiguous, read in 16-byte vectors), multiplying by the matching slice of
x and summing in float32 lanes that are reduced once at the end. Many small programs keep enough loads in
flight on every multiprocessor; the weights are read with `evict_first`, since no step reads them again
before the rest of the model has passed through the cache.

Sums run in another order than cuBLAS', so outputs differ from `F.linear`'s in the last bits; a decoding
loop that uses the kernel uses it at every single-token step, eager or captured
(`kvpot.engine.linear`), so its paths agree with each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"])
def _gemv_kernel(
    X,  # [K] input row (bf16/fp16/fp32), contiguous
    W,  # [N, K] weights, rows contiguous (stride_wn apart)
    BIAS,  # [N] (HAS_BIAS)
    Y,  # [N] output, x's dtype
    N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # lanes summed once, after the loop
    for k in range(0, K, BLOCK_K):
        if EVEN:  # N a multiple of BLOCK_N and K of BLOCK_K: no masks
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(X + k + cols, eviction_policy="evict_last")
        else:
            inside = (k + cols) < K
            w = tl.load(w_ptrs, mask=(rows[:, None] < N) & inside[None, :], other=0.0,
                        eviction_policy="evict_first")
            x = tl.load(X + k + cols, mask=inside, other=0.0, eviction_policy="evict_last")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def config(n: int, k: int) -> tuple[int, int, int]:
    """The launch shape for an `[n, k]` weight: (rows per program, columns per tile, warps). From the H100
    sweep (records/decode-gemv-h100/, `bf3d1c6`): four rows a program in tiles of up to 2,048 columns,
    four warps, came within 3% of the fastest of 48 shapes for every product of the `llama3-8b` and
    `llama3.2-1b` steps, the vocabulary head included, and 1.1x to 2.1x faster than cuBLAS."""
    return 4, min(2048, max(16, triton.next_power_of_2(k))), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for one row: x [..., K] with one row in all, weight [N, K] (rows
    contiguous), bias [N] or None -> [..., N] in x's dtype. `shape`: (rows per program, columns per
    tile, warps), tuning only; the default comes from `config`."""
    n, k = weight.shape
    if x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"gemv: x must hold one row of {k}, got {tuple(x.shape)}")
    block_n, block_k, warps = shape or config(n, k)
    xs = x.reshape(k).contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        xs, weight, weight if bias is None else bias, out, n, k, weight.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN=(n % block_n == 0 and k % block_k == 0),
        HAS_BIAS=bias is not None, num_warps=warps,
    )
    return out.view(*x.shape[:-1], n)
