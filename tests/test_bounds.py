"""Guarantee 1: with a context 8x the budget, no layer ever exceeds the method's stated bound."""

import pytest
import torch

import kvpot
from conftest import VOCAB, build

BUDGET, CHUNK, NEW = 64, 16, 256
CONTEXT = 8 * BUDGET


@pytest.fixture(scope="module")
def model():
    return build("llama3")


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(0)
    return torch.randint(3, VOCAB, (CONTEXT,)), torch.randint(3, VOCAB, (6,))


def run(model, method, ids, question=True):
    context, q = ids
    engine = kvpot.Engine(model, method=method)
    state = engine.prefill_ids(context)
    prefill_max = state.stats.max_kv_entries
    out = engine.generate_ids(question_ids=q if question else None, state=state, max_new_tokens=NEW, ignore_eos=True)
    return prefill_max, out


@pytest.mark.parametrize(
    "method",
    [
        kvpot.StreamingLLM(sinks=4, window=BUDGET - 4, chunk_size=CHUNK),
        kvpot.StreamingLLM(sinks=0, window=BUDGET, chunk_size=1),
        kvpot.H2O(heavy=BUDGET // 2, recent=BUDGET // 2, chunk_size=CHUNK),
        kvpot.TOVA(budget=BUDGET, chunk_size=CHUNK),
        kvpot.RoCo(budget=BUDGET, chunk_size=CHUNK),
        kvpot.CaM(start=4, recent=BUDGET - 4, chunk_size=CHUNK, merge_budget=8),
    ],
    ids=lambda m: f"{m.name}-chunk{m.chunk_size}",
)
def test_streaming_methods_hold_their_bound_in_prefill_and_decoding(model, ids, method):
    prefill_max, out = run(model, method, ids)
    bound = method.max_entries()
    assert prefill_max <= bound
    assert out.stats.max_kv_entries <= bound
    assert out.stats.new_tokens == NEW
    # between forwards the cache is back at its budget
    assert out.stats.final_kv_entries == bound - method.chunk_size
    assert out.stats.compressions > CONTEXT // CHUNK // 2


def test_snapkv_prefill_is_unbounded_then_compresses_to_budget(model, ids):
    method = kvpot.SnapKV(budget=BUDGET, window=8, chunk_size=CHUNK)
    prefill_max, out = run(model, method, ids, question=False)
    assert prefill_max == CONTEXT  # memory-unconstrained prefill, as in the paper
    # compressed to `budget` at the end of the prompt; decoding then appends one entry per token
    assert out.stats.final_kv_entries == BUDGET + NEW - 1


def test_truncate_bound_is_budget_plus_question_plus_new_tokens(model, ids):
    method = kvpot.Truncate(budget=BUDGET, chunk_size=CHUNK)
    context, question = ids
    out = kvpot.Engine(model, method=method).generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    assert out.stats.context_tokens == BUDGET
    assert out.stats.max_kv_entries <= BUDGET + question.numel() + NEW


def test_truncate_keeps_first_and_last_halves():
    context = torch.arange(100)
    kept, _ = kvpot.Truncate(budget=10).prepare(context, torch.arange(3))
    assert kept.tolist() == [0, 1, 2, 3, 4, 95, 96, 97, 98, 99]


def test_h2o_keeps_recent_window_and_heaviest_entries():
    """On a hand-built score, H2O keeps the recent window plus the top accumulated entries."""
    from kvpot.methods.h2o import SCORE

    model = build("llama3")
    method = kvpot.H2O(heavy=3, recent=2, chunk_size=4)
    engine = kvpot.Engine(model, method=method)
    state = engine.prefill_ids(torch.randint(3, VOCAB, (5,)))  # 5 entries: no eviction yet
    layer = state.cache.layers[0]
    layer.score(SCORE)[:] = torch.tensor([5.0, 1.0, 4.0, 0.0, 9.0]).view(1, 1, 5)
    chosen = method.scores(layer, None).topk(5, dim=-1).indices.sort(dim=-1).values
    # recent = entries 3 and 4; heavy = 0 and 2 (scores 5 and 4) and then 1
    assert chosen[0, 0].tolist() == [0, 1, 2, 3, 4]
    method2 = kvpot.H2O(heavy=2, recent=2, chunk_size=4)
    chosen = method2.scores(layer, None).topk(4, dim=-1).indices.sort(dim=-1).values
    assert chosen[0, 0].tolist() == [0, 2, 3, 4]
