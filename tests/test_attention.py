"""The attention function: output and observations against eager softmax attention."""

import pytest
import torch

import kvpot.attention as attention
from kvpot.attention import AttentionRequest, attend, observe
from kvpot.errors import KvpotError


def eager_probs(query, key, scaling):
    """[b, heads, q, n] softmax attention with repeat_kv and lower-right causal alignment."""
    b, heads, q, _ = query.shape
    n = key.shape[2]
    key = key.repeat_interleave(heads // key.shape[1], dim=1)
    logits = query.float() @ key.float().transpose(-1, -2) * scaling
    rows, cols = torch.arange(q)[:, None], torch.arange(n)[None, :]
    logits = logits.masked_fill(cols > n - q + rows, float("-inf"))
    return logits.softmax(-1)


SHAPES = {  # name: (heads, kv_heads, q, n)
    "mha": (4, 4, 7, 19),
    "gqa2": (4, 2, 5, 23),
    "gqa4": (8, 2, 13, 13),
    "decode": (8, 2, 1, 31),
}


@pytest.fixture(params=[None, 3], ids=["whole", "sliced"])
def block(request, monkeypatch):
    """Optionally force query slices of 3 rows, which divide none of the lengths above."""
    if request.param:
        monkeypatch.setattr(attention, "MAX_BLOCK_ELEMENTS", request.param * 1 * 8 * 31)
    return request.param


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "request_",
    [
        AttentionRequest(),
        AttentionRequest(rows=(-1, None)),
        AttentionRequest(rows=(1, -1), row_reduce="mean", head_reduce="max"),
        AttentionRequest(rows=(-4, None), head_reduce="none"),
    ],
    ids=["all-sum-mean", "last", "middle-mean-max", "window-perhead"],
)
def test_observation_equals_eager_softmax(shape, request_, block):
    heads, kv_heads, q, n = SHAPES[shape]
    torch.manual_seed(0)
    query, key = torch.randn(1, heads, q, 16), torch.randn(1, kv_heads, n, 16)
    start, stop, _ = slice(*(request_.rows or (None, None))).indices(q)
    if stop <= start:  # e.g. "middle rows" of a single decoding row: refused, not silently empty
        with pytest.raises(KvpotError, match="select no query row"):
            observe(query, key, request_, scaling=0.25)
        return
    got = observe(query, key, request_, scaling=0.25)
    probs = eager_probs(query, key, 0.25)  # [1, heads, q, n]
    rows = probs[:, :, start:stop]
    rows = rows.sum(2) if request_.row_reduce == "sum" else rows.mean(2)  # [1, heads, n]
    grouped = rows.view(1, kv_heads, heads // kv_heads, n)
    want = {"mean": grouped.mean(2), "max": grouped.amax(2), "none": rows}[request_.head_reduce]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_attend_equals_eager_attention(shape, block):
    heads, kv_heads, q, n = SHAPES[shape]
    torch.manual_seed(1)
    query, key, value = torch.randn(1, heads, q, 16), torch.randn(1, kv_heads, n, 16), torch.randn(1, kv_heads, n, 16)
    probs = eager_probs(query, key, 0.25)
    want = probs @ value.repeat_interleave(heads // kv_heads, dim=1)
    torch.testing.assert_close(attend(query, key, value, 0.25), want, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_honour():
    q = torch.randn(1, 2, 1, 8)
    with pytest.raises(KvpotError, match=r"set_attn_implementation\('sdpa'\)"):
        attention.kvpot_attention(None, q, q, q, None)
    with pytest.raises(KvpotError, match="soft-capping"):
        attention.kvpot_attention(None, q, q, q, None, kvpot_cache=object(), softcap=30.0)
    with pytest.raises(KvpotError, match="sliding-window"):
        attention.kvpot_attention(None, q, q, q, None, kvpot_cache=object(), sliding_window=16)
    with pytest.raises(KvpotError, match="padded"):
        attention.kvpot_attention(None, q, q, q, torch.ones(1, 1, 1, 1), kvpot_cache=object())


@pytest.mark.parametrize("keys", [None, 5])
def test_observation_over_cached_entries_renormalises_over_them(keys):
    """CItruS eq. 1: softmax over the cache C only; the forward's own entries get 0."""
    torch.manual_seed(2)
    heads, kv_heads, q, n = 4, 2, 3, 11
    query, key = torch.randn(1, heads, q, 16), torch.randn(1, kv_heads, n, 16)
    got = observe(query, key, AttentionRequest(row_reduce="mean", over="cached", keys=keys), scaling=0.25)
    limit = keys or n - q
    logits = query @ key.repeat_interleave(2, dim=1)[:, :, :limit].transpose(-1, -2) * 0.25
    want = logits.softmax(-1).mean(2).view(1, kv_heads, 2, limit).mean(2)
    torch.testing.assert_close(got[..., :limit], want, rtol=1e-5, atol=1e-6)
    assert got[..., limit:].abs().sum() == 0
