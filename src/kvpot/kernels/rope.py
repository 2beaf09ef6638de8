"""Triton: RoPE for one token's heads at device-side positions, in one launch (issue 30).

A fixed-shape decoding step under `absolute` positions rotates the new key (stored rotated) and the query
at the token's position: in PyTorch each is a table lookup, a multiply, `rotate_half` (a negation and a
concatenation), a second multiply and an add, seven launches per rotation and fourteen per layer.
`rotate_token` does one, with PyTorch's roundings (each product and the sum rounded to the tensor's dtype,
no fused multiply-add), so its output is `Rope.rotate`'s bit for bit (tests/test_rope_kernel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_kernel(
    X,  # [B, H, D] one token's heads (last stride 1)
    COS, SIN,  # [P, D] the RoPE table in X's dtype
    POS,  # [B, KV] int positions; head h takes its KV head's h // (H // KV)
    OUT,  # [B, H, D] contiguous
    stride_xb, stride_xh, stride_pb, stride_pk,
    H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    position = tl.load(POS + b * stride_pb + (h // (H // KV)) * stride_pk).to(tl.int64)
    lo = tl.arange(0, HALF)
    x = X + b * stride_xb + h * stride_xh
    first = tl.load(x + lo)
    second = tl.load(x + HALF + lo)
    dtype = first.dtype
    cos = COS + position * D
    sin = SIN + position * D
    # rotate_half(x) = (-x2, x1): out1 = x1 c1 + (-x2) s1, out2 = x2 c2 + x1 s2, each product and sum rounded
    a = (first.to(tl.float32) * tl.load(cos + lo).to(tl.float32)).to(dtype)
    c = ((-second).to(tl.float32) * tl.load(sin + lo).to(tl.float32)).to(dtype)
    out = OUT + (b * H + h) * D
    tl.store(out + lo, (a.to(tl.float32) + c.to(tl.float32)).to(dtype))
    a = (second.to(tl.float32) * tl.load(cos + HALF + lo).to(tl.float32)).to(dtype)
    c = (first.to(tl.float32) * tl.load(sin + HALF + lo).to(tl.float32)).to(dtype)
    tl.store(out + HALF + lo, (a.to(tl.float32) + c.to(tl.float32)).to(dtype))


def supports(x: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether `rotate_token` takes `x` [b, heads, 1, d] at `positions` [b, kv, 1]: one token, a power-of-two
    half head dim, heads grouped over the positions' KV heads."""
    b, heads, q, d = x.shape
    half = d // 2
    return (q == 1 and d % 2 == 0 and half >= 1 and half & (half - 1) == 0 and positions.shape[-1] == 1
            and positions.shape[0] == b and heads % positions.shape[1] == 0 and x.stride(-1) == 1)


def rotate_token(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`Rope.rotate` of one token: x [b, heads, 1, d] at positions [b, kv, 1] with the table cos/sin [P, d]
    (x's dtype); a new [b, heads, 1, d] tensor. No host synchronisation (a CUDA graph captures it)."""
    b, heads, _, d = x.shape
    kv = positions.shape[1]
    out = torch.empty(b, heads, 1, d, dtype=x.dtype, device=x.device)
    _rotate_kernel[(b, heads)](
        x, cos, sin, positions, out, x.stride(0), x.stride(1), positions.stride(0), positions.stride(1),
        H=heads, KV=kv, D=d, HALF=d // 2, enable_fp_fusion=False,
    )
    return out
