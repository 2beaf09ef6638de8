"""PyramidKV: per-layer budgets that sum to the total and shrink with depth, SnapKV's selection in each."""

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.errors import KvpotError
from kvpot.methods.pyramidkv import BUDGETS, PyramidKV, pyramid_budgets

LAYERS, CONTEXT, NEW = 4, 200, 12


@pytest.fixture(scope="module")
def model():
    return build("llama3", num_hidden_layers=LAYERS)


def test_budgets_form_a_pyramid_that_sums_to_the_total():
    budgets = pyramid_budgets(32, 1024, 32, 20, prompt=128_000)
    assert sum(budgets) == 32 * 1024
    assert all(a >= b for a, b in zip(budgets, budgets[1:])) and budgets[0] > 1900 > 90 > budgets[-1]
    # an arithmetic sequence: the top layer keeps the window + (budget - window) / beta, the bottom twice
    # the average less that
    assert budgets[-1] == round(32 + 992 / 20) and budgets[0] == round(32 + 2 * 992 - 992 / 20)
    steps = {a - b for a, b in zip(budgets, budgets[1:])}
    assert steps <= {60, 61, 62}


def test_a_short_prompt_flattens_the_pyramid_and_a_small_budget_is_uniform():
    flat = pyramid_budgets(4, 1024, 32, 20, prompt=1100)
    assert flat[0] == 1100 and sum(flat) == 4 * 1024  # the bottom layer keeps the whole prompt
    assert pyramid_budgets(4, 256, 32, 20, prompt=10_000) == [256] * 4  # (256 - 32) / 20 < 32: SnapKV's
    assert pyramid_budgets(1, 1024, 32, 20, prompt=10_000) == [1024]


def test_each_layer_keeps_its_budget_by_snapkv_selection(model, one_thread):
    torch.manual_seed(0)
    context = torch.randint(3, VOCAB, (CONTEXT,))
    method = PyramidKV(budget=48, window=8, beta=2, chunk_size=64)
    engine = kvpot.Engine(model, method=method)
    state = engine.prefill_ids(context)
    budgets = state.cache.method_state[BUDGETS]
    assert budgets == pyramid_budgets(LAYERS, 48, 8, 2, CONTEXT) and sum(budgets) == LAYERS * 48
    assert state.cache.lengths() == budgets and budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert state.stats.max_kv_entries == CONTEXT  # prefill is memory-unconstrained, as SnapKV's
    for index, size in enumerate(budgets):  # the same entries as SnapKV keeping that many in that layer
        snap = kvpot.Engine(model, method=kvpot.SnapKV(budget=size, window=8, chunk_size=64)).prefill_ids(context)
        assert torch.equal(snap.cache.layers[index].positions[..., :size],
                           state.cache.layers[index].positions[..., :size])
    out = engine.generate_ids(question_ids=[5, 6, 7], state=state, max_new_tokens=NEW, ignore_eos=True)
    # the question was a second prompt: each layer back at its budget, then one entry per generated token
    assert out.stats.final_kv_entries == budgets[0] + NEW - 1


def test_bad_beta_is_refused():
    with pytest.raises(KvpotError, match="beta must be"):
        PyramidKV(beta=0)
    with pytest.raises(KvpotError, match="observation window"):
        PyramidKV(budget=16)
