"""Chunked-prefill attention on CUDA at the speed of a one-shot causal forward.

A chunk's `q` new queries see every cached key and their own keys causally (lower-right causal
alignment). SDPA runs that as one call with a lower-right bias, which on an H100 only
FlashAttention-2 accepts (about 360 TFLOP/s), while transformers' one-shot forward, a square
causal attention, runs on cuDNN's Hopper kernel. So the chunk is split in two attentions that
cuDNN takes, each with its log-sum-exp, and merged exactly:

- the cached prefix (`n - q` keys) without any mask. No mask means the query heads of a KV group
  can be folded into query rows (`[b, kv, group*q, d]`), which is GQA with no repeated keys;
- the chunk's own `q` keys, causal and square (upper-left = lower-right alignment).

softmax over the union = the two partial outputs weighted by `sigmoid(lse_own - lse_prefix)`.
The log-sum-exp is also what the observation of attention probabilities needs (`kvpot.attention.observe`).

These are private aten operators (`_scaled_dot_product_cudnn_attention`,
`_flash_attention_forward`), the ones `scaled_dot_product_attention` dispatches to. Whether they run
here is checked once per device against the public SDPA path (`split_ok`); anything else - older
torch, another GPU, a refusal - falls back to the single lower-right SDPA call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def lower_right(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """One SDPA call with a lower-right causal bias: query [b, h, q, d], key/value [b, kv, n, d]."""
    mask = causal_lower_right(query.shape[2], key.shape[2])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)


def _cudnn(query, key, value, scaling: float, causal: bool):
    """cuDNN attention with equal head counts: out [b, h, q, d], lse [b, h, q] (natural log)."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, causal, False, scale=scaling)[:2]
    return out, lse.reshape(query.shape[:3])


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """Every query over every key, no mask. query [b, h, q, d], key/value [b, kv, p, d].

    Returns out [b, h, q, d] and lse [b, h, q] float32. GQA by folding each group's heads into
    query rows (heads h = kv * group, in transformers' `repeat_kv` order).
    """
    b, h, q, d = query.shape
    kv = key.shape[1]
    folded = query.reshape(b, kv, (h // kv) * q, d)
    out, lse = _cudnn(folded, key, value, scaling, causal=False)
    return out.reshape(b, h, q, d), lse.reshape(b, h, q)


def own_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """The chunk over its own keys, causal. query [b, h, q, d], key/value [b, kv, q, d].

    Returns out [b, h, q, d] and lse [b, h, q] float32 (keys repeated per query head: `q` keys
    only, so the copy is small next to the prefix).
    """
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    return _cudnn(query, key, value, scaling, causal=True)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """The attention over keys A and B together from the attention over each, with its lse.

    Also returns the joint log-sum-exp [b, h, q]."""
    weight = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)  # B's share of the joint softmax mass
    out = out_a.float().lerp_(out_b.float(), weight).to(out_a.dtype)
    return out, torch.logaddexp(lse_a, lse_b)


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """Lower-right causal attention of `q` queries over `n >= q` keys, as prefix + own.

    query [b, h, q, d] (rotated), key/value [b, kv, n, d]. Returns out [b, h, q, d] and lse [b, h, q].
    """
    q, n = query.shape[2], key.shape[2]
    own = own_attention(query, key[:, :, n - q :], value[:, :, n - q :], scaling)
    if n == q:
        return own
    prefix = prefix_attention(query, key[:, :, : n - q], value[:, :, : n - q], scaling)
    return merge(*prefix, *own)


def split_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `split_attention` runs on this device and gives SDPA's answer (checked once)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    return _split_ok(device.index if device.index is not None else torch.cuda.current_device(), dtype, head_dim)


@functools.cache
def _split_ok(index: int, dtype: torch.dtype, head_dim: int) -> bool:
    device = torch.device("cuda", index)
    generator = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(1, 4, 96, head_dim, device=device, dtype=dtype, generator=generator)
    key = torch.randn(1, 2, 352, head_dim, device=device, dtype=dtype, generator=generator)
    value = torch.randn(1, 2, 352, head_dim, device=device, dtype=dtype, generator=generator)
    try:
        got, _ = split_attention(query, key, value, head_dim**-0.5)
        want = lower_right(query, key, value, head_dim**-0.5)
    except Exception:  # noqa: BLE001 - no cuDNN attention here: the single SDPA call it is
        return False
    return bool((got.float() - want.float()).abs().max() < 2e-2)
