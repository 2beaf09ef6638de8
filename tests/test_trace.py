"""The batched step's trace (`kvpot.engine.trace`): every step recorded with its own counts, kinds named by what
the step ran, gaps charged to the step between two deliveries, and the summary's counts adding up."""

from __future__ import annotations

import pytest
from test_batch import methods, prompts  # noqa: F401 - the fixture

import kvpot
from conftest import build
from kvpot.engine.offline import run_all
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.engine.trace import NoTrace, StepTrace, kind_of


def _record(**counts) -> dict:
    return {"batched_rows": 0, "eager_rows": 0, "riding_rows": 0, "fed_tokens": 0, "mixed_forwards": 0,
            "prefill_forwards": 0, "forwards": 0, "apart_forwards": 0, **counts}


def test_a_step_kind_names_what_it_ran():
    assert kind_of(_record(batched_rows=3)) == "decode"
    assert kind_of(_record(batched_rows=3, mixed_forwards=1)) == "mixed"
    assert kind_of(_record(prefill_forwards=2, apart_forwards=2)) == "apart"
    assert kind_of(_record(batched_rows=3, mixed_forwards=1, prefill_forwards=2)) == "mixed"  # chunks read, mixed
    assert kind_of(_record(batched_rows=1, mixed_forwards=1, apart_forwards=1, eager_rows=1)) == "mixed+apart+eager"
    assert kind_of(_record(eager_rows=1)) == "eager"
    assert kind_of(_record()) == "idle"


def test_each_gap_is_charged_to_the_step_between_two_deliveries():
    trace, report = StepTrace(), _record()
    for delivered, (rows, mixed) in zip((0.0, 0.010, 0.130, 0.140), ((2, 0), (2, 1), (2, 0), (2, 0))):
        trace.begin(report, delivered, {})
        report["batched_rows"] += rows
        report["mixed_forwards"] += mixed
        report["forwards"] += 1
        trace.end(report, [])
    summary = trace.summary(slowest=1)
    assert summary["steps"] == 3  # the last step's gap is not known yet
    assert summary["kinds"]["mixed"] == {"steps": 1, "gap_p50_ms": 120.0, "gap_p99_ms": 120.0, "gap_max_ms": 120.0}
    assert summary["kinds"]["decode"]["steps"] == 2 and summary["kinds"]["decode"]["gap_max_ms"] == 10.0
    assert summary["slowest"] == [{"step": 1, **_record(batched_rows=2, mixed_forwards=1, forwards=1),
                                   "mixed_tokens": 0, "compressions": 0, "kind": "mixed", "gap_ms": 120.0}]


def test_a_scheduler_traces_every_step_with_its_own_counts(prompts, one_thread):  # noqa: F811
    """Off by default; set, it records every step, and the steps' counts add up to the scheduler's."""
    method, capacity = methods()["streaming"]
    scheduler = Scheduler(kvpot.Engine(build("llama3"), method=method), slots=3, capacity=capacity, decode="static",
                          mix=True, prefill_tokens=64)
    assert isinstance(scheduler.trace, NoTrace)
    scheduler.trace = StepTrace()
    requests = [Request(c, q, max_new_tokens=6, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    steps = scheduler.trace.steps
    assert len(steps) == scheduler.report["steps"]
    for name in ("batched_rows", "mixed_forwards", "prefill_forwards", "forwards", "eager_rows"):
        assert sum(step[name] for step in steps) == scheduler.report[name], name
    assert sum(step["apart_forwards"] + step["eager_rows"] + bool(step["mixed_forwards"] or step["batched_rows"])
               for step in steps) == scheduler.report["forwards"]
    mixed = [step for step in steps if step["mixed_forwards"]]
    assert mixed and all(0 < step["mixed_tokens"] <= 64 for step in mixed)
    assert all(step["mixed_tokens"] == 0 for step in steps if not step["mixed_forwards"])
    summary = scheduler.trace.summary()
    assert sum(kind["steps"] for kind in summary["kinds"].values()) == summary["steps"] == len(steps) - 1
    assert "mixed" in summary["kinds"] and len(summary["slowest"]) == 10


class _Marks:
    """A stand-in for `DeviceMarks`: each mark the count of marks made before it; a step's device time, in ms, is the
    distance between its two marks times `scale`."""

    def __init__(self, scale: float):
        self.made, self.scale = 0, scale

    def mark(self) -> int:
        self.made += 1
        return self.made

    def elapsed_ms(self, start: int, stop: int) -> float:
        return (stop - start) * self.scale


def test_each_step_gets_its_device_time_between_its_begin_and_end_marks():
    """With marks (a CUDA device's events), a step's device time runs from its begin mark to its end mark; each kind
    gets its p50 / p99 beside the gaps, and the slowest steps show their own. Without, no device figure at all."""
    marks = _Marks(scale=4.0)
    trace, report = StepTrace(marks), _record()
    for delivered, (rows, mixed) in zip((0.0, 0.010, 0.130, 0.140), ((2, 0), (2, 1), (2, 0), (2, 0))):
        trace.begin(report, delivered, {})
        report["batched_rows"] += rows
        report["mixed_forwards"] += mixed
        report["forwards"] += 1
        marks.made += 9 * mixed  # the mixed step's work: ten marks' distance, not one
        trace.end(report, [])
    summary = trace.summary(slowest=1)
    assert summary["kinds"]["decode"]["device_p50_ms"] == summary["kinds"]["decode"]["device_p99_ms"] == 4.0
    assert summary["kinds"]["mixed"]["device_p50_ms"] == 40.0
    assert summary["slowest"][0]["kind"] == "mixed" and summary["slowest"][0]["device_ms"] == 40.0
    bare = StepTrace()
    bare.begin(report, 0.0, {})
    bare.end(report, [])
    bare.begin(report, 0.01, {})
    bare.end(report, [])
    kinds = bare.summary()["kinds"]
    assert all("device_p50_ms" not in figures for figures in kinds.values())
    assert StepTrace.for_device("cpu").marks is None


def test_a_bench_row_s_steps_table_shows_device_times_where_taken():
    """`kvpot bench throughput`'s steps table gains the device columns only where the trace took them (a GPU)."""
    from kvpot.bench.report import steps_markdown

    figures = {"steps": 3, "gap_p50_ms": 17.0, "gap_p99_ms": 18.0, "gap_max_ms": 19.0}
    row = {"method": "infinipot [batch]", "length": 4096, "steps": {"kinds": {"decode": dict(figures)}}}
    assert "device p50 ms" not in steps_markdown({"rows": [row]})
    row["steps"]["kinds"]["decode"].update(device_p50_ms=16.4, device_p99_ms=16.9)
    table = steps_markdown({"rows": [row]})
    assert "device p50 ms" in table and "| 16.4 | 16.9 |" in table


@pytest.mark.gpu
def test_device_marks_time_a_step_on_the_gpu(prompts):  # noqa: F811
    """On a GPU, `for_device` takes CUDA events: every step's device time is positive and none exceeds the run."""
    import time

    import torch

    method, capacity = methods()["streaming"]
    cuda = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts]
    scheduler = Scheduler(kvpot.Engine(build("llama3").cuda(), method=method), slots=3, capacity=capacity)
    scheduler.trace = StepTrace.for_device(torch.device("cuda"))
    begun = time.perf_counter()
    run_all(scheduler, [Request(c, q, max_new_tokens=6, ignore_eos=True) for c, q in cuda])
    wall = (time.perf_counter() - begun) * 1000
    steps = scheduler.trace.summary(slowest=1000)["slowest"]
    assert steps and all(0 < step["device_ms"] <= wall for step in steps)


@pytest.mark.parametrize("fixed", [False, True], ids=["eager-mix", "packed"])
def test_a_trace_counts_the_compressions_of_each_mixed_step(prompts, fixed, one_thread):  # noqa: F811
    """InfiniPot compresses at its pot's fill after the mixed forward: the trace charges each compression of a mixed
    chunk's run to the step that read the chunk, and splits those steps' gaps out (`compressing`)."""
    method, capacity = methods()["infinipot"]
    scheduler = Scheduler(kvpot.Engine(build("llama3"), method=method), slots=3, capacity=capacity, decode="static",
                          mix=True, prefill_tokens=64)
    scheduler.decoder.fixed_mix = fixed
    scheduler.trace = StepTrace()
    requests = [Request(c, q, max_new_tokens=6, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    steps = scheduler.trace.steps
    # every compression ran after a mixed forward or a forward apart; those of the mixed ones are in the trace
    total = sum(r.stats.compressions for r in requests)
    traced = sum(step["compressions"] for step in steps)
    assert 0 < traced <= total
    assert all(step["compressions"] == 0 for step in steps if not step["mixed_forwards"])
    kinds = scheduler.trace.summary()["kinds"]
    assert 0 < kinds["mixed"]["compressing"]["steps"] <= kinds["mixed"]["steps"]


@pytest.mark.parametrize("mix", ["on", "off"])
def test_a_traced_run_gives_the_tokens_of_an_untraced_one(prompts, mix, one_thread):  # noqa: F811
    method, capacity = methods()["infinipot"]
    tokens = []
    for traced in (False, True):
        scheduler = Scheduler(kvpot.Engine(build("llama3"), method=method), slots=3, capacity=capacity,
                              decode="static", mix=mix, prefill_tokens=64)
        if traced:
            scheduler.trace = StepTrace()
        requests = [Request(c, q, max_new_tokens=6, ignore_eos=True) for c, q in prompts]
        run_all(scheduler, requests)
        tokens.append([r.tokens for r in requests])
    assert tokens[0] == tokens[1]


def test_an_idle_wait_is_never_among_the_slowest_steps():
    """Under open-loop load an idle step's gap is the wait for the next arrival: counted as `idle`, never slowest."""
    trace, report = StepTrace(), _record()
    for delivered, rows in zip((0.0, 0.010, 5.010, 5.020), (2, 0, 2, 2)):
        trace.begin(report, delivered, {})
        report["batched_rows"] += rows
        report["forwards"] += bool(rows)
        trace.end(report, [])
    summary = trace.summary(slowest=1)
    assert summary["kinds"]["idle"]["gap_max_ms"] == 5000.0
    assert [step["kind"] for step in summary["slowest"]] == ["decode"]


@pytest.mark.parametrize("fixed", [False, True], ids=["eager-mix", "packed"])
@pytest.mark.parametrize("name", ["infinipot-question", "snapkv"])
def test_a_request_whose_chunk_mixed_reads_its_next_chunk_next_step(prompts, name, fixed, one_thread):  # noqa: F811
    """A request's question (or next chunk) after a chunk that rode in this step's mixed forward waits for the next
    step's, instead of a forward of its own in this one (on an H200 those took 90-190 ms, 10-12 a run); every request
    keeps the tokens it gets alone."""
    from test_batch import alone

    model = build("llama3")
    method, capacity = methods()[name]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static",
                          mix=True, prefill_tokens=64)
    scheduler.decoder.fixed_mix = fixed  # the packed step (a GPU's), run uncaptured
    mixed_runs, apart = set(), []
    plan, forward = scheduler._chunks, scheduler.engine._forward

    def chunks(batch, rides):
        planned = plan(batch, rides)
        mixed_runs.clear()
        mixed_runs.update(id(active.run) for _, active, _ in planned[0])
        return planned

    def forward_apart(run, *args, **kwargs):
        apart.append(id(run) in mixed_runs)
        return forward(run, *args, **kwargs)

    scheduler._chunks, scheduler.engine._forward = chunks, forward_apart
    requests = [Request(c, q, max_new_tokens=6, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids[:6] for e in alone(model, method, prompts)]
    assert scheduler.report["mixed_forwards"] > 0 and apart and not any(apart)
