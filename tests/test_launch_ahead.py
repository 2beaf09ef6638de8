"""Decode-only steps launched before the previous step's tokens are handed over (`kvpot.engine.ahead`).

On a CPU nothing runs apart from the host, so `launch_ahead="auto"` is off there; these tests turn it on: a step
launched ahead must give every request the tokens, entries and compressions it gets alone (rows that end by length
are left out of it; a row that ends at a stop token was stepped once more, and only its token from that step is
dropped), and the decision itself is checked without a model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.engine.ahead import ahead_rows, resolve_launch_ahead
from kvpot.engine.batch import BatchDecoder
from kvpot.engine.delivery import TokenOutbox
from kvpot.engine.offline import run_all
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.errors import KvpotError
from test_batch import LENGTHS, NEW, alone, methods

@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(1)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in LENGTHS]


EACH = ["full", "streaming", "h2o", "tova", "infinipot", "citrus", "d2o", "snapkv", "sirllm", "roco", "cam", "infllm"]


def ahead(model, method, prompts, capacity, lengths: list[int], mix: bool):
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static", mix=mix,
                          launch_ahead=True)
    requests = [Request(c, q, max_new_tokens=n, ignore_eos=True) for (c, q), n in zip(prompts, lengths)]
    run_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
@pytest.mark.parametrize("name", EACH)
def test_steps_launched_ahead_give_each_request_its_tokens_entries_and_compressions_alone(arch, name, prompts,
                                                                                          one_thread):
    model = build(arch)
    method, capacity = methods()[name]
    lengths = [NEW, 7, NEW - 3, 1, 12]  # rows end by length at different steps, and are left out of the step ahead
    expected = [alone(model, method, [p], new=n)[0] for p, n in zip(prompts, lengths)]
    for mix in (False, True):
        scheduler, requests = ahead(model, method, prompts, capacity, lengths, mix)
        assert [r.tokens for r in requests] == [e.token_ids for e in expected], mix
        assert [r.stats.max_kv_entries for r in requests] == [e.stats.max_kv_entries for e in expected], mix
        assert [r.stats.final_kv_entries for r in requests] == [e.stats.final_kv_entries for e in expected], mix
        assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected], mix
        assert all(r.finish_reason == "length" for r in requests) and scheduler.pool.used == 0 and scheduler.idle
        report = scheduler.report
        if name != "infllm":  # its own attention: every row steps alone, so no step is decode-only in the batch
            assert report["ahead_steps"] > 0, mix
        assert report["batched_rows"] + report["eager_rows"] + report["riding_rows"] == sum(n - 1 for n in lengths)


def test_a_request_ending_at_a_stop_token_loses_nothing_and_gains_nothing(prompts, one_thread):
    """The row that picks its stop token was already stepped once more: that step's token is not delivered, its
    neighbours' tokens are theirs alone, its slot is free again; its cache held one entry more, at most."""
    model = build("llama3")
    method, capacity = methods()["full"]
    expected = alone(model, method, prompts[:3])
    first = expected[0].token_ids
    stop = first[5]
    upto = first[: first.index(stop) + 1]
    stopped = alone(model, method, prompts[:1], new=len(upto))[0]  # alone, ending there by length
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static",
                          launch_ahead=True)
    requests = [Request(*prompts[0], max_new_tokens=NEW, stop_token_ids=(stop,), ignore_eos=True),
                *(Request(*p, max_new_tokens=NEW, ignore_eos=True) for p in prompts[1:3])]
    run_all(scheduler, requests)
    assert requests[0].tokens == upto and requests[0].finish_reason == "stop"
    assert [r.tokens for r in requests[1:]] == [e.token_ids for e in expected[1:]]
    assert requests[0].stats.final_kv_entries - stopped.stats.final_kv_entries in (0, 1)
    assert scheduler.report["ahead_steps"] > 0 and scheduler.pool.used == 0 and scheduler.idle


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["streaming", "h2o", "infinipot", "full"])
def test_steps_launched_ahead_through_cuda_graphs_give_each_request_its_tokens_alone(name, prompts):
    """On a GPU, where launching ahead is the default: captured steps, rows ending by length and at a stop token."""
    model = build("llama3").cuda()
    method, capacity = methods()[name]
    cuda = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts]
    lengths = [NEW, 7, NEW - 3, 1, 12]
    expected = [alone(model, method, [p], new=n)[0] for p, n in zip(cuda, lengths)]
    stop = expected[0].token_ids[5]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="graph")
    assert scheduler.launch_ahead is True  # "auto" on a CUDA device
    requests = [Request(*p, max_new_tokens=n, ignore_eos=True, stop_token_ids=(stop,) if i == 0 else ())
                for i, (p, n) in enumerate(zip(cuda, lengths))]
    run_all(scheduler, requests)
    first = expected[0].token_ids
    assert requests[0].tokens == first[: first.index(stop) + 1]
    assert [r.tokens for r in requests[1:]] == [e.token_ids for e in expected[1:]]
    assert scheduler.report["ahead_steps"] > 0 and scheduler.decoder.replays > 0
    assert scheduler.pool.used == 0 and scheduler.idle


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["streaming", "h2o", "tova"])
def test_the_batched_eviction_never_waits_for_the_device(name, prompts, monkeypatch):
    """A step launched ahead only hides the host's work if nothing after the launch waits for the device: the rows
    at their budget evict (`evict_steady`) under `torch.cuda.set_sync_debug_mode("error")`, which raises at any
    synchronising call. (`lengths[index, rows] = keep` did: a Python scalar written through advanced indexing is
    copied from the host and the stream synchronised, 32 times a step.)"""
    import kvpot.engine.scheduler as scheduler_module

    model = build("llama3").cuda()
    method, capacity = methods()[name]
    cuda = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts]
    expected = alone(model, method, cuda)
    real, calls = scheduler_module.evict_steady, []

    def strict(*args, **kwargs):
        calls.append(1)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(scheduler_module, "evict_steady", strict)
    # the eviction after the step (a mixed step's, rows at different counts); inside the step a capture refuses syncs
    monkeypatch.setattr(BatchDecoder, "evict_inside", False)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="graph")
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in cuda]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert calls and scheduler.report["steady_rows"] > 0


@pytest.mark.parametrize("name", ["streaming", "h2o", "tova", "roco", "infinipot", "sirllm", "full"])
def test_no_step_writes_a_python_scalar_through_a_tensor_index(name, prompts, one_thread, monkeypatch):
    """What the GPU test above checks with CUDA's sync debugging, checked on a CPU by its cause: `t[idx] = 5`, a
    Python number written through a tensor index, is on a GPU a blocking copy from the host that synchronises the
    stream (torch 2.11), so the host could no longer run ahead of the device. No batched step, mixed or not, may do it."""
    import traceback

    method, capacity = methods()[name]
    real, found = torch.Tensor.__setitem__, []

    def spy(self, index, value):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) for p in parts) and isinstance(value, (int, float, bool)):
            found.append("".join(traceback.format_stack(limit=3)[:-1]))
        return real(self, index, value)

    model = build("llama3")
    for mix in (False, True):
        scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static",
                              mix=mix, launch_ahead=True)
        requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
        monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
        run_all(scheduler, requests)
        monkeypatch.undo()
        assert found == [], found[0]
        assert scheduler.report["ahead_steps"] > 0


@pytest.mark.parametrize("name", ["streaming", "h2o", "tova", "cam", "roco", "full"])
def test_a_decode_only_step_reads_nothing_back_but_the_tokens_it_hands_over(name, prompts, one_thread, monkeypatch):
    """On a GPU a tensor read into Python (`item`, `tolist`, `bool`, `int`, `float`) waits for the device. In a run of
    decode-only steps the one read is the hand-over's, of the staged copy of the tokens (`TokenOutbox.drain`); any
    other would keep the host from running ahead."""
    import traceback

    method, capacity = methods()[name]
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
    reads: list[str] = []

    def spy(real):
        def read(self, *args, **kwargs):
            reads.append("".join(traceback.format_stack(limit=3)[:-1]))
            return real(self, *args, **kwargs)
        return read

    scheduler = Scheduler(kvpot.Engine(build("llama3"), method=method), slots=3, capacity=capacity, decode="static",
                          launch_ahead=True)
    requests = [Request(c, q, max_new_tokens=2 * NEW, ignore_eos=True) for c, q in prompts[:3]]
    for request in requests:
        scheduler.submit(request)
    while any(r.status != "decoding" for r in requests):
        scheduler.step()
    for attr in names:
        monkeypatch.setattr(torch.Tensor, attr, spy(getattr(torch.Tensor, attr)))
    before = scheduler.report["ahead_steps"]
    for _ in range(NEW):
        scheduler.step()
    monkeypatch.undo()
    assert scheduler.report["ahead_steps"] - before == NEW  # every one of them launched ahead
    assert reads and all("in drain" in where and "tokens.tolist()" in where for where in reads), reads


def test_steps_ahead_off_by_default_on_a_cpu_and_the_value_checked():
    assert resolve_launch_ahead("auto", torch.device("cpu"), False) is False
    assert resolve_launch_ahead("auto", torch.device("cuda"), False) is True
    assert resolve_launch_ahead("auto", torch.device("cuda"), True) is False  # tensor parallelism: lockstep ranks
    assert resolve_launch_ahead("on", torch.device("cpu"), False) is True
    assert resolve_launch_ahead(False, torch.device("cuda"), False) is False
    assert resolve_launch_ahead(True, torch.device("cpu"), False) is True
    with pytest.raises(KvpotError, match="tensor parallelism"):
        resolve_launch_ahead("on", torch.device("cuda"), True)
    with pytest.raises(KvpotError, match="launch_ahead must be one of"):
        resolve_launch_ahead("sometimes", torch.device("cpu"), False)
    scheduler = Scheduler(kvpot.Engine(build("llama3"), method=kvpot.StreamingLLM(sinks=4, window=44)), slots=2)
    assert scheduler.launch_ahead is False


# ---------------------------------------------------------------- the decision, without a model
class _Cache:
    attention, policy = None, SimpleNamespace(kernel_decoding=True)

    def __init__(self, plan: str):
        self.plan = plan


def _scheduler(rows: list[dict], waiting: int = 0, free: int = 0, in_flight: bool = True):
    """A scheduler's facts `ahead_rows` reads: rows of (status, plan, tokens, max_new_tokens, feeding, cancelled)."""
    active, outbox = {}, TokenOutbox()
    for slot, row in enumerate(rows):
        request = SimpleNamespace(id=slot, status=row.get("status", "decoding"), tokens=[0] * row.get("tokens", 0),
                                  max_new_tokens=row.get("max_new_tokens", 8), cancel_requested=row.get("cancel", False))
        active[slot] = SimpleNamespace(request=request, feeding=row.get("feeding"),
                                       run=SimpleNamespace(cache=_Cache(row.get("plan", "append"))))
    if in_flight:  # the previous step staged a token for every decoding row
        staged = [a.request for a in active.values() if a.feeding is None and a.request.status == "decoding"]
        outbox.pending.append((list(range(len(staged))), staged, None, None))
    return SimpleNamespace(outbox=outbox, waiting=[object()] * waiting, pool=SimpleNamespace(free=list(range(free))),
                           active=active, agreement=SimpleNamespace(cancels=lambda r: r.cancel_requested),
                           batched=True, steady_ok=True, append_ok=True, sequence_steps=False,
                           method=SimpleNamespace(decode_plan=lambda cache: cache.plan))


def _slots(found) -> list[int] | None:
    return None if found is None else [slot for slot, _ in found[0]]


def test_a_step_goes_ahead_only_where_its_whole_plan_is_known_before_the_hand_over():
    rows = [{"plan": "append"}, {"plan": "steady"}, {"feeding": [5, 6], "status": "prefilling"}]
    assert _slots(ahead_rows(_scheduler(rows))) == [0, 1, 2]
    assert ahead_rows(_scheduler(rows))[1] == {0: "append", 1: "steady", 2: "append"}
    assert ahead_rows(_scheduler(rows, in_flight=False)) is None  # nothing in flight: nothing to hide
    assert ahead_rows(_scheduler(rows, waiting=1, free=1)) is None  # a request takes a free slot first
    assert _slots(ahead_rows(_scheduler(rows, waiting=1, free=0))) == [0, 1, 2]  # no slot for it anyway
    assert ahead_rows(_scheduler(rows + [{"status": "prefilling"}])) is None  # a prompt being read
    assert ahead_rows(_scheduler(rows + [{"cancel": True}])) is None  # a cancellation, at the step boundary
    assert ahead_rows(_scheduler(rows + [{"plan": "eager"}])) is None  # a distillation waits for the hand-over
    # a row whose staged token is its last ends at the hand-over: left out (here 7 delivered + 1 staged = 8)
    assert _slots(ahead_rows(_scheduler(rows + [{"tokens": 7, "max_new_tokens": 8}]))) == [0, 1, 2]
    assert _slots(ahead_rows(_scheduler(rows + [{"tokens": 6, "max_new_tokens": 8}]))) == [0, 1, 2, 3]
    assert ahead_rows(_scheduler([{"tokens": 7, "max_new_tokens": 8}])) is None  # nothing left to step


def test_a_pool_of_ones_rows_the_batched_step_cannot_take_step_as_one_sequence_and_go_ahead():
    """`row_plan` in a pool of one (`sequence_steps`): a method's own attention, an observation without a batched form
    and every steady row (its eviction captured at its counts) take the one-sequence step (`SEQUENCE_PLANS`), which
    launches ahead as a batched step does; a shape change stays "eager"; in a larger pool they are "eager", and a
    steady row the batched step's."""
    from kvpot.engine.plan import row_plan

    own = _Cache("append")
    own.attention, own.policy = object(), SimpleNamespace(kernel_decoding=False)
    for pool_of_one in (True, False):
        scheduler = _scheduler([{"plan": "append"}])
        scheduler.sequence_steps = pool_of_one
        assert row_plan(scheduler, own) == ("sequence-append" if pool_of_one else "eager")
        assert row_plan(scheduler, _Cache("eager")) == "eager"
        scheduler.steady_ok = False
        assert row_plan(scheduler, _Cache("steady")) == ("sequence-steady" if pool_of_one else "eager")
        scheduler.steady_ok = True
        assert row_plan(scheduler, _Cache("steady")) == ("sequence-steady" if pool_of_one else "steady")
    scheduler = _scheduler([{"plan": "steady"}])
    scheduler.sequence_steps = True
    assert ahead_rows(scheduler)[1] == {0: "sequence-steady"}
