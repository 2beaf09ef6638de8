"""RoCo: mean and standard deviation of received attention, the eviction scope, the bound."""

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.errors import KvpotError
from kvpot.methods import replace
from kvpot.methods.base import DECODE_STEP, Step, protect, top_indices
from kvpot.methods.roco import COUNT, SQUARES, SUM, RoCo, rows_seen, statistics


@pytest.fixture(scope="module")
def model():
    return build("llama3")


def layer_of(model, n: int):
    """A real layer (2 KV heads) holding `n` entries, no method scores yet."""
    return kvpot.Engine(model, method=kvpot.Full()).prefill_ids(torch.arange(3, 3 + n)).cache.layers[0]


def observe(layer, probs) -> None:
    layer.observation = torch.tensor(probs, dtype=torch.float32).view(1, 1, -1).expand(1, 2, -1).clone()


def test_mean_and_std_are_those_of_the_queries_each_entry_received(model):
    layer = layer_of(model, 4)
    queries = [[0.1, 0.2, 0.3, 0.4], [0.3, 0.0, 0.3, 0.4], [0.2, 0.4, 0.0, 0.4]]
    for probs in queries:  # three decoding queries (one row each)
        observe(layer, probs)
        RoCo(budget=64).update_scores(layer, DECODE_STEP)
    mean, std = statistics(layer)
    expected = torch.tensor(queries)
    torch.testing.assert_close(mean[0, 1], expected.mean(dim=0))
    torch.testing.assert_close(std[0, 1], expected.std(dim=0, correction=0), atol=1e-6, rtol=1e-5)
    assert layer.score(COUNT)[0, 0].tolist() == [3.0] * 4


def test_a_chunk_counts_each_entry_once_per_query_that_saw_it(model):
    assert rows_seen(6, 4, "cpu").tolist() == [4, 4, 4, 3, 2, 1]  # the chunk's own entries: causal
    layer = layer_of(model, 6)
    observe(layer, [2.0, 1.0, 0.4, 0.9, 0.6, 0.3])  # column sums over the chunk's 4 queries
    RoCo(budget=64).update_scores(layer, Step("context", 4))
    mean, std = statistics(layer)
    torch.testing.assert_close(mean[0, 0], torch.tensor([0.5, 0.25, 0.1, 0.3, 0.3, 0.3]))
    assert torch.all(std < 1e-3)  # one forward: each query taken at the chunk's mean (float32 rounding)


def test_the_scope_spares_sinks_recent_and_the_most_volatile_entry(model):
    layer = layer_of(model, 10)
    means = torch.tensor([0.0, 0.05, 0.3, 0.01, 0.2, 0.02, 0.25, 0.03, 0.0, 0.0])
    stds = torch.full((10,), 0.01)
    stds[3] = 0.3  # lowest mean outside the sink, but its attention swings: not in the eviction scope
    layer.score(COUNT).fill_(4.0)
    layer.score(SUM)[:] = (4 * means).view(1, 1, -1)
    layer.score(SQUARES)[:] = (4 * (means.square() + stds.square())).view(1, 1, -1)
    robust = RoCo(budget=7, sinks=1, recent=2, volatile=0.15)  # 1 volatile entry spared
    assert top_indices(robust.scores(layer, DECODE_STEP), 7)[0, 0].tolist() == [0, 2, 3, 4, 6, 8, 9]
    plain = RoCo(budget=7, sinks=1, recent=2, volatile=0.0)  # without the scope: mean attention alone
    assert top_indices(plain.scores(layer, DECODE_STEP), 7)[0, 0].tolist() == [0, 1, 2, 4, 6, 8, 9]


def test_the_bound_holds_in_prefill_and_decoding(model, one_thread):
    torch.manual_seed(0)
    method = RoCo(budget=64, chunk_size=16)
    engine = kvpot.Engine(model, method=method)
    state = engine.prefill_ids(torch.randint(3, VOCAB, (512,)))
    assert state.stats.max_kv_entries <= method.max_entries() == 80
    out = engine.generate_ids(question_ids=torch.randint(3, VOCAB, (6,)), state=state, max_new_tokens=64,
                              ignore_eos=True)
    assert out.stats.max_kv_entries <= 80 and out.stats.final_kv_entries == 64  # back at the budget
    assert out.stats.compressions > 512 // 16 // 2


@pytest.mark.parametrize("kwargs, fragment", [(dict(volatile=1.0), "volatile must be in"),
                                              (dict(budget=12, sinks=4, recent=8, volatile=0.0), "cannot hold"),
                                              (dict(sinks=-1), "sinks must be"), (dict(positions="reset"), "positions")])
def test_bad_parameters_are_refused(kwargs, fragment):
    with pytest.raises(KvpotError, match=fragment):
        RoCo(**kwargs)


def _set_statistics(layer, mean: torch.Tensor, variance: torch.Tensor, count: float = 1.0) -> None:
    n = mean.shape[-1]
    layer.score(COUNT).fill_(count)
    layer.score(SUM)[:] = (count * mean).view(1, -1, n)
    layer.score(SQUARES)[:] = (count * (mean.square() + variance)).view(1, -1, n)


def _old_scores(method: RoCo, layer) -> torch.Tensor:
    """RoCo's rule as it was written over places (the entries in stream order): protect, then the
    `volatile` largest std outside the protected set."""
    mean, std = statistics(layer)
    kept = protect(mean, sinks=method.sinks, recent=method.recent)
    volatile = min(method.volatile_count(), layer.n)
    spread = std.masked_fill(kept.isinf(), float("-inf"))
    return kept.scatter_(-1, spread.topk(volatile, dim=-1).indices, float("inf"))


@pytest.mark.parametrize("sinks,recent", [(0, 0), (2, 3), (4, 10)])
def test_the_ranking_in_stream_order_is_the_old_rule_over_places(model, sinks, recent):
    layer = layer_of(model, 40)
    generator = torch.Generator().manual_seed(sinks + recent)
    _set_statistics(layer, torch.rand(2, 40, generator=generator), torch.rand(2, 40, generator=generator) / 10, 3.0)
    method = RoCo(budget=30, sinks=sinks, recent=recent, volatile=0.2)
    new = method.scores(layer, DECODE_STEP)
    assert new.isinf().sum(dim=-1).tolist() == [[min(40, sinks + recent + 6)] * 2]
    assert torch.equal(new, _old_scores(method, layer))


def test_the_scope_reads_stream_positions_not_places_and_ties_go_to_the_older(model):
    """Entries moved around by replacement (sinks in place, newest last), std with many ties: the volatile
    entries, and so the dropped one, are those of the same entries in stream order; among equal std the
    older entry is spared first."""
    n, sinks, recent = 14, 2, 3
    method = RoCo(budget=13, sinks=sinks, recent=recent, volatile=0.25)  # 3 volatile entries
    generator = torch.Generator().manual_seed(1)
    ordered, moved = layer_of(model, n), layer_of(model, n)
    for trial in range(30):
        mean = torch.randint(0, 4, (2, n), generator=generator).float() / 4  # exact binary fractions: ties
        variance = torch.tensor([0.0, 0.25, 1.0])[torch.randint(0, 3, (2, n), generator=generator)]
        _set_statistics(ordered, mean, variance)
        stream = torch.arange(100, 100 + n)
        ordered.positions[0, :, :n] = stream
        places = torch.cat([torch.arange(sinks), sinks + torch.randperm(n - sinks - 1, generator=generator),
                            torch.tensor([n - 1])])
        _set_statistics(moved, mean[:, places], variance[:, places])
        moved.positions[0, :, :n] = stream[places]
        by_index = method.scores(ordered, DECODE_STEP)
        ranking = method.ranking(moved, DECODE_STEP)
        assert torch.equal(ranking.scores[..., places.argsort()].isinf(), by_index.isinf() & ~protect(
            torch.zeros(1, 1, n), sinks=sinks, recent=recent).isinf())
        drop = replace.drop_index(ranking.scores, moved.positions[:, :, :n], ranking.sinks, ranking.recent)
        kept = top_indices(by_index, n - 1)
        gone = n * (n - 1) // 2 - kept.sum(dim=-1, keepdim=True)
        assert torch.equal(moved.positions[0, :, :n].gather(-1, drop[0]), stream[gone[0]])
    ordered.positions[0, :, :n] = torch.arange(n)
    _set_statistics(ordered, torch.zeros(2, n), torch.full((2, n), 0.25))  # every std equal
    volatile = method.ranking(ordered, DECODE_STEP).scores[0, 0].isinf().nonzero().flatten().tolist()
    assert volatile == [2, 3, 4]  # the three oldest outside the sinks
