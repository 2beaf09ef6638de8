"""The batched step's choice of prompt chunks (`kvpot.engine.plan`): pure, tested without a model."""

import pytest

from kvpot.engine.plan import Candidate, ChunkPlan, check_options, plan_chunks, reading_order, row_plan
from kvpot.errors import KvpotError


def test_chunks_join_oldest_first_within_the_budget_and_never_pass_an_older_request():
    candidates = [Candidate(4, 300), Candidate(1, 500), Candidate(2, 100)]
    assert plan_chunks(candidates, 1024, decoding=3) == ChunkPlan((4, 1, 2), 124)
    # the second does not fit what is left: the plan ends there, the third (younger) waits too
    assert plan_chunks(candidates, 600, decoding=3) == ChunkPlan((4,), 300)


def test_the_first_chunk_is_read_whatever_its_size():
    assert plan_chunks([Candidate(0, 5000), Candidate(1, 10)], 2048, decoding=1) == ChunkPlan((0,), -2952)


def test_a_cuttable_chunk_that_does_not_fit_is_cut_to_fill_the_budget():
    candidates = [Candidate(4, 300, cuttable=True), Candidate(1, 900, cuttable=True), Candidate(2, 100, cuttable=True)]
    # the second is cut to the 724 tokens left; the plan ends with the budget spent, the third waits
    assert plan_chunks(candidates, 1024, decoding=3) == ChunkPlan((4, 1), 0, 724)
    # a chunk of a method whose chunks depend on where forwards end is never cut: the plan ends before it
    whole = [Candidate(4, 300, cuttable=True), Candidate(1, 900), Candidate(2, 100, cuttable=True)]
    assert plan_chunks(whole, 1024, decoding=3) == ChunkPlan((4,), 724)


def test_a_tail_probe_counts_against_the_budget():
    """A chunk's tail probe (InfiniPot's catalyst at its pot's fill) rides in the forward: its tokens are spent too, so
    a step never pads to the next token bucket for it."""
    candidates = [Candidate(0, 500, cuttable=True, tail=11), Candidate(1, 600, cuttable=True)]
    # 511 spent on the first; the second is cut to the 513 left
    assert plan_chunks(candidates, 1024, decoding=2) == ChunkPlan((0, 1), 0, 513)
    # a cut chunk keeps room for its tail, which it may still carry
    tailed = [Candidate(0, 500), Candidate(1, 600, cuttable=True, tail=11)]
    assert plan_chunks(tailed, 1024, decoding=2) == ChunkPlan((0, 1), 0, 513)
    # a first chunk that fits the budget only without its tail is cut too, where it may be
    assert plan_chunks([Candidate(0, 1020, cuttable=True, tail=11)], 1024, decoding=1) == ChunkPlan((0,), 0, 1013)
    # one that may not be cut is read whole, tail and all: the step runs past its budget
    assert plan_chunks([Candidate(0, 1020, tail=11)], 1024, decoding=1) == ChunkPlan((0,), -7)
    # a whole chunk and its tail that fit exactly leave nothing
    assert plan_chunks([Candidate(0, 1013, cuttable=True, tail=11), Candidate(1, 50)], 1024,
                       decoding=1) == ChunkPlan((0,), 0)


def test_a_sliver_of_budget_is_not_cut_for():
    """Below a sixteenth of the budget a cut chunk's row is not worth its method hook: the plan ends whole."""
    candidates = [Candidate(0, 980, cuttable=True), Candidate(1, 500, cuttable=True)]
    assert plan_chunks(candidates, 1024, decoding=1) == ChunkPlan((0,), 44)
    assert plan_chunks(candidates, 1024 + 40, decoding=1) == ChunkPlan((0, 1), 0, 84)


def test_a_cut_chunk_can_make_two_worth_mixing_without_decoding_rows():
    assert plan_chunks([Candidate(0, 600, cuttable=True), Candidate(1, 600, cuttable=True)], 1024,
                       decoding=0) == ChunkPlan((0, 1), 0, 424)


def test_a_chunk_that_needs_a_forward_of_its_own_ends_the_plan():
    """It is read next, alone, with what is left: no younger request's chunk passes it."""
    candidates = [Candidate(0, 100), Candidate(1, 100), Candidate(2, 100, mixable=False), Candidate(3, 100)]
    assert plan_chunks(candidates, 1000, decoding=2) == ChunkPlan((0, 1), 800)
    assert plan_chunks(candidates[2:], 1000, decoding=2) == ChunkPlan((), 1000)


def test_without_decoding_rows_one_chunk_is_not_worth_mixing():
    assert plan_chunks([Candidate(0, 100)], 1000, decoding=0) == ChunkPlan((), 1000)
    assert plan_chunks([Candidate(0, 100), Candidate(1, 50)], 1000, decoding=0) == ChunkPlan((0, 1), 850)
    assert plan_chunks([], 1000, decoding=5) == ChunkPlan((), 1000)


def test_an_exhausted_budget_takes_no_more_chunks():
    assert plan_chunks([Candidate(0, 1000), Candidate(1, 1)], 1000, decoding=1) == ChunkPlan((0,), 0)
    with pytest.raises(ValueError):
        plan_chunks([Candidate(0, 1)], 0, decoding=1)


@pytest.mark.parametrize("options, fragment", [
    ((0, None, "auto", "auto"), "prefill_tokens"), ((True, None, "auto", "auto"), "prefill_tokens"),
    ((64, -1, "auto", "auto"), "max_waiting"), ((64, None, "sometimes", "auto"), "feed_questions"),
    ((64, None, "auto", "eager"), "fixed-shape"), ((64, None, "auto", "auto", False, "longest"), "prompt_order"),
    ((64, None, "auto", "auto", False, "shortest", -1.0), "prompt_patience"),
    ((64, None, "auto", "auto", False, "shortest", "10"), "prompt_patience"),
    ((64, None, "auto", "auto", False, "shortest", float("nan")), "prompt_patience"),
    ((64, None, "auto", "auto", False, "shortest", True), "prompt_patience"),
])
def test_scheduler_options_are_refused_in_one_sentence(options, fragment):
    with pytest.raises(KvpotError, match=fragment):
        check_options(*options)
    check_options(64, None, "auto", "graph")
    check_options(64, None, "auto", "graph", False, "shortest", float("inf"))  # shortest first, never overtaken
    check_options(64, None, "auto", "graph", False, "shortest", 0)  # (arrival order)


def test_reading_order_by_arrival_or_by_prompt_tokens_left():
    """Requests reading their prompt (not decoding, not fed a question), oldest first; or fewest tokens left first,
    the oldest first among equals."""
    from types import SimpleNamespace

    def active(status, started, left, feeding=None):
        return SimpleNamespace(request=SimpleNamespace(status=status), started=started, feeding=feeding,
                               reader=SimpleNamespace(remaining=left))

    actives = {0: active("prefilling", 3.0, 500), 1: active("prefilling", 1.0, 9000), 2: active("decoding", 0.5, 0),
               3: active("prefilling", 2.0, 500), 4: active("prefilling", 0.1, 10, feeding=[5, 6]),
               5: active("prefilling", 4.0, 20)}
    assert [slot for slot, _ in reading_order(actives, "arrival")] == [1, 3, 0, 5]
    assert [slot for slot, _ in reading_order(actives, "shortest", now=5.0)] == [5, 3, 0, 1]
    # past its patience a prompt goes before shorter ones (the oldest first among such): none is held back for good
    assert [slot for slot, _ in reading_order(actives, "shortest", now=11.5, patience=10.0)] == [1, 5, 3, 0]
    assert [slot for slot, _ in reading_order(actives, "shortest", now=13.5, patience=10.0)] == [1, 3, 0, 5]
    # a patience of 0 is arrival order; an infinite one never lets a longer prompt overtake
    assert [slot for slot, _ in reading_order(actives, "shortest", now=5.0, patience=0)] == [1, 3, 0, 5]
    assert [slot for slot, _ in reading_order(actives, "shortest", now=1e9, patience=float("inf"))] == [5, 3, 0, 1]


def test_mixing_is_on_where_the_varlen_kernel_runs_unless_told(monkeypatch):
    """`Scheduler(mix="auto")`, the default (`kvpot.defaults.MIX`): prompt chunks join the decoding rows' forward on
    a CUDA device whose kernels run at a head dim they take; "on"/"off" and bools as given; anything else refused."""
    import torch

    from kvpot import kernels
    from kvpot.defaults import MIX
    from kvpot.engine.mixed import resolve_mix

    assert MIX == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_mix("auto", cpu, 64) is False
    assert (resolve_mix("on", cpu, 64), resolve_mix("off", cuda, 64)) == (True, False)
    assert (resolve_mix(True, cpu, 48), resolve_mix(False, cuda, 64)) == (True, False)
    monkeypatch.setattr(kernels, "available", lambda device: True)
    assert resolve_mix("auto", cuda, 64) is True
    assert resolve_mix("auto", cuda, 48) is False  # a head dim the kernels refuse: each chunk attended alone
    assert resolve_mix("auto", cpu, 64) is False  # Triton's interpreter on a CPU: the mixed step's reference path
    assert resolve_mix("auto", cuda, 64, parallel=True) is False  # nor is the mixed step tested under TP
    assert resolve_mix("on", cuda, 64, parallel=True) is True
    monkeypatch.setattr(kernels, "available", lambda device: False)
    assert resolve_mix("auto", cuda, 64) is False
    with pytest.raises(KvpotError, match="mix must be one of"):
        resolve_mix("sometimes", cpu, 64)


def test_eager_mix_reads_in_the_rows_forward_without_the_fixed_shape_step(one_thread):
    """`mix="eager"`: chunks still join the decoding rows' forward, but never in the captured fixed-shape step
    (`kvpot.engine.packed`), so the two can be compared; refused where "on" is."""
    import torch

    import kvpot
    from conftest import build
    from kvpot.engine.mixed import resolve_mix
    from kvpot.engine.scheduler import Scheduler
    from kvpot.serve.config import ServeConfig

    assert resolve_mix("eager", torch.device("cpu"), 64) is True
    with pytest.raises(KvpotError, match="batch-invariant"):
        resolve_mix("eager", torch.device("cpu"), 64, invariant=True)
    assert ServeConfig(mix="eager", share_documents=True).mix == "eager"  # shared documents mix when asked
    engine = kvpot.Engine(build("llama3"), method=kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16))
    eager = Scheduler(engine, slots=2, decode="static", mix="eager")
    assert eager.mix and not eager.decoder.fixed_mix
    assert Scheduler(engine, slots=2, decode="graph" if torch.cuda.is_available() else "static", mix="on").mix


def test_a_row_steps_eagerly_where_the_batched_step_cannot_take_its_plan():
    """`row_plan`: the method's plan, unless the pool does not batch, the method attends for itself without the
    decode kernels' positions, or the batched step cannot compute the observation its plan asks for."""
    from types import SimpleNamespace

    def scheduler(plan, batched=True, steady_ok=True, append_ok=True):
        method = SimpleNamespace(decode_plan=lambda cache: plan)
        return SimpleNamespace(batched=batched, method=method, steady_ok=steady_ok, append_ok=append_ok,
                               sequence_steps=False)  # (a larger pool: a pool of one, `test_launch_ahead.py`)

    plain = SimpleNamespace(attention=None)
    assert [row_plan(scheduler(p), plain) for p in ("append", "steady", "eager")] == ["append", "steady", "eager"]
    assert row_plan(scheduler("append", batched=False), plain) == "eager"
    assert row_plan(scheduler("steady", steady_ok=False), plain) == "eager"
    assert row_plan(scheduler("append", append_ok=False), plain) == "eager"
    own = SimpleNamespace(attention=object(), policy=SimpleNamespace(kernel_decoding=False))
    assert row_plan(scheduler("append"), own) == "eager"
    kernels = SimpleNamespace(attention=object(), policy=SimpleNamespace(kernel_decoding=True))
    assert row_plan(scheduler("append"), kernels) == "append"


def test_a_step_reads_at_most_its_rows_of_chunks_and_the_rest_wait():
    """`max_chunks` (the packed step's rows): the chunks past it wait for the next step, none read apart."""
    readers = [Candidate(slot, 32) for slot in range(12)]
    assert plan_chunks(readers, 1024, decoding=50, max_chunks=8) == ChunkPlan(tuple(range(8)), 0)
    assert plan_chunks(readers, 1024, decoding=50) == ChunkPlan(tuple(range(12)), 1024 - 12 * 32)
    assert plan_chunks(readers[:3], 1024, decoding=50, max_chunks=8) == ChunkPlan((0, 1, 2), 1024 - 3 * 32)
    assert plan_chunks(readers, 1024, decoding=50, max_chunks=0) == ChunkPlan((), 0)


def test_a_shared_documents_reader_mixes_even_alone():
    """Nobody decoding and one chunk: nothing joins, unless the chunk is a shared document's reader's (read apart,
    it would copy the document)."""
    assert plan_chunks([Candidate(0, 32)], 1024, decoding=0) == ChunkPlan((), 1024)
    assert plan_chunks([Candidate(0, 32, shared=True)], 1024, decoding=0) == ChunkPlan((0,), 1024 - 32)
