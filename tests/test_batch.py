"""The batched engine (`kvpot.engine.scheduler`, `batch`, `pool`): many sequences at once.

On a CPU the batched steps run uncaptured (`decode="static"`) with the batched kernel's PyTorch
reference; the GPU test captures them as CUDA graphs with the Triton kernel. Every request of a
batch must give the tokens it gets alone (greedy), whatever shares the batch with it: prompts of
different lengths, more requests than slots (requests join while others decode, slots are reused),
each method's shape events (distillations, chunk evictions, per-token eviction at the budget).
"""

from __future__ import annotations

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.engine.evict import steady_capture
from kvpot.engine.offline import run_all
from kvpot.engine.sampling import PICKING
from kvpot.engine.scheduler import QueueFull, Request, Scheduler
from kvpot.engine.trace import StepTrace
from kvpot.errors import KvpotError

NEW = 24
LENGTHS = (160, 90, 200, 33, 120)


def methods():
    """name -> (method, slot capacity or None for the method's bound)."""
    return {
        "full": (kvpot.Full(chunk_size=64), 256),
        "truncate": (kvpot.Truncate(budget=96, chunk_size=32), 256),
        "streaming": (kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16), None),
        "h2o": (kvpot.H2O(heavy=24, recent=24, chunk_size=16), None),
        "tova": (kvpot.TOVA(budget=48, chunk_size=16), None),
        "snapkv": (kvpot.SnapKV(budget=48, window=8, chunk_size=64), 256),
        "infinipot": (kvpot.InfiniPot(pot_size=64, catalyst=None), None),
        "infinipot-question": (kvpot.InfiniPot(pot_size=64, catalyst="question"), None),
        "citrus": (kvpot.CItruS(keep=36, chunk_size=12, cache="none"), None),
        "citrus-shared": (kvpot.CItruS(keep=36, chunk_size=12, cache="shared"), None),
        "citrus-individual": (kvpot.CItruS(keep=36, chunk_size=12, cache="individual"), None),
        "d2o": (kvpot.D2O(budget=40, chunk_size=64), 256),
        "pyramidkv": (kvpot.PyramidKV(budget=48, window=8, beta=2, chunk_size=64), 256),
        "scissorhands": (kvpot.Scissorhands(budget=48, drop=16, history=12, chunk_size=16), None),
        "roco": (kvpot.RoCo(budget=48, chunk_size=16), None),
        "selfextend": (kvpot.SelfExtend(group_size=4, window=16, chunk_size=64), 256),
        "infllm": (kvpot.InfLLM(initial=4, window=32, block_size=8, representatives=2, topk=3, lookup=16,
                                chunk_size=32), 256),
        "infinitehip": (kvpot.InfiniteHiP(chunks=(16, 8, 4), keep=(64, 32, 16), sink=4, window=16, query_block=8,
                                          refresh=(4, 2, 1)), 256),
        "sirllm": (kvpot.SirLLM(pot_size=64, decay=0.9, recent=4), None),
        "cam": (kvpot.CaM(start=8, recent=40, chunk_size=16, merge_budget=8), None),
    }


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(1)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in LENGTHS]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model(request):
    return build(request.param)


def alone(model, method, prompts, new=NEW, **kw):
    engine = kvpot.Engine(model, method=method, decode="eager")
    return [engine.generate_ids(c, q, max_new_tokens=new, ignore_eos=True, **kw) for c, q in prompts]


def batched(model, method, prompts, slots=3, capacity=None, new=NEW, mix=False, **kw):
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=slots, capacity=capacity, decode="static", mix=mix)
    requests = [Request(c, q, max_new_tokens=new, ignore_eos=True, **kw) for c, q in prompts]
    run_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize("name", sorted(methods()))
def test_each_request_of_a_batch_gets_its_tokens_alone(model, prompts, name, one_thread):
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    _, mixed = batched(model, method, prompts, capacity=capacity, mix=True)  # prompt chunks beside the rows
    assert [r.tokens for r in mixed] == [e.token_ids for e in expected]
    scheduler, requests = batched(model, method, prompts, capacity=capacity)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert [r.stats.max_kv_entries for r in requests] == [e.stats.max_kv_entries for e in expected]
    assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected]
    assert all(r.status == "finished" and r.finish_reason == "length" for r in requests)
    assert scheduler.pool.used == 0 and scheduler.idle  # every slot came back
    report = scheduler.report
    assert report["batched_rows"] + report["eager_rows"] == len(prompts) * (NEW - 1)
    if name not in ("infinitehip", "infllm"):  # a method's sparse attention runs each row alone
        assert report["batched_rows"] > 0


@pytest.mark.parametrize("name", [n for n, (m, _) in methods().items() if m.batch_scores])
def test_scores_a_method_writes_in_batch_append_are_its_own_at_every_new_entry(model, prompts, name, monkeypatch,
                                                                             one_thread):
    """A method's `batch_scores` are not zeroed by the step's append (`StepLayer.update`): its `batch_append`
    writes every row's new entry. With each such array NaN past the live entries before every batched step, the
    new entries hold their token's score after it (the -log p the method was given) and the tokens are alone's."""
    from kvpot.engine import batch as batch_module

    method, capacity = methods()[name]
    expected = alone(model, method, prompts[:3])
    written = []
    step, end_rows = batch_module.BatchDecoder.step, batch_module.BatchDecoder.end_rows

    def poisoned(decoder, slots, *args, **kwargs):
        for layer, lengths in zip(decoder.pool.layers, decoder.pool.lengths):
            for name_ in method.batch_scores:
                for slot in slots:
                    layer.score(name_)[slot, :, int(lengths[slot]):] = float("nan")
        return step(decoder, slots, *args, **kwargs)

    def check(decoder, bucket, logits, mode, nll):
        end_rows(decoder, bucket, logits, mode, nll)
        rows = decoder.rows[:bucket]
        for layer, at in zip(decoder.pool.layers, decoder.cache.appended):
            heads = torch.arange(layer.kv_heads).view(1, -1)
            for name_ in method.batch_scores:
                written.append(layer.score(name_)[rows[:, None], heads, at[:, None]].isfinite().all().item())

    monkeypatch.setattr(batch_module.BatchDecoder, "step", poisoned)
    monkeypatch.setattr(batch_module.BatchDecoder, "end_rows", check)
    _, requests = batched(model, method, prompts[:3], capacity=capacity)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert written and all(written)


@pytest.mark.parametrize("name", ["full", "streaming", "infinipot", "h2o", "snapkv"])
def test_mixed_chunks_take_the_varlen_kernel(model, prompts, name, one_thread, monkeypatch):
    """A mixed step attends its prompt chunks over their pool slots in one varlen launch a layer
    (`MixedCache._varlen`), chunks that observe their attention included (H2O every chunk, InfiniPot at a pot's
    fill, SnapKV at the prompt's end): the path is taken, and the tokens stay those alone."""
    from kvpot.engine import mixed

    calls, original = [], mixed.varlen_kernel
    monkeypatch.setattr(mixed, "varlen_kernel", lambda *args: calls.append(args) or original(*args))
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    scheduler, requests = batched(model, method, prompts, capacity=capacity, mix=True)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert scheduler.report["mixed_forwards"] > 0
    assert calls


@pytest.mark.parametrize("name", ["streaming", "infinipot", "citrus", "h2o", "sirllm", "cam"])
def test_the_bound_holds_in_every_slot_at_every_step(model, prompts, name, one_thread):
    method, _ = methods()[name]
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=2, decode="static")
    addresses = [layer.keys.data_ptr() for layer in scheduler.pool.layers]
    requests = [scheduler.submit(Request(c, q, max_new_tokens=NEW, ignore_eos=True)) for c, q in prompts]
    while not scheduler.idle:
        scheduler.step()
        for slot, active in scheduler.active.items():
            counts = [layer.n for layer in active.run.cache.layers]
            assert max(counts) <= method.max_entries()
            # the device-side counts the batched step reads follow the host's (set when decoding starts)
            if active.request.status == "decoding":
                assert scheduler.pool.lengths[:, slot].tolist() == counts
    assert [layer.keys.data_ptr() for layer in scheduler.pool.layers] == addresses  # the pool never grew
    assert all(r.stats.max_kv_entries <= method.max_entries() for r in requests)


def test_many_readers_of_one_state_leave_it_unchanged(model, prompts, one_thread):
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(prompts[0][0])
    before = [layer.keys[:, :, : layer.n].clone() for layer in state.cache.layers]
    questions = [torch.randint(3, VOCAB, (k,)).tolist() for k in (3, 5, 7, 4, 6)]
    expected = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True).token_ids
                for q in questions]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=4, decode="static")
    requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in questions]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert all(torch.equal(a, layer.keys[:, :, : layer.n]) for a, layer in zip(before, state.cache.layers))


@pytest.mark.parametrize("name", ["full", "truncate", "infinipot", "sirllm"])
def test_questions_fed_through_the_decoding_steps_give_the_tokens_alone(model, prompts, name, one_thread):
    """Questions asked of a stored state, read one token per batched step among the decoding rows
    (`feed_questions`), give each request its tokens alone; with InfiniPot some questions fill the pot
    while fed (that token distils in an eager step), so compressions must match as well."""
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(prompts[4][0])
    questions = [torch.randint(3, VOCAB, (k,)).tolist() for k in (3, 40, 7, 1, 25)]
    expected = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True)
                for q in questions]
    for feed in ("always", "never", "auto"):
        scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static",
                              feed_questions=feed, feed_tokens=32)
        requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in questions]
        run_all(scheduler, requests)
        assert [r.tokens for r in requests] == [e.token_ids for e in expected], feed
        assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected], feed
        assert [r.stats.max_kv_entries for r in requests] == [e.stats.max_kv_entries for e in expected], feed
        fed = sum(len(q) for q in questions if len(q) <= 32)  # the 40-token question is read in a forward
        assert scheduler.report["fed_tokens"] == (0 if feed == "never" else fed), feed
        assert scheduler.pool.used == 0 and scheduler.idle
    # mixing, not fed ("auto" too: a chunk of the mixed forward beside the decoding rows, not a step a token)
    for feed in ("never", "auto"):
        scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static",
                              feed_questions=feed, mix=True)
        requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in questions]
        run_all(scheduler, requests)
        assert [r.tokens for r in requests] == [e.token_ids for e in expected], feed
        assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected], feed
        assert scheduler.report["fed_tokens"] == 0 and scheduler.report["mixed_forwards"] > 0, feed
    if name == "infinipot":
        assert any(e.stats.compressions for e in expected)  # a question did fill the pot


@pytest.mark.parametrize("name", ["full", "infinipot", "sirllm"])
def test_fed_questions_beside_mixed_prompts_give_the_tokens_alone(model, prompts, name, one_thread):
    """What `kvpot serve --feed-questions always` runs on a GPU when a server has readers of a stored document and fresh
    prompts at once: questions fed one token a step among the decoding rows while other prompts' chunks join the same
    forward (with "auto", mixing, each question is a chunk of that forward instead)."""
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(prompts[4][0])
    questions = [torch.randint(3, VOCAB, (k,)).tolist() for k in (3, 40, 7, 1, 25)]
    expected = [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True).token_ids for c, q in prompts[1:3]]
    expected += [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True).token_ids
                 for q in questions]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=4, capacity=capacity, decode="static",
                          feed_tokens=32, mix=True, prefill_tokens=48, feed_questions="always")
    scheduler.trace = StepTrace()
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts[1:3]]
    requests += [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in questions]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert any(step["fed_tokens"] and step["mixed_forwards"] for step in scheduler.trace.steps)  # in one forward


@pytest.mark.parametrize("name", ["streaming", "infinipot", "infinipot-question", "citrus-shared", "d2o", "snapkv",
                                  "infinitehip"])
def test_prompts_read_inside_the_decoding_forward_give_the_tokens_alone(model, prompts, name, one_thread):
    """Prompt chunks packed into the decoding rows' forward (`kvpot.engine.mixed`) leave every request the
    tokens it gets alone and with forwards of their own, in fewer model forwards; tail probes (InfiniPot's
    catalyst at a pot's fill, CItruS' instruction) ride in their chunk's part. InfiniteHiP's own attention
    keeps its forwards."""
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    runs = {}
    for mix in (True, False):
        engine = kvpot.Engine(model, method=method)
        scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="static", mix=mix, prefill_tokens=64)
        requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
        run_all(scheduler, requests)
        assert [r.tokens for r in requests] == [e.token_ids for e in expected]
        runs[mix] = (scheduler.report["mixed_forwards"], scheduler.report["forwards"])
    assert runs[False][0] == 0
    default = Scheduler(kvpot.Engine(model, method=method), slots=1, capacity=capacity, decode="static")
    assert default.mix is False  # mix="auto": apart on a CPU (no varlen kernel)
    if name == "infinitehip":  # its own attention: never mixed
        assert runs[True] == runs[False]
    else:
        assert runs[True][0] > 0 and runs[True][1] < runs[False][1], runs


def test_a_question_alone_is_read_in_one_forward(model, prompts, one_thread):
    """`feed_questions="auto"` feeds only when others share the steps: alone, one forward answers sooner."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    state = kvpot.Engine(model, method=method, decode="eager").prefill_ids(prompts[0][0])
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static")
    run_all(scheduler, [Request(None, [5, 6, 7], state=state, max_new_tokens=4, ignore_eos=True)])
    assert scheduler.report["fed_tokens"] == 0 and scheduler.report["prefill_forwards"] == 1
    with pytest.raises(KvpotError, match="feed_questions"):
        Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static", feed_questions="sometimes")


def test_a_cancelled_request_frees_its_slot_and_changes_nothing_else(model, prompts, one_thread):
    method = kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16)
    expected = alone(model, method, prompts)
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=2, decode="static")
    requests = [scheduler.submit(Request(c, q, max_new_tokens=NEW, ignore_eos=True)) for c, q in prompts]
    victim = requests[1]
    while len(victim.tokens) < 3:
        scheduler.step()
    scheduler.cancel(victim)
    waiting = requests[4]
    scheduler.cancel(waiting)  # still queued: never takes a slot
    scheduler.run()
    assert victim.status == "cancelled" and victim.finish_reason == "cancelled"
    assert waiting.status == "cancelled" and waiting.tokens == [] and waiting.slot is None
    for index in (0, 2, 3):
        assert requests[index].tokens == expected[index].token_ids
    assert scheduler.pool.used == 0


def test_a_failing_request_fails_alone(model, prompts, one_thread):
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    expected = alone(model, method, prompts)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, decode="static")

    def explode(request, token):
        if len(request.tokens) == 4:
            raise RuntimeError("the client's callback broke")

    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True, on_token=explode if i == 2 else None)
                for i, (c, q) in enumerate(prompts)]
    for request in requests:
        scheduler.submit(request)
    scheduler.run()
    assert requests[2].status == "failed" and "callback broke" in requests[2].error
    assert [requests[i].tokens for i in (0, 1, 3, 4)] == [expected[i].token_ids for i in (0, 1, 3, 4)]
    assert scheduler.pool.used == 0


def test_an_error_inside_a_running_batch_fails_its_request_alone(model, prompts, one_thread):
    """Whatever a request's own work raises while others decode beside it (here its first pick, after its
    prompt was read, and a fed question's first pick) ends that request with an error and nothing else."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    expected = alone(model, method, prompts)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, decode="static")
    start = scheduler.decoder.start

    def start_or_break(slot, logits, position, temperature, top_p, seed, remaining):
        if seed == 77:  # the victim's seed: an error no kvpot code raises on purpose
            raise OverflowError("injected inside a running batch")
        return start(slot, logits, position, temperature, top_p, seed, remaining)

    scheduler.decoder.start = start_or_break
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    requests[3] = Request(*prompts[3], max_new_tokens=NEW, ignore_eos=True, seed=77, temperature=1.0)
    for request in requests[:3]:
        scheduler.submit(request)
    while not any(r.tokens for r in requests[:3]):
        scheduler.step()
    for request in requests[3:]:  # joins while the first three decode
        scheduler.submit(request)
    scheduler.run()
    assert requests[3].status == "failed" and "injected" in requests[3].error
    assert [requests[i].tokens for i in (0, 1, 2, 4)] == [expected[i].token_ids for i in (0, 1, 2, 4)]
    assert scheduler.pool.used == 0


def test_seeds_take_64_bits_and_are_refused_beyond(model, prompts, one_thread):
    """A seed is any integer that 64 bits hold (as torch's generators take them); the unsigned half maps onto
    the batched sampler's int64 with the same bits. Beyond, the request is refused before it is queued."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    engine = kvpot.Engine(model, method=method)
    sampling = dict(max_new_tokens=8, ignore_eos=True, temperature=1.0)
    top, bits = Request(*prompts[0], seed=2**64 - 1, **sampling), Request(*prompts[0], seed=-1, **sampling)
    run_all(Scheduler(engine, slots=2, decode="static"), [top, bits])
    assert top.status == bits.status == "finished" and top.tokens == bits.tokens
    for seed in (2**64, -(2**63) - 1, 1.5, True):
        with pytest.raises(KvpotError, match="seed must be an integer"):
            Request(*prompts[0], seed=seed)
        with pytest.raises(KvpotError, match="seed must be an integer"):
            engine.generate_ids(*prompts[0], max_new_tokens=2, seed=seed)
    assert len(engine.generate_ids(*prompts[0], max_new_tokens=2, temperature=1.0, seed=2**64 - 1).token_ids) == 2


def test_refusals_are_clear(model, prompts, one_thread):
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=64))
    with pytest.raises(KvpotError, match="grows with the input"):
        Scheduler(engine, slots=2)
    scheduler = Scheduler(engine, slots=1, capacity=100, max_waiting=1, decode="static")
    with pytest.raises(KvpotError, match="more than a slot holds"):
        scheduler.submit(Request(prompts[0][0], prompts[0][1], max_new_tokens=8))
    short = prompts[3]
    scheduler.submit(Request(short[0], short[1], max_new_tokens=4))
    scheduler.step()  # takes the slot
    scheduler.submit(Request(short[0], short[1], max_new_tokens=4))  # waits
    with pytest.raises(QueueFull, match="retry later"):
        scheduler.submit(Request(short[0], short[1], max_new_tokens=4))
    other = kvpot.Engine(model, method=kvpot.InfiniPot(pot_size=64, catalyst=None))
    state = other.prefill_ids(short[0])
    with pytest.raises(KvpotError, match="prefilled with"):
        scheduler.submit(Request(None, short[1], state=state))
    with pytest.raises(KvpotError, match="exactly one"):
        Request(short[0], state=state)
    with pytest.raises(KvpotError, match="max_new_tokens"):
        Request(short[0], max_new_tokens=-1)
    with pytest.raises(KvpotError, match="fixed-shape"):
        Scheduler(engine, slots=1, capacity=100, decode="eager")


def test_sampling_depends_on_the_seed_not_on_the_batch(model, prompts, one_thread):
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    sampling = dict(temperature=0.8, top_p=0.9)
    engine = kvpot.Engine(model, method=method)
    alone_run = [Request(*prompts[0], max_new_tokens=NEW, ignore_eos=True, seed=5, **sampling)]
    run_all(Scheduler(engine, slots=1, decode="static"), alone_run)
    crowd = [Request(c, q, max_new_tokens=NEW, ignore_eos=True, seed=5 if i == 0 else i, **sampling)
             for i, (c, q) in enumerate(prompts)]
    crowd[3] = Request(*prompts[3], max_new_tokens=NEW, ignore_eos=True)  # a greedy row beside sampled ones
    run_all(Scheduler(engine, slots=3, decode="static"), crowd)
    assert crowd[0].tokens == alone_run[0].tokens
    assert crowd[3].tokens == alone(model, method, [prompts[3]])[0].token_ids
    assert crowd[1].tokens != crowd[2].tokens


@pytest.mark.parametrize("name", ["streaming", "h2o", "infinipot", "citrus", "d2o", "infllm", "infinitehip"])
def test_a_seeded_request_samples_the_same_tokens_alone_and_batched(model, prompts, name, one_thread):
    """One sampler for both paths (`pick_rows`; alone as a batch of one row): the same seed draws the same tokens
    through `generate_ids` (eager and fixed-shape steps) as in a batch beside other requests, greedy rows among
    them; each request has its own seed and top_p."""
    method, capacity = methods()[name]
    options = [dict(temperature=0.9, top_p=0.95, seed=11 + i) for i in range(len(prompts))]
    options[1] = dict(temperature=0.0)  # a greedy row among sampled ones
    options[2] = dict(temperature=1.1, seed=5)  # a whole-distribution row (top_p 1): no nucleus alone
    engine = kvpot.Engine(model, method=method, decode="eager")
    eager = [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True, **o).token_ids
             for (c, q), o in zip(prompts, options)]
    steps = kvpot.Engine(model, method=method, decode="static")
    assert steps.generate_ids(*prompts[0], max_new_tokens=NEW, ignore_eos=True, **options[0]).token_ids == eager[0]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static")
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True, **o) for (c, q), o in zip(prompts, options)]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == eager
    assert eager[0] != alone(model, method, prompts[:1])[0].token_ids  # it sampled: not the greedy tokens


def test_eos_and_stop_tokens_end_a_request(model, prompts, one_thread):
    method = kvpot.TOVA(budget=48, chunk_size=16)
    expected = alone(model, method, prompts[:2])
    stop = expected[0].token_ids[5]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static")
    requests = [Request(*prompts[0], max_new_tokens=NEW, stop_token_ids=(stop,), ignore_eos=True),
                Request(*prompts[1], max_new_tokens=NEW, ignore_eos=True)]
    run_all(scheduler, requests)
    first = expected[0].token_ids
    assert requests[0].tokens == first[: first.index(stop) + 1] and requests[0].finish_reason == "stop"
    assert requests[1].tokens == expected[1].token_ids


def test_generate_batch_answers_texts_in_order(one_thread):
    engine = kvpot.Engine.from_pretrained(kvpot.REFERENCE_MODEL, method=kvpot.InfiniPot(pot_size=256))
    contexts = ["The vault code is 4417. " * 20, "Ships leave at dawn. The harbour code is 9021. " * 12]
    questions = ["What is the vault code?", "What is the harbour code?"]
    expected = [engine.generate(c, q, max_new_tokens=12).text for c, q in zip(contexts, questions)]
    results = engine.generate_batch(contexts, questions, max_new_tokens=12)
    assert [r.text for r in results] == expected
    with pytest.raises(KvpotError, match="one question per prompt"):
        engine.generate_batch(contexts, questions[:1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(methods()))
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_graph_batches_give_each_request_its_tokens_alone_on_cuda(arch, name, prompts):
    model = build(arch).cuda()
    method, capacity = methods()[name]
    cuda_prompts = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts]
    expected = alone(model, method, cuda_prompts)
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="graph")
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in cuda_prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    if name not in ("infinitehip", "infllm"):  # their own attention (`cache.attention`): the scheduler steps
        assert scheduler.decoder.replays > 0  # their slots one at a time (`Scheduler._plan`), not in the graphs


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("name", ["infinipot", "streaming"])
def test_every_architecture_batches(arch, name, prompts, one_thread):
    model = build(arch)
    method, capacity = methods()[name]
    expected = alone(model, method, prompts[:3], new=12)
    _, requests = batched(model, method, prompts[:3], slots=2, capacity=capacity, new=12)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]


@pytest.mark.parametrize("name", ["infinipot", "infinipot-question", "full", "d2o", "citrus"])
def test_a_small_prefill_budget_changes_no_token(model, prompts, name, one_thread):
    """`prefill_tokens` caps forwards of chunk-invariant methods (InfiniPot, Full, D2O) and only spreads
    other methods' chunks over more steps: the tokens stay those of one request alone."""
    method, capacity = methods()[name]
    expected = alone(model, method, prompts[:3], new=12)
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=2, capacity=capacity, prefill_tokens=16, decode="static")
    requests = [Request(c, q, max_new_tokens=12, ignore_eos=True) for c, q in prompts[:3]]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    if not method.chunk_dependent:
        assert scheduler.report["prefill_forwards"] >= sum(len(c) + len(q) for c, q in prompts[:3]) // 16


@pytest.mark.gpu
def test_graphs_survive_a_longer_request_growing_the_rope_table(prompts):
    """A request at a far later stream position grows the RoPE table (absolute positions): the captured
    graphs are dropped with their memory pool and captured again, and tokens stay those alone."""
    model = build("llama3").cuda()
    method, capacity = methods()["snapkv"]
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=2, capacity=5000, decode="graph")
    short = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts[:2]]
    run_all(scheduler, [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in short])
    torch.manual_seed(3)
    long = [(torch.randint(3, VOCAB, (4500,)).cuda(), torch.tensor(prompts[0][1]).cuda())]
    expected = alone(model, method, long)
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in long]
    run_all(scheduler, requests)
    assert requests[0].tokens == expected[0].token_ids


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["streaming", "infinipot", "h2o"])
def test_graphs_captured_ahead_serve_every_batch_size(name, prompts):
    """`Scheduler.capture()` (what the server runs at its start) captures each batch size's step in each picking
    mode (greedy, sample, nucleus): the requests after it capture nothing and get their tokens alone."""
    model = build("llama3").cuda()
    method, capacity = methods()[name]
    cuda_prompts = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts]
    expected = alone(model, method, cuda_prompts)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="graph")
    captured = scheduler.capture()
    forms = len({r is None for r in (method.decode_request("append"), method.decode_request("steady"))})
    forms += steady_capture(method, scheduler.pool, None) is not None  # steady rows evicting inside the step
    assert captured == len(scheduler.decoder.buckets) * len(PICKING) * forms
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in cuda_prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert scheduler.decoder.captures == captured and scheduler.decoder.replays > 0


@pytest.mark.parametrize("name", sorted(methods()))
def test_a_slot_holds_no_more_score_arrays_than_its_bytes_count(prompts, name, one_thread):
    """The pool sizes itself from `slot_bytes`, which counts `Method.score_arrays` per entry: after a run,
    the score buffers the method made fit that count (RoCo keeps three, most others two or fewer)."""
    from kvpot.engine.slot_sizes import slot_bytes, slot_nbytes

    model = build("llama3")
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method)
    scheduler, _ = batched(model, method, prompts[:3], slots=2, capacity=capacity, new=8)
    made = max(len(layer.scores) for layer in scheduler.pool.layers)
    assert made <= method.score_arrays
    size = scheduler.capacity
    one = slot_nbytes(model.config, size, engine.head.weight.dtype, scores=1)
    none = slot_nbytes(model.config, size, engine.head.weight.dtype, scores=0)
    assert slot_bytes(engine, size) == none + method.score_arrays * (one - none) + 4 * model.config.vocab_size



def test_a_given_pool_size_is_checked_against_free_gpu_memory_once_for_library_and_server(monkeypatch):
    """`slot_count` is the one memory check of a pool: slots a caller (or `kvpot serve --max-slots`) gives must fit
    in `GIVEN_SLOTS_MEMORY_FRACTION` of the free GPU memory; a pool sized by itself takes `fraction` of it."""
    from types import SimpleNamespace

    from kvpot.defaults import GIVEN_SLOTS_MEMORY_FRACTION
    from kvpot.engine import slot_sizes as pool

    engine = kvpot.Engine(build("llama3"), method=kvpot.StreamingLLM(sinks=4, window=60))
    per_slot = pool.slot_bytes(engine, 64, torch.float32)
    free = 10 * per_slot
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 2 * free))
    on_gpu = SimpleNamespace(device=torch.device("cuda"), model=engine.model, method=engine.method, head=engine.head,
                             parallel=None)
    fits = int(free * GIVEN_SLOTS_MEMORY_FRACTION) // per_slot
    assert pool.slot_count(on_gpu, 64, fits, 256, 0.5, torch.float32) == fits
    with pytest.raises(KvpotError, match=f"{fits + 1} slots of 64 entries take"):
        pool.slot_count(on_gpu, 64, fits + 1, 256, 0.5, torch.float32)
    assert pool.slot_count(on_gpu, 64, None, 256, 0.5, torch.float32) == 5  # half the free memory
    assert pool.slot_count(on_gpu, 64, None, 3, 0.5, torch.float32) == 3  # at most max_slots
    assert pool.slot_count(engine, 64, None, 256, 0.5, torch.float32) == 8  # a CPU: 8


def test_a_place_is_given_back_however_a_request_ends(prompts, one_thread):
    """The scheduler's admission (`Scheduler.admission`): submit takes a place unless one is handed in or the
    request was admitted elsewhere; finished, cancelled (waiting or running), failed and aborted requests all
    give theirs back."""
    engine = kvpot.Engine(build("llama3"), method=kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16))
    scheduler = Scheduler(engine, slots=2, max_waiting=2, decode="static")
    taken = lambda: scheduler.admission.view().taken  # noqa: E731

    def new(new_tokens=4, **kw):
        return Request(*prompts[3], max_new_tokens=new_tokens, ignore_eos=True, **kw)

    def broken(request, token):
        raise RuntimeError("the consumer went away")

    finished, failed, cancelled = scheduler.submit(new()), scheduler.submit(new(on_token=broken)), scheduler.submit(new())
    held = scheduler.admission.take()  # a server's place, taken before its request was built
    running = scheduler.submit(new(50), place=held)
    assert taken() == 4
    with pytest.raises(QueueFull, match=r"all 2 slots are busy and 2 requests wait \(max_waiting 2\)"):
        scheduler.submit(new())
    scheduler.cancel(cancelled)  # still waiting
    scheduler.step()
    assert cancelled.status == "cancelled" and taken() == 3
    while not (finished.done and failed.done):
        scheduler.step()
    assert (finished.status, failed.status) == ("finished", "failed") and taken() == 1
    scheduler.cancel(running)  # holding a slot
    scheduler.run()
    held.release()  # its holder letting go too changes nothing
    assert running.status == "cancelled" and taken() == 0
    elsewhere = scheduler.submit(new(), admitted=True)  # another rank's admission: no place here
    assert taken() == 0
    mine = [scheduler.submit(new()), scheduler.submit(new())]
    scheduler.step()
    assert taken() == 2
    scheduler.abort(RuntimeError("a step broke"))
    assert all(r.status == "failed" for r in mine) and elsewhere.done and taken() == 0
    scheduler.submit(new())
    scheduler.abort()
    assert taken() == 0 and scheduler.admission.has_room()


def test_capturing_ahead_runs_without_gradients_as_steps_do(model, one_thread):
    """A server captures every batch size at its start, from its own code with gradients on; a compiled step
    traced with them on needs a backward kvpot's kernels do not have (seen on an H100 with --compile-step), so
    `capture` turns them off as `step` does."""
    method, capacity = methods()["infinipot"]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=2, capacity=capacity)
    seen = []
    scheduler.decoder.capture = lambda observes, steady=None: seen.append(torch.is_grad_enabled()) or 0
    assert torch.is_grad_enabled()
    scheduler.capture()
    assert seen == [False] and torch.is_grad_enabled()


def test_padding_rows_keep_position_zero(model, prompts, one_thread):
    """Padding rows (the scratch slot) are fed position 0 at every step, so a long-running server's padding never
    passes the RoPE table (keys stored rotated, `absolute`, rotate them by it)."""
    method, capacity = methods()["full"]
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=4, capacity=capacity, decode="static")
    requests = [scheduler.submit(Request(c, q, max_new_tokens=NEW, ignore_eos=True)) for c, q in prompts[:3]]
    padded = 0
    while not scheduler.idle:
        scheduler.step()
        padded += sum(1 for r in requests if r.status == "decoding") == 3  # a bucket of 4 for 3 rows
        assert scheduler.decoder.next_position[scheduler.pool.scratch] == 0
    assert padded > 0


@pytest.mark.parametrize("mix", [False, True], ids=["apart", "mixed"])
def test_shortest_prompts_first_reach_their_first_token_first_with_the_tokens_alone(mix, one_thread):
    """`prompt_order="shortest"`: of two prompts submitted together, the shorter is read first although it came
    second (by arrival the longer goes first, and so with no patience), in forwards of their own and in mixed steps;
    tokens equal alone."""
    model = build("llama3")
    torch.manual_seed(4)
    prompts = [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in (400, 60)]
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    expected = alone(model, method, prompts)
    firsts = {}
    for name, order, patience in (("arrival", "arrival", 10.0), ("shortest", "shortest", 10.0),
                                  ("shortest-patience-0", "shortest", 0.0)):
        scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, decode="static", mix=mix,
                              prefill_tokens=32, prompt_order=order, prompt_patience=patience)
        requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
        run_all(scheduler, requests)
        assert [r.tokens for r in requests] == [e.token_ids for e in expected], name
        firsts[name] = [r.first_token_time for r in requests]
    assert firsts["arrival"][0] < firsts["arrival"][1]  # the longer, older prompt was read first
    assert firsts["shortest"][1] < firsts["shortest"][0]  # the shorter passed it
    # no patience: the longer prompt's wait ran out at once, so it keeps its place
    assert firsts["shortest-patience-0"][0] < firsts["shortest-patience-0"][1]


def test_online_schedulers_read_the_shortest_prompt_first_and_offline_jobs_in_arrival_order(one_thread):
    """By default a `Scheduler` (the server's, the bench's) reads the prompt with the fewest tokens left first; an
    offline job (`generate_many`: generate_batch, eval, lm-eval) plans in arrival order, from the requests alone, so
    its step composition (bf16 tokens) cannot follow the clock. Tokens equal alone either way."""
    from kvpot.defaults import OFFLINE_PROMPT_ORDER, PROMPT_ORDER, PROMPT_PATIENCE
    from kvpot.engine.offline import generate_many

    assert (PROMPT_ORDER, PROMPT_PATIENCE, OFFLINE_PROMPT_ORDER) == ("shortest", 4.0, "arrival")
    model = build("llama3")
    torch.manual_seed(4)
    prompts = [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in (400, 60)]
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    expected = [e.token_ids for e in alone(model, method, prompts)]
    online = Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static", prefill_tokens=32)
    assert (online.prompt_order, online.prompt_patience) == ("shortest", 4.0)
    served = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(online, served)
    offline = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    generate_many(kvpot.Engine(model, method=method), offline, batch_size=2, decode="static")
    assert [r.tokens for r in served] == [r.tokens for r in offline] == expected
    assert served[1].first_token_time < served[0].first_token_time  # the shorter, younger prompt first
    assert offline[0].first_token_time < offline[1].first_token_time  # the older first
