"""Scissorhands: the low-importance counter over the history window, the drop, the bound at every step."""

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.errors import KvpotError
from kvpot.methods.base import DECODE_STEP, Step, top_indices
from kvpot.methods.scissorhands import LOW, Scissorhands

# two decoding queries over 8 entries; the uniform share is 1/8 = 0.125
FIRST = [0.30, 0.10, 0.20, 0.05, 0.12, 0.13, 0.05, 0.00]
SECOND = [0.30, 0.20, 0.10, 0.05, 0.10, 0.10, 0.10, 0.05]
LOWS = [0, 1, 1, 2, 2, 1, 2, 2]  # how many of the two gave each entry less than 1/8


@pytest.fixture(scope="module")
def model():
    return build("llama3")


def prefilled(model, n: int):
    """A cache of 2 layers x 2 KV heads holding `n` entries at positions 0..n-1, no method scores yet."""
    return kvpot.Engine(model, method=kvpot.Full()).prefill_ids(torch.arange(3, 3 + n)).cache


def observe(layer, probs) -> None:
    layer.observation = torch.tensor(probs, dtype=torch.float32).view(1, 1, -1).expand(1, 2, -1).clone()


def test_the_counter_counts_low_scores_and_the_fullest_entries_go(model):
    layer = prefilled(model, 8).layers[0]
    method = Scissorhands(budget=8, drop=3, history=2, recent=2, chunk_size=4)
    for probs in (FIRST, SECOND):
        observe(layer, probs)
        method.update_scores(layer, DECODE_STEP)
    assert layer.score(LOW)[0, 0].tolist() == LOWS
    # drop 3 of the 8: entries 3 and 4 (two lows) and, of 1, 2 and 5 (one low each), the oldest;
    # 6 and 7 have two lows but are the recent window
    assert method.keep_count(layer, DECODE_STEP) == 5
    assert top_indices(method.scores(layer, DECODE_STEP), 5)[0, 0].tolist() == [0, 2, 5, 6, 7]


def test_queries_before_the_window_are_not_counted(model):
    layer = prefilled(model, 8).layers[0]
    observe(layer, FIRST)
    Scissorhands(budget=16, drop=8, history=4, recent=2).update_scores(layer, DECODE_STEP)  # 12 tokens before it is full
    assert torch.all(layer.score(LOW) == 0)


def test_a_chunk_counts_its_window_queries_that_saw_each_entry(model):
    layer = prefilled(model, 8).layers[0]
    seen = torch.tensor([2.0, 2, 2, 2, 2, 2, 2, 1])  # of the chunk's last 2 queries (the window): causal
    mean = torch.tensor([0.3, 0.1, 0.2, 0.05, 0.2, 0.1, 0.3, 0.1])
    observe(layer, (mean * seen).tolist())
    Scissorhands(budget=8, drop=3, history=2, recent=2, chunk_size=4).update_scores(layer, Step("context", 4))
    assert layer.score(LOW)[0, 0].tolist() == [0, 2, 0, 2, 0, 2, 0, 1]


def test_a_full_cache_drops_and_the_counters_restart(model):
    cache = prefilled(model, 8)
    method = Scissorhands(budget=8, drop=3, history=2, recent=2, chunk_size=4)
    for layer in cache.layers:
        observe(layer, FIRST)  # lows [0, 1, 0, 1, 1, 0, 1, 1]: 1, 3 and 4 go (6 and 7 are recent)
    assert method.after_forward(cache, DECODE_STEP)  # full at 8: compressed
    assert cache.lengths() == [5, 5]
    assert all(layer.positions[0, h, :5].tolist() == [0, 2, 5, 6, 7] for layer in cache.layers for h in (0, 1))
    assert all(torch.all(layer.score(LOW) == 0) for layer in cache.layers)  # the next window starts empty
    for layer in cache.layers:
        observe(layer, FIRST[:5])
    assert not method.after_forward(cache, DECODE_STEP)  # 5 entries: not full, nothing dropped


def test_the_bound_holds_at_every_step_and_decoding_never_exceeds_the_budget(model, one_thread):
    torch.manual_seed(0)
    context, question = torch.randint(3, VOCAB, (200,)), torch.randint(3, VOCAB, (6,))
    token_by_token = Scissorhands(budget=48, drop=16, history=12, chunk_size=1)  # the paper's setting
    out = kvpot.Engine(model, method=token_by_token).generate_ids(context, question, max_new_tokens=40,
                                                                  ignore_eos=True)
    assert out.stats.max_kv_entries == 48 == token_by_token.max_entries()
    chunked = Scissorhands(budget=48, drop=16, history=12, chunk_size=16)
    engine = kvpot.Engine(model, method=chunked, decode="static", runner="sequence")
    state = engine.prefill_ids(context)
    assert state.stats.max_kv_entries <= chunked.max_entries() == 63
    assert 32 <= min(state.cache.lengths()) <= 47  # between forwards: below the budget
    out = engine.generate_ids(question_ids=question, state=state, max_new_tokens=40, ignore_eos=True)
    assert out.stats.max_kv_entries <= 63 and 33 <= out.stats.final_kv_entries <= 47
    # the decoding steps that fill the cache compress it (eager); the others only append
    assert out.stats.decode["eager_steps"] >= 2 and out.stats.decode["static_steps"] > 30


def test_from_budget_shortens_the_window_to_the_drop():
    assert Scissorhands.from_budget(2048).history == 400 and Scissorhands().drop_count() == 410
    small = Scissorhands.from_budget(512)
    assert small.drop_count() == 205 and small.history == 205


@pytest.mark.parametrize("kwargs, fragment", [(dict(history=500), "must not exceed the drop"),
                                              (dict(budget=16, drop=16), "cannot drop"),
                                              (dict(budget=16, drop=8, history=8, recent=9), "cannot drop"),
                                              (dict(positions="reset"), "positions")])
def test_bad_parameters_are_refused(kwargs, fragment):
    with pytest.raises(KvpotError, match=fragment):
        Scissorhands(**kwargs)
