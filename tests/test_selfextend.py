"""Self-Extend (Jin et al. 2024): grouped positions beyond a neighbour window, no eviction."""

from __future__ import annotations

import logging

import pytest
import torch

import kvpot
from conftest import VOCAB, build, build_llama, reference_greedy
from kvpot.errors import KvpotError
from kvpot.methods import make_method
from kvpot.methods.selfextend.attention import self_extend_attention
from kvpot.models import rotary_embedding
from kvpot.positions import SelfExtendPositions
from kvpot.rope import Rope, rotate_half

NEW = 16


def _rotate(rope: Rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope.cos_sin(positions, x, int(positions.max()) + 1)
    return x * cos + rotate_half(x) * sin


def papers_attention(rope, query, keys, values, scaling, group, window):
    """The paper's definition as its authors' code writes it: the neighbour map (query at i, key at j) and
    the grouped map (query at floor(i/G) + W - floor(W/G), key at floor(j/G)), merged by
    `where(i - j < W)` before one causal softmax. query [h, q, d] (the last q of n), keys/values [kv, n, d]."""
    h, q, d = query.shape
    kv, n = keys.shape[:2]
    i = torch.arange(n - q, n)
    j = torch.arange(n)
    g = h // kv
    keys_n = _rotate(rope, keys, j).repeat_interleave(g, 0)
    keys_g = _rotate(rope, keys, j // group).repeat_interleave(g, 0)
    query_n = _rotate(rope, query, i)
    query_g = _rotate(rope, query, i // group + window - window // group)
    neighbour = query_n @ keys_n.transpose(1, 2) * scaling
    grouped = query_g @ keys_g.transpose(1, 2) * scaling
    distance = i[:, None] - j[None, :]
    scores = torch.where(distance < window, neighbour, grouped).masked_fill(distance < 0, float("-inf"))
    return scores.softmax(-1) @ values.repeat_interleave(g, 0)


@pytest.fixture(scope="module")
def rope():
    return Rope(rotary_embedding(build_llama()))


@pytest.mark.parametrize("group, window, q, n", [
    (4, 8, 40, 40),  # one forward of the whole input
    (4, 8, 13, 61),  # a chunk mid-way: queries see grouped cached keys and their own
    (3, 5, 1, 50),  # one decoding step
    (2, 16, 7, 20),  # the window reaches past the chunk's start
    (5, 1, 9, 30),  # W = 1: only the token itself is a neighbour
    (1, 6, 11, 45),  # G = 1: plain relative positions
    (4, 64, 10, 30),  # the window covers everything
])
@pytest.mark.parametrize("backend", ["explicit", "cpu"])
def test_attention_is_the_papers_merged_maps(rope, group, window, q, n, backend):
    torch.manual_seed(0)
    query, keys, values = torch.randn(4, q, 16), torch.randn(2, n, 16), torch.randn(2, n, 16)
    got = self_extend_attention(query, keys, values, 0.25, torch.arange(n), group, window, rope, n - 1, backend)
    want = papers_attention(rope, query, keys, values, 0.25, group, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_the_cpu_kernel_serves_cpu_forwards_and_grouped_keys_go_in_blocks(rope, monkeypatch):
    from kvpot.methods.selfextend import attention

    assert attention.pick_backend(torch.zeros(1, 1, 16)) == "cpu"
    monkeypatch.setattr(attention, "KEY_BLOCK", 7)  # several blocks of grouped keys, merged by their lse
    torch.manual_seed(4)
    query, keys, values = torch.randn(4, 9, 16), torch.randn(2, 60, 16), torch.randn(2, 60, 16)
    got = self_extend_attention(query, keys, values, 0.25, torch.arange(60), 3, 6, rope, 59, "cpu")
    torch.testing.assert_close(got, papers_attention(rope, query, keys, values, 0.25, 3, 6), atol=2e-5, rtol=1e-4)


def test_each_key_gets_the_papers_relative_position(rope):
    """Key j's probability for the query at i is that of the query rotated at the pair's relative position
    (i - j within the window, floor(i/G) - floor(j/G) + W - floor(W/G) beyond) and the key at 0."""
    torch.manual_seed(1)
    group, window, n = 3, 4, 16
    i = n - 1
    query, keys = torch.randn(1, 1, 16), torch.randn(1, n, 16)
    values = torch.eye(n).unsqueeze(0)  # output lane j = key j's probability
    probs = self_extend_attention(query, keys, values, 1.0, torch.arange(n), group, window, rope, i)[0, 0]
    relative = [i - j if i - j < window else i // group - j // group + window - window // group for j in range(n)]
    logits = torch.stack([(_rotate(rope, query[0], torch.tensor([relative[j]]))
                           * _rotate(rope, keys[0, j : j + 1], torch.tensor([0]))).sum() for j in range(n)])
    torch.testing.assert_close(probs, logits.softmax(0), atol=1e-5, rtol=1e-4)


def test_decode_positions_renumber_the_window_around_the_grouped_query():
    policy = SelfExtendPositions()
    policy.configure(group=2, window=3)
    positions = torch.arange(12).view(1, 1, 12).expand(1, 2, 12).clone()
    rope_positions = positions // 2
    query = torch.zeros(1, dtype=torch.long)
    policy.decode_positions(positions, rope_positions, query, None, torch.tensor([9]))
    p = 9 // 2 + 3 - 3 // 2  # 6
    assert int(query) == p
    expected = [k // 2 for k in range(7)] + [p - 2, p - 1, p] + [5, 5]  # entries past 9 are not touched
    assert rope_positions[0, 0].tolist() == expected == rope_positions[0, 1].tolist()
    for k in range(10):  # the relative position each key gets is the paper's
        rel = 9 - k if 9 - k < 3 else 9 // 2 - k // 2 + 3 - 3 // 2
        assert p - expected[k] == rel
    # before the window fills, the query sits at its own position and every key at its own
    policy.decode_positions(positions, rope_positions, query, None, torch.tensor([1]))
    assert int(query) == 1 and rope_positions[0, 0, :2].tolist() == [0, 1]


def test_group_one_equals_generate_with_any_window(arch):
    model = build(arch)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (70,))
    expected = reference_greedy(model, ids, NEW)
    for method in (kvpot.SelfExtend(group_size=1, window=200, chunk_size=16),  # every key a neighbour
                   kvpot.SelfExtend(group_size=1, window=5, chunk_size=9)):  # grouped, but at G = 1
        for decode in ("eager", "static"):
            out = kvpot.Engine(model, method=method, decode=decode, runner="sequence").generate_ids(ids, max_new_tokens=NEW)
            assert out.token_ids == expected, (method, decode)
            assert out.stats.compressions == 0 and out.stats.max_kv_entries == 70 + NEW - 1


def test_grouped_positions_change_the_model_and_decode_the_same_in_fixed_shapes():
    model = build_llama(max_position_embeddings=64)
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (150,))
    method = kvpot.SelfExtend(group_size=4, window=8, chunk_size=32)
    eager = kvpot.Engine(model, method=method, decode="eager").generate_ids(ids, max_new_tokens=NEW)
    static = kvpot.Engine(model, method=method, decode="static", runner="sequence").generate_ids(ids, max_new_tokens=NEW)
    assert static.token_ids == eager.token_ids
    assert static.stats.decode["static_steps"] == NEW - 1  # the decode kernel's path, every step
    full = kvpot.Engine(model, method=kvpot.Full(chunk_size=32)).prefill_ids(ids)
    grouped = kvpot.Engine(model, method=method).prefill_ids(ids)
    assert not torch.allclose(full.last_logits, grouped.last_logits, atol=1e-3)
    assert eager.stats.method["largest_relative_position"] == (150 + NEW - 2) // 4 + 8 - 2


def test_chunking_changes_nothing_and_every_entry_is_kept_at_every_step():
    model = build("llama3")
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (90,))
    logits = []
    for chunk in (90, 16, 11):
        engine = kvpot.Engine(model, method=kvpot.SelfExtend(group_size=3, window=10, chunk_size=chunk))
        state = engine.prefill_ids(ids)
        logits.append(state.last_logits)
        cache, seen = state.cache, []
        out = engine.generate_ids(state=state, max_new_tokens=NEW, ignore_eos=True, keep_state=False,
                                  on_token=lambda _t: seen.append(cache.lengths()))
        # at every step every layer holds every entry so far: nothing is ever evicted
        assert seen == [[90 + t] * len(cache.layers) for t in range(NEW)]
        assert out.stats.max_kv_entries == 90 + NEW - 1 and out.stats.compressions == 0
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[2], logits[0], atol=1e-4, rtol=1e-4)


def test_default_window_follows_the_seed_and_short_windows(caplog):
    method = kvpot.SelfExtend()
    assert (method.group_size, method.resolved_window(8192), method.resolved_window(131072)) == (4, 2048, 2048)
    assert method.resolved_window(2048) == 512 and method.resolved_window(None) == 2048
    assert kvpot.SelfExtend(window=100).resolved_window(2048) == 100
    model = build_llama(max_position_embeddings=64)
    ids = torch.randint(3, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.WARNING, logger="kvpot"):
        kvpot.Engine(model, method=kvpot.SelfExtend(group_size=2, window=16)).prefill_ids(ids)
    assert "past the model's trained window" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    ({"group_size": 0}, "group_size must be a positive integer"),
    ({"window": -3}, "window must be a positive integer"),
    ({"chunk_size": 0}, "chunk_size must be a positive integer"),
])
def test_bad_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(KvpotError, match=message):
        kvpot.SelfExtend(**kwargs)


def test_cli_names_and_parameters():
    method = make_method("selfextend", group_size="8", window="1024")
    assert (method.group_size, method.window) == (8, 1024)
    assert make_method("selfextend", window="none").window is None
    with pytest.raises(KvpotError, match="takes no budget"):
        make_method("selfextend", budget=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_path_matches_the_explicit_one_on_cuda(dtype):
    """cuDNN prefix + square causal (grouped) and FlashAttention's sliding window (neighbour) against the
    explicit float32 path, on shapes where a chunk starts mid-way and the grouped keys span several blocks."""
    from kvpot.methods.selfextend import attention

    rope = Rope(rotary_embedding(build_llama(head_dim=128, hidden_size=256, num_attention_heads=2,
                                             num_key_value_heads=1).cuda()))
    assert attention.pick_backend(torch.zeros(1, 1, 128, device="cuda", dtype=dtype)) == "cuda"
    torch.manual_seed(0)
    block = attention.KEY_BLOCK
    attention.KEY_BLOCK = 256  # several grouped blocks on a small input
    try:
        for q, n, group, window in ((512, 3000, 4, 300), (1000, 1000, 2, 64), (1, 2500, 8, 512), (300, 700, 3, 1000)):
            query = torch.randn(8, q, 128, device="cuda", dtype=dtype)
            keys = torch.randn(2, n, 128, device="cuda", dtype=dtype)
            values = torch.randn(2, n, 128, device="cuda", dtype=dtype)
            args = (query, keys, values, 128**-0.5, torch.arange(n, device="cuda"), group, window, rope, n - 1)
            fused = attention.self_extend_attention(*args, backend="cuda")
            explicit = attention.self_extend_attention(*args, backend="explicit")
            torch.testing.assert_close(fused.float(), explicit.float(), atol=2e-2, rtol=2e-2)
    finally:
        attention.KEY_BLOCK = block


@pytest.mark.gpu
def test_graph_decoding_equals_eager_decoding_on_cuda():
    model = build_llama(max_position_embeddings=64).cuda()
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (300,)).cuda()
    method = kvpot.SelfExtend(group_size=4, window=8, chunk_size=64)
    eager = kvpot.Engine(model, method=method, decode="eager").generate_ids(ids, max_new_tokens=NEW)
    graph = kvpot.Engine(model, method=method, decode="graph", runner="sequence").generate_ids(ids, max_new_tokens=NEW)
    assert graph.token_ids == eager.token_ids
    assert graph.stats.decode["replays"] > 0 and graph.stats.decode["eager_steps"] == 0
