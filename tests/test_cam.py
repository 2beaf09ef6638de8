"""CaM: start + recent cache whose evicted values merge into the next kept ones (Algorithm 1, in expectation)."""

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.errors import KvpotError
from kvpot.methods.base import Step
from kvpot.methods.cam import SCORE, merge_probability


@pytest.fixture(scope="module")
def model():
    return build("llama3")


def test_merge_probability_is_clamped_ratio_with_the_release_guards():
    evicted = torch.tensor([[[1.0, 6.0, 0.0, 3.0]]])
    targets = torch.tensor([[[2.0, 2.0]]])
    assert merge_probability(evicted, targets).tolist() == [[[0.5, 1.0, 0.0, 1.0]]]
    zero = torch.zeros(1, 1, 2)
    assert merge_probability(torch.tensor([[[0.0, 2.0]]]), zero).tolist() == [[[0.0, 1.0]]]  # 0/0 -> 0, x/0 -> 1


def test_evicted_values_merge_into_the_next_kept_entries_by_their_probability(model):
    """start=2, recent=4, m=2: entries 2 and 3 leave; p * V / m of each lands on entries 4 and 5, per head."""
    method = kvpot.CaM(start=2, recent=4, merge_budget=2, chunk_size=8, positions="absolute")
    cache = kvpot.Engine(model, method=method).prefill_ids(torch.randint(3, VOCAB, (8,))).cache
    layer = cache.layers[0]
    assert layer.n == 6  # 8 read, 2 evicted: the merge is re-done below on hand-set values
    layer.n = 8
    layer.positions[0, :, :8] = torch.arange(8)
    values = torch.arange(1.0, 9.0).view(1, 1, 8, 1).expand(1, layer.kv_heads, 8, layer.values.shape[-1]).clone()
    layer.values[:, :, :8] = values
    keys = layer.keys[:, :, :8].clone()
    # head 0: A = (.., 1, 6 | 2, 2, ..) -> p = 0.5 and 1; head 1: targets never attended, evicted never either -> 0
    accumulated = torch.tensor([[9.0, 9.0, 1.0, 6.0, 2.0, 2.0, 0.0, 0.0], [9.0, 9.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]])
    layer.score(SCORE)[0] = accumulated
    layer.observation = torch.zeros(1, layer.kv_heads, 8)
    cache.layers[1].observation = torch.zeros(1, layer.kv_heads, cache.layers[1].n)  # at its budget: no eviction
    assert method.after_forward(cache, Step("context", 2))
    assert layer.n == 6 and layer.positions[0, :, :6].tolist() == [[0, 1, 4, 5, 6, 7]] * layer.kv_heads
    merged = (0.5 * 3.0 + 1.0 * 4.0) / 2  # sum of p_i * V_i over the evicted, / m
    assert layer.values[0, 0, :6, 0].tolist() == [1.0, 2.0, 5.0 + merged, 6.0 + merged, 7.0, 8.0]
    assert layer.values[0, 1, :6, 0].tolist() == [1.0, 2.0, 5.0, 6.0, 7.0, 8.0]  # p = 0: plain eviction
    assert torch.equal(layer.keys[:, :, :6], keys[:, :, [0, 1, 4, 5, 6, 7]])  # keys are never merged


def test_merge_off_is_streaming_llm_and_merging_changes_only_the_window_front(model, one_thread):
    torch.manual_seed(2)
    context, question = torch.randint(3, VOCAB, (16 * 20,)), torch.randint(3, VOCAB, (6,))
    plain = kvpot.CaM(start=8, recent=40, chunk_size=16, merge_budget=8, merge=False)
    streaming = kvpot.StreamingLLM(sinks=8, window=40, chunk_size=16)
    a = kvpot.Engine(model, method=plain).generate_ids(context, question, max_new_tokens=30, ignore_eos=True)
    b = kvpot.Engine(model, method=streaming).generate_ids(context, question, max_new_tokens=30, ignore_eos=True)
    assert a.token_ids == b.token_ids and a.stats.compressions == b.stats.compressions
    merging = kvpot.CaM(start=8, recent=40, chunk_size=16, merge_budget=8)
    cam = kvpot.Engine(model, method=merging).prefill_ids(context).cache
    ref = kvpot.Engine(model, method=plain).prefill_ids(context).cache
    # the first layer reads the same tokens either way (later ones see the merged values' outputs)
    mine, theirs = cam.layers[0], ref.layers[0]
    assert mine.n == theirs.n == 48 and torch.equal(mine.keys[:, :, :48], theirs.keys[:, :, :48])
    front = slice(8, 16)  # the last forward's merge targets: the first m of the recent window
    assert not torch.equal(mine.values[:, :, front], theirs.values[:, :, front])
    assert torch.equal(mine.values[:, :, :8], theirs.values[:, :, :8])
    assert torch.equal(mine.values[:, :, 16:48], theirs.values[:, :, 16:48])


def test_configuration_and_budget():
    method = kvpot.make_method("cam", budget=100)
    assert (method.start, method.recent) == (50, 50)  # the release's start_ratio = recent_ratio
    assert method.max_entries() == 100 + method.chunk_size
    assert kvpot.make_method("cam", budget=64, start="4").recent == 60
    with pytest.raises(KvpotError, match="budget of 4"):
        kvpot.make_method("cam", budget=4, start="4")
    with pytest.raises(KvpotError, match="recent"):
        kvpot.CaM(recent=0)
    with pytest.raises(KvpotError, match="positions"):
        kvpot.CaM(positions="reset")
