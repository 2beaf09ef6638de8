"""The split chunk attention (`kvpot.kernels.sdpa`) against one lower-right SDPA call, and the
observation that uses its log-sum-exp against the softmax it replaces."""

from __future__ import annotations

import pytest
import torch

from kvpot.attention import AttentionRequest, attend_with_lse, observe
from kvpot.kernels import sdpa


def reference(query, key, value, scaling):
    """Lower-right causal attention in float32 with each row's log-sum-exp, by definition."""
    b, h, q, d = query.shape
    n = key.shape[2]
    group = h // key.shape[1]
    k = key.float().repeat_interleave(group, 1)
    v = value.float().repeat_interleave(group, 1)
    scores = query.float() @ k.transpose(-1, -2) * scaling  # [b, h, q, n]
    future = torch.arange(n)[None, :] > (n - q + torch.arange(q))[:, None]
    scores = scores.masked_fill(future.to(scores.device), float("-inf"))
    return scores.softmax(-1) @ v, scores.logsumexp(-1)


def tensors(b, heads, kv, q, n, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)  # noqa: E731
    return make(b, heads, q, d), make(b, kv, n, d), make(b, kv, n, d)


@pytest.mark.parametrize("split_at", [1, 17, 40])
def test_merge_of_two_key_sets_is_the_attention_over_both(split_at):
    query, key, value = tensors(1, 6, 6, 9, 48, 16)
    out, lse = reference(query[:, :, -1:], key, value, 0.25)  # last row: sees all 48 keys
    a = reference(query[:, :, -1:], key[:, :, :split_at], value[:, :, :split_at], 0.25)
    # the second part seen in full by one row is "lower-right causal" with q=1 too
    b = reference(query[:, :, -1:], key[:, :, split_at:], value[:, :, split_at:], 0.25)
    merged, merged_lse = sdpa.merge(a[0], a[1], b[0], b[1])
    torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [None, (-3, None), (2, 5)])
@pytest.mark.parametrize("reduce", ["mean", "max", "none"])
def test_observation_from_lse_equals_the_softmax(rows, reduce):
    query, key, value = tensors(1, 8, 2, 7, 30, 16)
    _, lse = reference(query, key, value, 0.3)
    request = AttentionRequest(rows=rows, row_reduce="sum", head_reduce=reduce)
    want = observe(query, key, request, 0.3)
    got = observe(query, key, request, 0.3, lse)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if rows is None and reduce == "mean":  # each row's probabilities sum to one: 7 rows in all
        torch.testing.assert_close(got.sum(-1), torch.full((1, 2), 7.0))


def test_cached_observation_ignores_the_lse():
    """over='cached' renormalises over the cached entries: the joint lse must not be used."""
    query, key, value = tensors(1, 4, 2, 5, 20, 16)
    _, lse = reference(query, key, value, 0.3)
    request = AttentionRequest(rows=None, over="cached")
    torch.testing.assert_close(observe(query, key, request, 0.3, lse), observe(query, key, request, 0.3))
    per_row = observe(query, key, AttentionRequest(rows=(0, 1), over="cached"), 0.3)
    torch.testing.assert_close(per_row.sum(-1), torch.ones(1, 2))


def test_cpu_attend_gives_no_lse_and_the_reference():
    query, key, value = tensors(1, 8, 2, 12, 40, 16)
    out, lse = attend_with_lse(query, key, value, 0.25)
    assert lse is None
    torch.testing.assert_close(out, reference(query, key, value, 0.25)[0], atol=1e-5, rtol=1e-5)


# (b, heads, kv_heads, q, n, head_dim): llama3-8b and SmolLM2 layers, MHA, a chunk equal to the
# cache (no prefix), a one-key prefix, ragged sizes.
SHAPES = {
    "llama3-8b": (1, 32, 8, 512, 2560, 128),
    "smollm2": (1, 9, 3, 300, 1324, 64),
    "mha": (1, 8, 8, 128, 640, 64),
    "no-prefix": (1, 32, 8, 256, 256, 128),
    "one-key-prefix": (1, 4, 2, 97, 98, 128),
    "ragged": (1, 12, 4, 77, 1001, 64),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_split_attention_matches_the_reference_on_cuda(shape, dtype):
    b, heads, kv, q, n, d = shape
    assert sdpa.split_ok(torch.device("cuda"), dtype, d), "cuDNN split attention should run on this GPU"
    query, key, value = tensors(b, heads, kv, q, n, d, dtype, "cuda")
    query = query.transpose(1, 2).contiguous().transpose(1, 2)  # the model's [b, q, h, d] layout
    out, lse = sdpa.split_attention(query, key, value, d**-0.5)
    want, want_lse = reference(query, key, value, d**-0.5)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-2, rtol=1e-3)
    single = sdpa.lower_right(query, key, value, d**-0.5)
    torch.testing.assert_close(out, single, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_cuda_observation_with_lse_matches_float32():
    query, key, value = tensors(1, 32, 8, 256, 1280, 128, torch.bfloat16, "cuda")
    _, lse = attend_with_lse(query, key, value, 128**-0.5)
    assert lse is not None
    request = AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean")
    got = observe(query, key, request, 128**-0.5, lse)
    want = observe(query.cpu().float(), key.cpu().float(), request, 128**-0.5)
    torch.testing.assert_close(got.cpu(), want, atol=2e-2, rtol=2e-2)
