"""Triton: RoPE for tokens' heads at device-side positions, in one launch (issues 30 and 43).

In PyTorch a rotation is two table lookups, a multiply, `rotate_half` (two slices, a negation and a
concatenation), a second multiply and an add: about a dozen operations, each a launch and ~10 us of the host's
time. A decoding step rotates its query and key at every layer; a prompt chunk's forward rotates the chunk's
queries and the whole cache's keys at every layer, and those host calls bound a 1,024-token step on an H200
(records/engine-core-h200/host-bound/). `rotate_tokens` does one launch, with PyTorch's roundings (each product
and the sum rounded to the tensor's dtype, no fused multiply-add), so its output is `Rope.rotate`'s bit for bit
(tests/test_rope_kernel.py).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"])
def _rotate_kernel(
    X,  # [B, H, N, D] tokens' heads (last stride 1)
    COS, SIN,  # [P, D] the RoPE table in X's dtype
    POS,  # [B, KV, N] int positions; head h takes its KV head's h // (H // KV)
    OUT,  # [B, H, N, D] contiguous
    N, stride_xb, stride_xh, stride_xn, stride_pb, stride_pk, stride_pn,
    H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):
    bh = tl.program_id(0).to(tl.int64)  # 64-bit offsets: a whole cache's keys are a slice of a large buffer
    b = bh // H
    h = bh % H
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < N
    at = tokens.to(tl.int64)
    position = tl.load(POS + b * stride_pb + (h // (H // KV)) * stride_pk + at * stride_pn, mask=inside,
                       other=0).to(tl.int64)
    lo = tl.arange(0, HALF)
    x = X + b * stride_xb + h * stride_xh + at[:, None] * stride_xn + lo[None, :]
    first = tl.load(x, mask=inside[:, None])
    second = tl.load(x + HALF, mask=inside[:, None])
    dtype = first.dtype
    cos = COS + position[:, None] * D + lo[None, :]
    sin = SIN + position[:, None] * D + lo[None, :]
    # rotate_half(x) = (-x2, x1): out1 = x1 c1 + (-x2) s1, out2 = x2 c2 + x1 s2, each product and sum rounded
    a = (first.to(tl.float32) * tl.load(cos, mask=inside[:, None]).to(tl.float32)).to(dtype)
    c = ((-second).to(tl.float32) * tl.load(sin, mask=inside[:, None]).to(tl.float32)).to(dtype)
    out = OUT + (bh * N + at[:, None]) * D + lo[None, :]
    tl.store(out, (a.to(tl.float32) + c.to(tl.float32)).to(dtype), mask=inside[:, None])
    a = (second.to(tl.float32) * tl.load(cos + HALF, mask=inside[:, None]).to(tl.float32)).to(dtype)
    c = (first.to(tl.float32) * tl.load(sin + HALF, mask=inside[:, None]).to(tl.float32)).to(dtype)
    tl.store(out + HALF, (a.to(tl.float32) + c.to(tl.float32)).to(dtype), mask=inside[:, None])


def supports(x: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether `rotate_tokens` takes `x` [b, heads, n, d] at `positions` [b, kv, n]: a power-of-two half head
    dim, heads grouped over the positions' KV heads, the positions one per token."""
    b, heads, n, d = x.shape
    half = d // 2
    return (d % 2 == 0 and half >= 1 and half & (half - 1) == 0 and positions.dim() == 3
            and positions.shape[0] == b and positions.shape[-1] == n and heads % positions.shape[1] == 0
            and x.stride(-1) == 1 and positions.device == x.device)


def rotate_tokens(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`Rope.rotate` in one launch: x [b, heads, n, d] at positions [b, kv, n] with the table cos/sin [P, d]
    (x's dtype); a new contiguous [b, heads, n, d] tensor. No host synchronisation (a CUDA graph captures it)."""
    b, heads, n, d = x.shape
    kv = positions.shape[1]
    out = torch.empty(b, heads, n, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = 1 if n == 1 else min(64, triton.next_power_of_2(n))  # tokens a program
    # Triton launches on the current CUDA device: a layer of a model split over GPUs may live on another one
    elsewhere = x.is_cuda and x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if elsewhere else contextlib.nullcontext():
        _rotate_kernel[(b * heads, triton.cdiv(n, block))](
            x, cos, sin, positions, out, n, x.stride(0), x.stride(1), x.stride(2), *positions.stride(),
            H=heads, KV=kv, D=d, HALF=d // 2, BLOCK=block, enable_fp_fusion=False,
        )
    return out

