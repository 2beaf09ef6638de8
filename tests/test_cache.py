"""PotCache: probes roll back bit-exactly, per-head selection, growth, clones are independent."""

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.attention import AttentionRequest


def snapshot(cache):
    return [
        (layer.n, layer.keys[:, :, : layer.n].clone(), layer.values[:, :, : layer.n].clone(),
         layer.positions[:, :, : layer.n].clone(), layer.rope_positions[:, :, : layer.n].clone(),
         {k: v[:, :, : layer.n].clone() for k, v in layer.scores.items()})
        for layer in cache.layers
    ]


def assert_same(before, after):
    for (n, k, v, p, r, s), (n2, k2, v2, p2, r2, s2) in zip(before, after):
        assert n == n2
        assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(p, p2) and torch.equal(r, r2)
        assert s.keys() == s2.keys() and all(torch.equal(s[key], s2[key]) for key in s)


@pytest.mark.parametrize("method", [kvpot.Full(chunk_size=8), kvpot.H2O(heavy=8, recent=8, chunk_size=8)],
                         ids=lambda m: m.name)
def test_probe_rolls_back_exactly_and_reports_attention_over_prior_entries(method):
    model = build("qwen3")
    engine = kvpot.Engine(model, method=method)
    torch.manual_seed(0)
    state = engine.prefill_ids(torch.randint(3, VOCAB, (40,)))
    before = snapshot(state.cache)
    lengths = state.cache.lengths()
    probe_ids = torch.randint(3, VOCAB, (5,))
    obs = engine.probe(state.cache, state.next_position, probe_ids, AttentionRequest(row_reduce="sum"))
    assert_same(before, snapshot(state.cache))
    for o, n in zip(obs, lengths):
        assert o.shape == (1, 2, n)
        # each probe row spreads probability 1 over prior entries + probe entries: <= 5 in total
        assert torch.all(o.sum(-1) <= 5 + 1e-4) and torch.all(o >= 0)
    # the probe leaves generation unchanged
    a = engine.generate_ids(question_ids=[5, 6], state=state, max_new_tokens=8)
    engine.probe(state.cache, state.next_position, probe_ids, AttentionRequest())
    b = engine.generate_ids(question_ids=[5, 6], state=state, max_new_tokens=8)
    assert a.token_ids == b.token_ids


def test_select_is_per_kv_head_and_carries_positions_and_scores():
    model = build("llama3")
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=4))
    state = engine.prefill_ids(torch.arange(3, 13))  # 10 entries, absolute positions 0..9
    layer = state.cache.layers[1]
    layer.score("demo")[:] = torch.arange(10.0).view(1, 1, 10)
    keys = layer.keys[:, :, :10].clone()
    keep = torch.tensor([[[0, 3, 7], [1, 2, 9]]])  # different tokens per KV head
    layer.select(keep)
    assert layer.n == 3
    assert layer.positions[0, :, :3].tolist() == [[0, 3, 7], [1, 2, 9]]
    assert layer.score("demo")[0].tolist() == [[0.0, 3.0, 7.0], [1.0, 2.0, 9.0]]
    assert torch.equal(layer.keys[0, 0, :3], keys[0, 0, [0, 3, 7]])
    assert torch.equal(layer.keys[0, 1, :3], keys[0, 1, [1, 2, 9]])


def test_buffers_grow_and_clones_are_independent():
    model = build("mistral")
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=16))
    state = engine.prefill_ids(torch.randint(3, VOCAB, (50,)))
    twin = state.cache.clone()
    twin.layers[0].keys.zero_()
    twin.layers[0].select(torch.tensor([[[0, 1]]]))
    assert state.cache.layers[0].n == 50 and state.cache.layers[0].keys[:, :, :50].abs().sum() > 0
    layer = state.cache.layers[0]
    capacity = layer.capacity
    layer.reserve(capacity + 1)
    assert layer.capacity >= capacity + 1 and layer.n == 50


def test_max_entries_counts_probe_entries():
    model = build("llama3")
    engine = kvpot.Engine(model, method=kvpot.Full())
    state = engine.prefill_ids(torch.arange(3, 23))
    engine.probe(state.cache, state.next_position, torch.arange(3, 10), AttentionRequest())
    assert state.cache.max_entries == 20 + 7


def test_cpu_rotates_only_new_or_moved_keys_and_matches_a_full_rotation():
    """On a CPU the cache keeps its keys rotated: a decoding step rotates the one new key per layer
    (not the whole cache), and what attention reads equals rotating every key afresh, also after
    evictions that move entries and probe rollbacks."""
    import kvpot
    from conftest import VOCAB, build

    torch.manual_seed(3)
    model = build("llama3")
    engine = kvpot.Engine(model, method=kvpot.InfiniPot(pot_size=64, catalyst="generic"), decode="eager")
    engine.tokenizer = None
    engine.method = kvpot.StreamingLLM(sinks=4, window=40, chunk_size=8)  # evicts, moving entries
    state = engine.prefill_ids(torch.randint(3, VOCAB, (120,)))
    for layer in state.cache.layers:
        fresh = layer.cache.rope.rotate(layer.keys[:, :, : layer.n], layer.rope_positions[:, :, : layer.n],
                                        layer.max_rope)
        assert torch.equal(layer.attention_keys(), fresh)

    engine.method = kvpot.InfiniPot(pot_size=64, catalyst=None)  # between distillations: append only
    state = engine.prefill_ids(torch.randint(3, VOCAB, (40,)))
    rope, kv = state.cache.rope, model.config.num_key_value_heads
    rotated = []
    original = rope.rotate

    def counting(x, positions, max_position):
        if x.shape[1] == kv:  # keys (queries carry every query head)
            rotated.append(x.shape[2])
        return original(x, positions, max_position)

    rope.rotate = counting
    try:
        engine.generate_ids(state=state, max_new_tokens=6, ignore_eos=True, keep_state=False)
    finally:
        rope.rotate = original
    assert rotated and all(n == 1 for n in rotated)  # one new key per layer and step


@pytest.mark.parametrize("method", ["full", "streaming", "infinipot:catalyst=question", "citrus", "citrus:cache=individual",
                                    "d2o"])
def test_a_dropped_state_frees_its_cache_without_the_garbage_collector(method):
    """Layers refer to their cache weakly (and linked caches to each other), so the buffers of a
    state nobody holds go at once: a server or a benchmark repeating prefills of a 128K context
    would otherwise hold one extra cache (16 GiB for an 8B model) until the next collection."""
    import gc
    import weakref

    from kvpot.methods.spec import build_method

    model = build("llama3")
    engine = kvpot.Engine(model, method=build_method(method), chat_template=False)
    state = engine.prefill_ids(torch.randint(0, VOCAB, (300,)), torch.randint(0, VOCAB, (5,)))
    ref = weakref.ref(state.cache)
    gc.disable()
    try:
        del state
        assert ref() is None
    finally:
        gc.enable()
