"""Steady rows evicting inside the batched step's fixed-shape body (`kvpot.engine.evict.evict_in_step`).

A row at its budget appends its token and drops one entry a layer. Where every such row drops by its method's
ranking from the same counts, the drop runs inside the step (captured with it on a GPU); rows that only append,
and padding rows, evict the scratch slot instead. Every request must get the tokens, entries and compressions it
gets alone, whichever rows of a step are steady, and the same as when the rows evict after the step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvpot
import kvpot.engine.batch as batch_module
import kvpot.engine.evict as evict_module
from conftest import VOCAB, build
from kvpot.engine.batch import BatchDecoder
from kvpot.engine.evict import steady_form
from kvpot.engine.graphs import REPLAYED, WARMED, StepGraphs
from kvpot.engine.offline import run_all
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.methods import replace
from test_batch import LENGTHS, NEW, alone, methods

RANKING = ["streaming", "h2o", "tova", "roco"]  # the methods whose steady rows drop one entry by a ranking


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(2)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in LENGTHS]


def spy(monkeypatch):
    """Counts of the evictions in the step and after it."""
    calls = {"inside": 0, "after": 0}
    inside, after = evict_module.evict_in_step, evict_module.evict_rows

    def counted_inside(*args, **kwargs):
        calls["inside"] += 1
        return inside(*args, **kwargs)

    def counted_after(*args, **kwargs):
        calls["after"] += 1
        return after(*args, **kwargs)

    monkeypatch.setattr(batch_module, "evict_in_step", counted_inside)
    monkeypatch.setattr(evict_module, "evict_rows", counted_after)
    return calls


def batched(model, method, prompts, capacity, lengths, mix=False):
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static", mix=mix)
    requests = [Request(c, q, max_new_tokens=n, ignore_eos=True) for (c, q), n in zip(prompts, lengths)]
    run_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("name", RANKING)
def test_steady_rows_evicting_in_the_step_give_each_request_its_tokens_entries_and_compressions_alone(
        arch, name, prompts, one_thread, monkeypatch):
    """Prompts of different lengths reach their budget at different steps, so steps hold steady rows beside rows
    that only append (which evict the scratch slot) and padding rows; the counts equal alone and after the step."""
    model = build(arch)
    method, capacity = methods()[name]
    lengths = [NEW, 7, NEW - 3, 2, 12]
    expected = [alone(model, method, [p], new=n)[0] for p, n in zip(prompts, lengths)]
    calls = spy(monkeypatch)
    runs = {}
    for inside in (True, False):
        monkeypatch.setattr(BatchDecoder, "evict_inside", inside)
        calls.update(inside=0, after=0)
        scheduler, requests = batched(model, method, prompts, capacity, lengths)
        assert [r.tokens for r in requests] == [e.token_ids for e in expected], inside
        for key in ("max_kv_entries", "final_kv_entries", "compressions"):
            assert [getattr(r.stats, key) for r in requests] == [getattr(e.stats, key) for e in expected], (inside, key)
        assert scheduler.pool.used == 0 and scheduler.idle
        assert int(scheduler.pool.lengths[:, scheduler.pool.scratch].abs().sum()) == 0  # the scratch slot's count
        runs[inside] = dict(calls), scheduler.report["steady_rows"]
    (with_inside, steady), (without, steady_after) = runs[True], runs[False]
    assert steady == steady_after > 0
    assert with_inside["inside"] > 0 and with_inside["after"] == 0, runs
    assert without == {"inside": 0, "after": without["after"]} and without["after"] > 0, runs


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_steady_rows_beside_mixed_prompt_chunks_evict_after_the_step(name, prompts, one_thread, monkeypatch):
    """A mixed forward (prompt chunks beside the rows) keeps the eviction after it: the tokens alone either way."""
    model = build("llama3")
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    calls = spy(monkeypatch)
    scheduler, requests = batched(model, method, prompts, capacity, [NEW] * len(prompts), mix=True)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert scheduler.report["mixed_forwards"] > 0 and calls["inside"] > 0  # decode-only steps still evict inside


def test_without_replacement_steady_rows_evict_after_the_step(prompts, one_thread, monkeypatch):
    """`replace.enabled = False` (the top-k path): no step evicts inside, and the tokens are still those alone."""
    model = build("llama3")
    method, capacity = methods()["h2o"]
    monkeypatch.setattr(replace, "enabled", False)
    expected = alone(model, method, prompts)
    calls = spy(monkeypatch)
    scheduler, requests = batched(model, method, prompts, capacity, [NEW] * len(prompts))
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert calls["inside"] == 0 and calls["after"] > 0 and scheduler.report["steady_rows"] > 0


def test_the_form_is_the_rows_one_count_or_none():
    """`steady_form`: the rows' shared counts where the method drops one entry by a ranking; None with no rows,
    rows at different counts, tensor parallelism (not run there), or a method that evicts in its own way (D2O)."""
    def run(counts):
        return SimpleNamespace(cache=SimpleNamespace(lengths=lambda: list(counts)))

    streaming = kvpot.StreamingLLM(sinks=4, window=60)
    assert steady_form(streaming, [run((64, 64)), run((64, 64))], None) == (64, 64)
    assert steady_form(streaming, [], None) is None
    assert steady_form(streaming, [run((64, 64)), run((64, 63))], None) is None
    assert steady_form(streaming, [run((64, 64))], object()) is None
    assert steady_form(kvpot.D2O(budget=64), [run((64, 64))], None) is None


class ReplayOnCpu(StepGraphs):
    """`StepGraphs` on a CPU: a key's first step warms, its capture runs the step once (as a replay would)."""

    def run(self, key, body, around=None):
        if key not in self.warm:
            body()
            self.warm.add(key)
            self.warmups += 1
            return WARMED, None
        if key not in self.graphs:
            self.graphs[key] = (None, None)
            self.captures += 1
        body()
        self.replays += 1
        return REPLAYED, None


@pytest.mark.parametrize("name", RANKING)
def test_a_server_captures_the_steady_step_before_any_request(name, prompts, one_thread):
    """`Scheduler.capture` (a server's start) captures the form whose steady rows evict inside it, at the method's
    keep counts, for every batch size: the requests' steady steps then only replay."""
    model = build("llama3")
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static")
    graphs = scheduler.decoder.graphs = ReplayOnCpu()
    scheduler.decoder.graphs_on = True
    assert scheduler.capture() >= len(graphs.graphs) > 0  # (a warm-up that made a score array drops graphs: again)
    forms = {key[-1] for key in graphs.graphs} - {None}
    assert len(forms) == 1 and len(set(forms.pop())) == 1  # one form: the keep count in every layer
    ahead = set(graphs.graphs)
    warmed = []
    real = graphs.run

    def run(key, body, around=None):
        warmed.append(key not in graphs.warm)
        return real(key, body, around)

    graphs.run = run
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert scheduler.report["steady_rows"] > 0 and not any(warmed) and set(graphs.graphs) == ahead


@pytest.mark.gpu
@pytest.mark.parametrize("name", RANKING)
def test_steady_rows_evict_inside_the_captured_step(name, prompts, monkeypatch):
    """Through CUDA graphs: the steady rows' eviction is captured with the step (a graph keyed by its counts, whose
    capture would have refused any synchronisation), and every request gets its tokens alone."""
    model = build("llama3").cuda()
    method, capacity = methods()[name]
    cuda = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts]
    lengths = [NEW, 7, NEW - 3, 2, 12]
    expected = [alone(model, method, [p], new=n)[0] for p, n in zip(cuda, lengths)]
    calls = spy(monkeypatch)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="graph")
    requests = [Request(*p, max_new_tokens=n, ignore_eos=True) for p, n in zip(cuda, lengths)]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected]
    assert calls["after"] == 0 and scheduler.report["steady_rows"] > 0
    assert any(key[-1] is not None for key in scheduler.decoder.graphs.graphs)  # a captured form with its counts
    assert scheduler.decoder.replays > 0 and scheduler.pool.used == 0 and scheduler.idle


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_readers_of_a_stored_document_evicting_in_the_step_get_their_tokens_alone(name, share, prompts, one_thread,
                                                                                  monkeypatch):
    """Readers of one stored state reach their budget together (the same counts): their steps evict inside. Sharing the
    document, each copies it first (their method evicts: `Method.copies_document`)."""
    model = build("llama3")
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(prompts[-1][0])
    questions = [torch.randint(3, VOCAB, (k,)).tolist() for k in (3, 9, 5, 1)]
    expected = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True).token_ids
                for q in questions]
    calls = spy(monkeypatch)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static",
                          share_documents=share)
    requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in questions]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert calls["inside"] > 0 and calls["after"] == 0 and scheduler.report["steady_rows"] > 0
    assert scheduler.pool.used == 0 and scheduler.idle
    if share:
        assert scheduler.report["copy_on_write"] == len(questions), scheduler.report
