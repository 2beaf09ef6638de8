"""The mixed step in fixed shapes (`kvpot.engine.packed`): the body a CUDA graph replays, run uncaptured on a CPU.

Every request must get the tokens it gets alone (greedy, float32), on two architectures, whichever method's chunks
ride in the packed forward: methods whose chunks observe their attention (H2O every chunk, InfiniPot with its
question as the catalyst probe, SnapKV at the prompt's end), ranked positions (StreamingLLM), score arrays
(H2O, Scissorhands). Steps the packed form does not take (CItruS' instruction cache, Self-Extend's positions, a
method's own attention) fall back to the eager mixed step, with the same tokens.
"""

from __future__ import annotations

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.engine.offline import run_all
from kvpot.engine.packed import ROWS, PackedStep, token_bucket
from kvpot.engine.packed_cache import Meta
from kvpot.engine.scheduler import Request, Scheduler
from test_batch import NEW, alone, methods

PACKED = ["full", "truncate", "streaming", "h2o", "tova", "snapkv", "infinipot", "infinipot-question", "d2o",
          "pyramidkv", "scissorhands", "roco", "sirllm", "cam",
          "citrus-shared"]  # its chunks that ask for nothing; those probed by the instruction (over="cached") are eager
# the eager mixed step reads their chunks (CItruS' instruction cache, Self-Extend's positions), or none mixes
EAGER = ["citrus", "citrus-individual", "selfextend", "infinitehip", "infllm"]


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(1)
    lengths = (160, 90, 200, 33, 120)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in lengths]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model(request):
    return build(request.param)


def packed_run(model, method, prompts, capacity=None, prefill_tokens=4096):
    """A scheduler reading prompts in mixed steps, in fixed shapes (on a CPU: uncaptured; `fixed_mix` turns it on)."""
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="static", mix=True, prefill_tokens=prefill_tokens)
    scheduler.decoder.fixed_mix = True
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize("name", PACKED + EAGER)
def test_packed_steps_give_each_request_its_tokens_alone(model, prompts, name, one_thread):
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    scheduler, requests = packed_run(model, method, prompts, capacity)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert [r.stats.max_kv_entries for r in requests] == [e.stats.max_kv_entries for e in expected]
    assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected]
    assert scheduler.report["mixed_forwards"] > 0 or name not in PACKED
    packed = scheduler.decoder.packed
    steps = packed.steps if packed is not None else 0
    assert (steps > 0) is (name in PACKED)
    assert scheduler.pool.used == 0 and scheduler.idle


@pytest.mark.parametrize("name", ["h2o", "infinipot-question", "snapkv"])
def test_observing_chunks_take_the_packed_observation(model, prompts, name, one_thread, monkeypatch):
    """Chunks that observe their attention get it from the packed observation (one call a layer for all rows),
    and a small budget spreads the prompts over many packed steps without changing a token."""
    from kvpot.engine import packed_cache as module

    calls, original = [], module.observe_kernel
    monkeypatch.setattr(module, "observe_kernel", lambda *args: calls.append(args) or original(*args))
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    scheduler, requests = packed_run(model, method, prompts, capacity, prefill_tokens=48)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert calls and scheduler.decoder.packed.steps > 0


@pytest.mark.parametrize("name", ["infinipot", "d2o", "full"])
@pytest.mark.parametrize("fixed", [True, False], ids=["packed", "eager"])
def test_chunks_cut_to_fill_a_step_change_no_token(model, prompts, name, fixed, one_thread, monkeypatch):
    """A method whose chunks do not depend on where forwards end has the chunk that does not fit a step's budget cut
    to fill it (`plan_chunks`' `cut_to`): the same tokens, entries and compressions as alone, in both mixed steps."""
    from kvpot.engine.reading import PromptReader

    cuts, original = [], PromptReader.cut
    monkeypatch.setattr(PromptReader, "cut", lambda self, limit: cuts.append(limit) or original(self, limit))
    method, capacity = methods()[name]
    assert not method.chunk_dependent
    mixed_as_alone(model, prompts, method, capacity, fixed, budget=112)
    assert cuts and all(7 <= limit < 112 for limit in cuts)  # cut to what was left, never a sliver under 112 // 16


@pytest.mark.parametrize("fixed", [True, False], ids=["packed", "eager"])
def test_a_catalyst_fits_the_step_s_budget(model, prompts, fixed, one_thread, monkeypatch):
    """InfiniPot's catalyst rides in the forward that fills its pot: the plan counts its tokens against the step's
    budget (`Candidate.tail`), so a mixed step never carries more than the budget (on a GPU: never pads to the next
    token bucket), and every request keeps the tokens, entries and compressions it gets alone."""
    from kvpot.engine import mixed

    sizes, original = [], mixed.mixed_forward

    def forward(decoder, slots, live, observe, chunks):
        tails = [decoder.engine.method.tail_probe(c.run.cache, c.step) for c in chunks]
        sizes.append((sum(c.ids.numel() for c in chunks), sum(len(t[0]) for t in tails if t is not None)))
        return original(decoder, slots, live, observe, chunks)

    monkeypatch.setattr("kvpot.engine.scheduler.mixed_forward", forward)
    method, capacity = methods()["infinipot-question"]  # a pot of 64, its 5-token question as the catalyst
    mixed_as_alone(model, prompts, method, capacity, fixed, budget=40)
    assert all(chunk + tail <= 40 for chunk, tail in sizes), sizes
    assert any(tail and chunk + tail == 40 for chunk, tail in sizes)  # a catalyst in a step of a whole budget


@pytest.mark.parametrize("fixed", [True, False], ids=["packed", "eager"])
@pytest.mark.parametrize("name", ["infinipot", "infinipot-question", "scissorhands", "citrus"])
def test_rows_that_reshape_their_cache_ride_in_the_mixed_forward(model, prompts, name, fixed, one_thread):
    """A decoding row whose method reshapes its cache at this token (InfiniPot's pot filling, a cache filling to its
    budget) reads its token as a one-token chunk of its run in the step's mixed forward, its method's work after it,
    instead of a forward of its own between steps: the tokens, entries and compressions it gets alone."""
    method, capacity = methods()[name]
    scheduler = mixed_as_alone(model, prompts, method, capacity, fixed, budget=40)
    assert scheduler.report["riding_rows"] > 0 and scheduler.report["eager_rows"] == 0


def test_a_rider_that_fails_fails_alone(model, prompts, one_thread):
    """A riding row whose work after the mixed forward raises (its pick here) fails its own request; the others keep
    the tokens they get alone."""
    method, capacity = methods()["infinipot"]
    expected = alone(model, method, prompts)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static", mix=True,
                          prefill_tokens=40)
    rode, failed = scheduler.decoder.rode, []

    def rode_once(slot, run):
        if not failed:
            failed.append(slot)
            raise RuntimeError("a rider's pick broke")
        return rode(slot, run)

    scheduler.decoder.rode = rode_once
    requests = [scheduler.submit(Request(c, q, max_new_tokens=NEW, ignore_eos=True)) for c, q in prompts]
    scheduler.run()
    broken = [r for r in requests if r.status == "failed"]
    assert len(broken) == 1 and "a rider's pick broke" in broken[0].error
    assert all(r.tokens == e.token_ids for r, e in zip(requests, expected) if r.status != "failed")
    assert sum(r.status == "finished" for r in requests) == len(requests) - 1


def mixed_as_alone(model, prompts, method, capacity, fixed: bool, budget: int) -> Scheduler:
    """The prompts through a mixing scheduler (packed or eager mixed steps) at `budget` prompt tokens a step: each
    request's tokens, largest cache and compressions as alone. Returns the scheduler."""
    expected = alone(model, method, prompts)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=capacity, decode="static", mix=True,
                          prefill_tokens=budget)
    scheduler.decoder.fixed_mix = fixed
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert [r.stats.max_kv_entries for r in requests] == [e.stats.max_kv_entries for e in expected]
    assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected]
    return scheduler


def test_token_buckets_are_few_and_cover():
    assert [token_bucket(n) for n in (1, 64, 65, 200, 256, 257, 1088, 2048)] == [64, 64, 128, 256, 256, 512, 1280,
                                                                                 2048]
    sizes = {token_bucket(n) for n in range(1, 4097)}
    assert len(sizes) == 3 + 15  # 64, 128, then 256 .. 4,096 by 256


def test_meta_views_lay_out_one_buffer():
    meta = Meta(tokens=64, layers=3, device=torch.device("cpu"))
    host = meta.host()
    host.ids[:] = 7
    host.cached[2, ROWS] = 5
    host.mean[-1] = 1
    meta.buffer.copy_(host.buffer)
    assert meta.ids.tolist() == [7] * 64 and meta.cached[2, ROWS] == 5 and meta.mean[-1] == 1
    assert meta.buffer.numel() == 5 * 64 + 5 * ROWS + 1 + 3 * (ROWS + 1)
    assert meta.cached.shape == (3, ROWS + 1) and meta.starts.shape == (ROWS + 1,)


def test_what_the_packed_step_refuses(model, one_thread):
    """More chunks than `ROWS`, or an observation it cannot compute, go to the eager mixed step."""
    from types import SimpleNamespace

    from kvpot.attention import AttentionRequest
    from kvpot.engine.mixed import Chunk

    method, _ = methods()["h2o"]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static", mix=True)
    packed = PackedStep(scheduler.decoder)
    chunk = Chunk(SimpleNamespace(cache=scheduler.pool.cache(0)), torch.tensor([1, 2, 3]), None)
    assert packed.takes([chunk], [(None, None)])
    assert packed.takes([chunk], [(None, AttentionRequest(rows=(-2, None), row_reduce="mean"))])
    assert packed.takes([chunk], [((torch.tensor([4, 5]), AttentionRequest(rows=(-2, None))), None)])
    assert not packed.takes([chunk], [(None, AttentionRequest(head_reduce="max"))])
    assert not packed.takes([chunk], [(None, AttentionRequest(head_reduce="none"))])
    assert not packed.takes([chunk], [(None, AttentionRequest(over="cached"))])
    assert not packed.takes([chunk] * (ROWS + 1), [(None, None)] * (ROWS + 1))
    assert not packed.takes([], [])
    assert packed.usable
    other = Scheduler(kvpot.Engine(model, method=methods()["selfextend"][0]), slots=2, capacity=256, decode="static",
                      mix=True)
    other.decoder.graphs_on = True  # as on a GPU: nothing of a pool no step of which packs is captured ahead
    assert not PackedStep(other.decoder).usable and PackedStep(other.decoder).capture(64, True) == 0
    packed.ahead = 64  # captured ahead up to 64 tokens: a step that would need a larger bucket takes the eager step
    assert packed.takes([chunk], [((torch.arange(61), AttentionRequest(rows=(-61, None))), None)])
    assert not packed.takes([chunk], [((torch.arange(62), AttentionRequest(rows=(-62, None))), None)])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "streaming", "h2o", "infinipot-question", "snapkv", "d2o", "citrus"])
def test_captured_packed_steps_give_each_request_its_tokens_alone_on_cuda(name):
    """On a GPU the packed step is captured per key and replayed (float32, the Triton kernels: head dim 32), with a
    small prompt budget so that prompts are read over many steps beside the decoding rows."""
    from conftest import build_llama

    method, capacity = methods()[name]
    model = build_llama(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    gen = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen).cuda(), torch.randint(3, VOCAB, (5,), generator=gen)
                .cuda()) for n in (160, 90, 200, 33, 120)]
    expected = alone(model, method, prompts)
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="graph", mix=True, prefill_tokens=64)
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    packed = scheduler.decoder.packed
    if name == "citrus":  # its instruction cache: the eager mixed step
        assert packed is None or packed.steps == 0
    else:
        assert packed.steps > 0 and packed.graphs.replays > 0
    if name == "infinipot-question":  # rows whose pot filled rode in the captured steps, none stepped alone
        assert scheduler.report["riding_rows"] > 0 and scheduler.report["eager_rows"] == 0


class _Graphs:
    """`StepGraphs` on a CPU: each key's body runs once (its "warm-up"), then the key counts as captured."""

    def __init__(self):
        self.keys, self.captures, self.identity = [], 0, ()

    def __contains__(self, key):
        return key in self.keys

    def follow(self, identity):
        self.identity = identity

    def run(self, key, body):
        body()
        self.keys.append(key)
        self.captures += 1


def test_capturing_ahead_touches_no_request_and_covers_the_budget(model, prompts, one_thread):
    """`Scheduler.capture` also captures the packed step of every token bucket up to the budget (and one more, for a
    tail probe), observing or not where the method observes chunks. It runs on padding rows and tokens alone: the
    slots of requests being read or decoding keep every entry, count and position, and their tokens stay those alone."""
    method, _ = methods()["infinipot-question"]
    expected = alone(model, method, prompts[:3])
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=3, decode="static", mix=True, prefill_tokens=48)
    decoder = scheduler.decoder
    decoder.fixed_mix = True
    requests = [scheduler.submit(Request(c, q, max_new_tokens=NEW, ignore_eos=True)) for c, q in prompts[:3]]
    for _ in range(6):  # some read, some decoding
        scheduler.step()
    pool = scheduler.pool
    live = [slot for slot in range(pool.slots) if slot in scheduler.active]
    before = [(layer.keys[live].clone(), layer.values[live].clone(), layer.positions[live].clone(),
               layer.rope_positions[live].clone()) for layer in pool.layers]
    lengths, tokens = pool.lengths[:, live].clone(), decoder.last_token[live].clone()
    decoder.graphs_on = True  # capture's path, with the fake graphs above
    from kvpot.engine.packed import PackedStep

    decoder.packed = PackedStep(decoder)
    decoder.packed.graphs = fake = _Graphs()
    monkey = decoder.capture
    decoder.capture = lambda observes, steady=None: 0  # the decoding steps' own captures are tested elsewhere (test_graphs)
    assert scheduler.capture() == len(fake.keys) > 0
    decoder.capture, decoder.graphs_on = monkey, False
    sizes = sorted({key[1] for key in fake.keys})
    assert sizes[0] == 64 and sizes[-1] == token_bucket(48 + 256)
    assert {key[2] for key in fake.keys} == {False, True}  # InfiniPot's catalyst observes its chunk
    assert {key[0] for key in fake.keys} == {decoder.packed.rows_floor}
    for (keys, values, positions, rope_positions), layer in zip(before, pool.layers):
        assert torch.equal(keys, layer.keys[live]) and torch.equal(values, layer.values[live])
        assert torch.equal(positions, layer.positions[live]) and torch.equal(rope_positions, layer.rope_positions[live])
    assert torch.equal(lengths, pool.lengths[:, live]) and torch.equal(tokens, decoder.last_token[live])
    while not scheduler.idle:
        scheduler.step()
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]


@pytest.mark.gpu
def test_packed_steps_captured_ahead_replay_on_cuda():
    """`Scheduler.capture` on a GPU captures the packed steps ahead (a server's start); the requests then replay
    them, with their tokens alone (float32, head dim 32, InfiniPot with its catalyst probe)."""
    from conftest import build_llama

    method, _ = methods()["infinipot-question"]
    model = build_llama(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    gen = torch.Generator().manual_seed(2)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen).cuda(), torch.randint(3, VOCAB, (5,), generator=gen)
                .cuda()) for n in (160, 90, 200)]
    expected = alone(model, method, prompts)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, decode="graph", mix=True, prefill_tokens=64)
    assert scheduler.capture() > 0
    packed = scheduler.decoder.packed
    ahead = packed.graphs.captures
    assert ahead == 8  # token buckets 64, 128, 256, 512 (up to 64 + 256), observing or not
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert packed.steps > 0 and packed.graphs.replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["infinipot-question", "streaming"])
def test_compiled_packed_steps_give_each_request_its_tokens_alone_on_cuda(name, monkeypatch):
    """`packed.COMPILED` with `Engine(compile_step=True)`: the captured packed step runs the compiled decoder layer
    (warmed uncaptured per key, so no compilation falls inside a capture) and every request keeps its tokens alone.
    On a CPU (the PyTorch references, by hand: 73 s for 2 requests on 2 layers, too slow for CI) the tokens were equal."""
    from conftest import build_llama
    from kvpot.engine import packed as module

    monkeypatch.setattr(module, "COMPILED", True)
    method, capacity = methods()[name]
    model = build_llama(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    gen = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen).cuda(), torch.randint(3, VOCAB, (5,), generator=gen)
                .cuda()) for n in (160, 90, 200)]
    expected = alone(model, method, prompts)
    engine = kvpot.Engine(model, method=method, compile_step=True)
    scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="graph", mix=True, prefill_tokens=64)
    scheduler.capture()
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    packed = scheduler.decoder.packed
    assert packed.steps > 0 and packed.graphs.replays > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["infinipot-question", "streaming"])
def test_compiled_packed_steps_compile_nothing_new_once_every_form_was_seen(name, monkeypatch, one_thread):
    """`packed.COMPILED` on a CPU, with a compiler backend that runs each graph as traced: the packed step's chunk
    writes and chunk attention stay out of the compiled graphs (eager, `torch.compiler.disable`), and a second run of
    the same requests compiles nothing more. The rest of `PackedCache.attend` recompiled at every call while a new
    bound method sat on the stack at its graph break (136 recompilations on an H200)."""
    from conftest import build_llama
    from kvpot.engine import packed as module

    graphs, real = [], torch.compile

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": backend}))
    monkeypatch.setattr(module, "COMPILED", True)
    method, capacity = methods()[name]
    model = build_llama(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    gen = torch.Generator().manual_seed(3)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen), torch.randint(3, VOCAB, (5,), generator=gen))
               for n in (160, 90)]
    expected = [e.token_ids for e in alone(model, method, prompts)]
    scheduler = Scheduler(kvpot.Engine(model, method=method, compile_step=True), slots=3, capacity=capacity,
                          decode="static", mix=True, prefill_tokens=64)
    scheduler.decoder.fixed_mix = True
    try:
        compiled = []
        for _ in range(2):
            requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
            run_all(scheduler, requests)
            assert [r.tokens for r in requests] == expected
            compiled.append(len(graphs))
    finally:
        torch._dynamo.reset()
    assert scheduler.decoder.packed.steps > 0 and 0 < compiled[0] == compiled[1]
    traced = {frame for gm in graphs for n in gm.graph.nodes for frame in ("in _write_chunks", "in _attend_chunks")
              if frame in (n.meta.get("stack_trace") or "")}
    assert not traced


@pytest.mark.parametrize("budget", [96, 160])
def test_observing_chunks_go_first_when_the_buffer_holds_one(model, prompts, budget, one_thread, monkeypatch):
    """With room for one observing row (`OBSERVED_BYTES`, a slot of 128K entries on an 8B shape), a step's observing
    chunk is packed first whatever the plan's order, a step with two takes the eager step, and every request keeps
    its tokens alone."""
    from kvpot.engine import packed as module

    monkeypatch.setattr(module, "OBSERVED_BYTES", 1)
    moved, original = [], module.PackedStep.run

    def run(self, batch, observe, mode, chunks, probes):
        flags = [module._asked(probe) is None for probe in probes]
        moved.append(flags != sorted(flags))
        return original(self, batch, observe, mode, chunks, probes)

    monkeypatch.setattr(module.PackedStep, "run", run)
    method, capacity = methods()["infinipot-question"]
    expected = alone(model, method, prompts)
    scheduler, requests = packed_run(model, method, prompts, capacity, prefill_tokens=budget)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert scheduler.decoder.packed.observing_rows == 1 and scheduler.decoder.packed.observed.shape[1] == 1
    assert any(moved) and scheduler.decoder.packed.steps > 0  # some step's observing chunk came after another
