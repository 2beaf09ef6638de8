"""The Triton observation kernels against `kvpot.attention.observe`'s PyTorch path, over named shapes.

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1` runs them in Triton's
interpreter. Elsewhere the module is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels

from kvpot import attention
from kvpot.attention import AttentionRequest, observe

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, heads, kv_heads, q, n, d): GQA 1/3/4, row and key counts off the 64-blocks, no cache
SHAPES = [
    ("gqa4-d64", 8, 2, 40, 150, 64),
    ("gqa3-d64-smollm2", 9, 3, 70, 200, 64),
    ("mha-d32", 4, 4, 33, 33, 32),  # the first chunk: every key is the forward's own
    ("gqa4-d128-one-row", 8, 2, 1, 97, 128),
]
if DEVICE == "cuda":
    SHAPES += [("llama3-8b-chunk", 32, 8, 2048, 6144, 128), ("llama3-8b-512", 32, 8, 512, 4608, 128)]
IDS = [s[0] for s in SHAPES]
# (rows, row_reduce, over): H2O/D2O, TOVA, SnapKV/InfiniPot windows, CItruS' chunk and instruction
REQUESTS = {
    "h2o": AttentionRequest(rows=None, row_reduce="sum"),
    "tova": AttentionRequest(rows=(-1, None), row_reduce="sum"),
    "window": AttentionRequest(rows=(-5, None), row_reduce="sum"),
    "citrus-chunk": AttentionRequest(rows=None, row_reduce="mean", over="cached"),
    "citrus-keys": AttentionRequest(rows=(-3, None), row_reduce="mean", over="cached", keys=20),
}


def lse_of(query, key, scaling):
    """Each row's natural log-sum-exp over the keys it sees (lower-right causal), float32."""
    h, kv = query.shape[1], key.shape[1]
    q, n = query.shape[2], key.shape[2]
    scores = query.float() @ key.float().repeat_interleave(h // kv, 1).transpose(-1, -2) * scaling
    future = torch.arange(n, device=query.device)[None, :] > (n - q + torch.arange(q, device=query.device))[:, None]
    return scores.masked_fill(future, float("-inf")).logsumexp(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32])
@pytest.mark.parametrize("request_name", REQUESTS)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_kernel_observation_matches_pytorch(shape, request_name, dtype, monkeypatch):
    _, heads, kv, q, n, d = shape
    request = REQUESTS[request_name]
    if request.over == "cached" and n == q:
        pytest.skip("nothing is cached before the first chunk")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    query = torch.randn(1, q, heads, d, generator=g, device=DEVICE).to(dtype).transpose(1, 2)  # model layout
    key = torch.randn(1, kv, n, d, generator=g, device=DEVICE).to(dtype)
    scaling = d**-0.5
    lse = lse_of(query, key, scaling)
    assert attention._kernel_ok(query)
    got = observe(query, key, request, scaling, lse)
    monkeypatch.setattr(attention, "_kernel_ok", lambda query: False)
    want = observe(query, key, request, scaling)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
