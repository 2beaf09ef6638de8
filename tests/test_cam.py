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


def test_a_replacing_step_merges_into_the_entries_after_the_evicted_one_by_stream_position(model):
    """Decoding at the budget, entries in a ring's places (start=2, recent=5, m=3): the oldest entry after
    the start (stream position 10, at place 4) leaves, its value merged into positions 11, 12, 13 (places 5,
    6, 2), wherever they sit; the newest entry (15) takes its slot. The same as the top-k path in stream order."""
    method = kvpot.CaM(start=2, recent=5, merge_budget=3, chunk_size=8, positions="absolute")
    cache = kvpot.Engine(model, method=method).prefill_ids(torch.randint(3, VOCAB, (8,))).cache
    layer = cache.layers[0]
    layer.n = 8
    stream = torch.tensor([0, 1, 13, 14, 10, 11, 12, 15])  # places -> stream positions
    layer.positions[0, :, :8] = stream
    values = torch.arange(1.0, 9.0).view(1, 1, 8, 1).expand(1, layer.kv_heads, 8, layer.values.shape[-1]).clone()
    layer.values[:, :, :8] = values
    keys = layer.keys[:, :, :8].clone()
    # head 0: A(10) = 1, A(11..13) = 2, 2, 2 -> p = 0.5; head 1: A(10) = 0 -> p = 0
    layer.score(SCORE)[0] = torch.tensor([[9.0, 9.0, 2.0, 7.0, 1.0, 2.0, 2.0, 0.0],
                                          [9.0, 9.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    order = stream.argsort()
    twin = cache.clone()
    ordered = twin.layers[0]  # the same entries in stream order, for the top-k path
    for buf in (ordered.keys, ordered.values):
        buf[:, :, :8] = buf[:, :, :8][:, :, order]
    ordered.positions[:, :, :8] = ordered.positions[:, :, :8][:, :, order]
    ordered.scores[SCORE][:, :, :8] = ordered.scores[SCORE][:, :, :8][:, :, order]
    method.replace(layer)
    assert layer.n == 7 and layer.positions[0, 0, :7].tolist() == [0, 1, 13, 14, 15, 11, 12]
    share = 0.5 * 5.0 / 3  # p * V(10) / m, on head 0 only
    torch.testing.assert_close(layer.values[0, 0, :7, 0],
                               torch.tensor([1.0, 2.0, 3.0 + share, 4.0, 8.0, 6.0 + share, 7.0 + share]))
    assert layer.values[0, 1, :7, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 8.0, 6.0, 7.0]
    assert torch.equal(layer.keys[:, :, :7], keys[:, :, [0, 1, 2, 3, 7, 5, 6]])  # keys are never merged
    assert layer.scores[SCORE][0, 0, 4] == 0.0  # the newest entry's score moved with it
    ordered.observation = torch.zeros(1, layer.kv_heads, 8)
    for other in twin.layers[1:]:
        other.observation = torch.zeros(1, layer.kv_heads, other.n)
    method.after_forward(twin, Step("context", 1))  # not a fixed-shape step: the top-k path
    back = layer.positions[0, 0, :7].argsort()
    assert torch.equal(ordered.positions[:, :, :7], layer.positions[:, :, :7][:, :, back])
    assert torch.equal(ordered.values[:, :, :7], layer.values[:, :, :7][:, :, back])
