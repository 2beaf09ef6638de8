"""Regional compilation of the decoding step (`kvpot.engine.regions`, `Engine(compile_step=True)`).

The step compiles one decoder layer and runs every layer through it. The tests count what the
compiler is handed (a backend that records each graph and runs it as traced): one graph for every
layer and every step, whatever the depth, every layer's call going through it (none falls back to
eager), the eager path's tokens, and the user's model left as it was.
"""

from __future__ import annotations

import json

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.engine.batch import step_observations
from kvpot.engine.evict import steady_capture
from kvpot.engine.graphs import REPLAYED, WARMED, StepGraphs
from kvpot.engine.offline import run_all
from kvpot.engine.sampling import PICKING
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.errors import KvpotError

CONTEXT, QUESTION, NEW = 160, 6, 24


class Counting:
    """A torch.compile backend: the graphs dynamo hands it, and how often each compiled graph ran."""

    def __init__(self):
        self.graphs, self.runs = [], 0

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)

        def run(*args):
            self.runs += 1
            return gm.forward(*args)

        return run


@pytest.fixture
def counting(monkeypatch) -> Counting:
    torch._dynamo.reset()
    backend, real = Counting(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": backend}))
    yield backend
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(1)
    return torch.randint(3, VOCAB, (CONTEXT,)), torch.randint(3, VOCAB, (QUESTION,))


def generate(model, method, inputs, decode, **kw):
    engine = kvpot.Engine(model, method=method, decode=decode, runner="sequence", **kw)
    return engine.generate_ids(*inputs, max_new_tokens=NEW, ignore_eos=True)


def deep(arch: str, depth: int):
    return build(arch, num_hidden_layers=depth, layer_types=["full_attention"] * depth)


def streaming():
    return kvpot.StreamingLLM(sinks=4, window=172, chunk_size=32)  # appends, then evicts at every step


@pytest.mark.parametrize("depth", [2, 6])
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_one_compilation_serves_every_layer_and_step(arch, depth, inputs, counting, one_thread):
    model = deep(arch, depth)
    eager = generate(model, streaming(), inputs, "eager")
    out = generate(model, streaming(), inputs, "static", compile_step=True)
    assert out.token_ids == eager.token_ids
    steps = out.stats.decode["static_steps"]
    assert steps > 0 and out.stats.compressions > 0  # append steps and steady (evicting) steps
    assert len(counting.graphs) == 1  # one layer's graph, not one per layer nor per step kind
    assert counting.runs == depth * steps  # every layer of every step ran the compiled graph


def test_the_model_is_left_as_it_was(inputs, counting, one_thread):
    model = deep("llama3", 3)
    layers = model.get_decoder().layers
    before = generate(model, kvpot.InfiniPot(pot_size=64, catalyst=None), inputs, "static")
    compiled = generate(model, kvpot.InfiniPot(pot_size=64, catalyst=None), inputs, "static", compile_step=True)
    after = generate(model, kvpot.InfiniPot(pot_size=64, catalyst=None), inputs, "static")
    assert before.token_ids == compiled.token_ids == after.token_ids
    assert all(layer._compiled_call_impl is None for layer in layers)
    runs = counting.runs
    generate(model, kvpot.InfiniPot(pot_size=64, catalyst=None), inputs, "eager")
    assert counting.runs == runs  # nothing compiled runs outside a compiled engine's steps


def test_a_failing_step_still_restores_the_layers(inputs, counting, one_thread):
    model = build("llama3")
    engine = kvpot.Engine(model, method=kvpot.Full(), decode="static", runner="sequence", compile_step=True)
    with pytest.raises(KvpotError, match="compile_step"):
        engine.step_decoder()(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True)  # no kvpot cache
    assert all(layer._compiled_call_impl is None for layer in model.get_decoder().layers)


def test_batched_steps_share_the_compilation_and_give_the_tokens_alone(inputs, counting, one_thread):
    model = deep("llama3", 4)
    torch.manual_seed(2)
    prompts = [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in (90, 160)]
    alone = kvpot.Engine(model, method=kvpot.InfiniPot(pot_size=64, catalyst=None), decode="eager")
    expected = [alone.generate_ids(c, q, max_new_tokens=12, ignore_eos=True).token_ids for c, q in prompts]
    engine = kvpot.Engine(model, method=kvpot.InfiniPot(pot_size=64, catalyst=None), compile_step=True)
    scheduler = Scheduler(engine, slots=2, decode="static")
    requests = [Request(c, q, max_new_tokens=12, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    # one graph per batch size the steps ran at (1 and 2 rows: a recompile outside any capture)
    assert 1 <= len(counting.graphs) <= 2 and counting.runs > 0 and counting.runs % 4 == 0


@pytest.mark.slow
def test_a_method_whose_attention_indexes_by_layer_compiles_each_layer_and_none_runs_eagerly(inputs, counting,
                                                                                             one_thread):
    # InfLLM's fixed-shape attention reads its per-layer memory by `layer.layer_idx`: no shared compilation,
    # but every layer compiles (none past PyTorch's recompile limit, 8 by default, falls back to eager)
    depth = 9
    model = deep("llama3", depth)
    method = lambda: kvpot.InfLLM(initial=4, window=32, block_size=8, representatives=2, topk=3, lookup=16,  # noqa: E731
                                  chunk_size=32)
    eager = generate(model, method(), inputs, "eager")
    out = generate(model, method(), inputs, "static", compile_step=True)
    assert out.token_ids == eager.token_ids
    assert len(counting.graphs) >= depth
    assert counting.runs == depth * out.stats.decode["static_steps"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["streaming", "infinipot", "h2o"])
def test_a_compiled_graph_step_compiles_as_much_for_six_layers_as_for_two_on_cuda(name, inputs):
    # inductor for real, the step captured and replayed, the eager path's tokens; the compiled graphs (one,
    # or a few if the Triton attention's wrapper breaks the graph) do not grow with the depth
    from torch._dynamo.utils import counters

    method = {"streaming": streaming, "infinipot": lambda: kvpot.InfiniPot(pot_size=64, catalyst=None),
              "h2o": lambda: kvpot.H2O(heavy=24, recent=24, chunk_size=16)}[name]
    cuda_inputs = tuple(t.cuda() for t in inputs)
    graphs = {}
    for depth in (2, 6):
        torch._dynamo.reset()
        model = deep("llama3", depth).cuda()
        eager = generate(model, method(), cuda_inputs, "eager")
        before = counters["stats"]["unique_graphs"]
        out = generate(model, method(), cuda_inputs, "graph", compile_step=True)
        assert out.token_ids == eager.token_ids
        assert out.stats.decode["replays"] > 0
        graphs[depth] = counters["stats"]["unique_graphs"] - before
    assert 1 <= graphs[6] == graphs[2] < 6


@pytest.mark.gpu
def test_compiled_graph_batches_give_each_request_its_tokens_alone_on_cuda():
    torch._dynamo.reset()
    model = deep("llama3", 4).cuda()
    torch.manual_seed(2)
    prompts = [(torch.randint(3, VOCAB, (n,)).cuda(), torch.randint(3, VOCAB, (5,)).cuda()) for n in (90, 160, 40)]
    method = lambda: kvpot.H2O(heavy=24, recent=24, chunk_size=16)  # noqa: E731 - appends, then evicts per token
    alone = kvpot.Engine(model, method=method(), decode="eager")
    expected = [alone.generate_ids(c, q, max_new_tokens=24, ignore_eos=True).token_ids for c, q in prompts]
    scheduler = Scheduler(kvpot.Engine(model, method=method(), compile_step=True), slots=3, decode="graph")
    # as a server starts: every batch size captured ahead, with gradients on (kvpot.gemv has no backward)
    assert torch.is_grad_enabled() and scheduler.capture() > 0
    requests = [Request(c, q, max_new_tokens=24, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert scheduler.decoder.replays > 0


def test_bench_decode_compiles_the_step_and_reports_the_warm_up(capsys, tmp_path, counting, one_thread):
    from conftest import run

    out = tmp_path / "out"
    code, _, err = run(capsys, "bench", "decode", "--shape", "tiny", "--device", "cpu", "--out", str(out),
                       "--method", "infinipot", "--method", "streaming", "--budget", "128", "--lengths", "300",
                       "--decode-steps", "5", "--warmup-steps", "2", "--no-floor", "--decode", "static",
                       "--compile-step")
    assert code == 0, err
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["infinipot", "streaming"]
    # (the default runner, the core: its fixed-shape steps are batched steps of one row, or one-sequence steps)
    assert all(r["warmup_seconds"] > 0 and r["decode"]["batched_rows"] + r["decode"]["sequence_rows"] > 0 for r in rows)
    assert all(r["runner"] == "core" for r in rows)
    # at most one compilation per method (their steps read different things), none per layer: 4 layers a step
    assert 1 <= len(counting.graphs) <= len(rows) and counting.runs > 0 and counting.runs % 4 == 0


class CaptureOnCpu(StepGraphs):
    """`StepGraphs` on a CPU: a 'capture' runs the step for real and counts the compilations inside it (a
    compilation inside a CUDA graph capture fails on a GPU: inductor copies host tensors while it tunes)."""

    def __init__(self, counting: Counting):
        super().__init__()
        self.counting, self.compiled_in_capture = counting, 0

    def run(self, key, body, around=None):
        if key not in self.warm:
            body()
            self.warm.add(key)
            return WARMED, None
        if key not in self.graphs:
            before = len(self.counting.graphs)
            body()
            self.compiled_in_capture += len(self.counting.graphs) - before
            self.graphs[key] = (None, None)
            self.captures += 1
        self.replays += 1
        return REPLAYED, None


@pytest.mark.parametrize("name", ["h2o", "infinipot"])
def test_capturing_ahead_never_compiles_inside_a_capture(name, counting, one_thread):
    """A server captures every batch size before any request came (`Scheduler.capture`). The first warm-up
    makes the method's score arrays (H2O's) and the observation buffers; a capture after it would trace a
    different step and compile inside the capture (seen on an H100): the warm-up runs again instead."""
    method = kvpot.H2O(heavy=24, recent=24, chunk_size=16) if name == "h2o" else kvpot.InfiniPot(pot_size=64,
                                                                                                 catalyst=None)
    scheduler = Scheduler(kvpot.Engine(deep("llama3", 2), method=method, compile_step=True), slots=3, decode="static")
    graphs = scheduler.decoder.graphs = CaptureOnCpu(counting)
    scheduler.decoder.graphs_on = True
    captured = scheduler.capture()
    steady = steady_capture(method, scheduler.pool, None)  # H2O's steady rows evict inside their step: that form too
    assert (steady is not None) == (name == "h2o")
    forms = [(observe is not None, None) for observe in step_observations(method)]
    forms += [] if steady is None else [(steady[0] is not None, steady[1])]
    keys = {(bucket, observe, mode, evict) for bucket in scheduler.decoder.buckets for observe, evict in forms
            for mode in PICKING}
    assert captured == len(keys) and set(graphs.graphs) == keys
    assert len(counting.graphs) > 0 and graphs.compiled_in_capture == 0


@pytest.mark.parametrize("room", [None, 128], ids=["whole-slots", "tail-slots"])
@pytest.mark.parametrize("name", ["full", "infinipot"])
def test_shared_document_readers_through_the_compiled_step_get_the_copy_per_reader_tokens(name, room, counting,
                                                                                           one_thread):
    """`--share-documents --compile-step`: the compiled layer reads the shared region through the cache like any
    other step (no copy-on-write: a pot this large never fills), with the tokens of readers holding a copy each; with
    tail slots (`reader_room`) too, whose pool tensors are overlapping views of one arena."""
    model = deep("llama3", 2)
    make = {"full": kvpot.Full, "infinipot": lambda: kvpot.InfiniPot(pot_size=256, catalyst=None)}[name]
    context = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    questions = [torch.randint(3, VOCAB, (k,), generator=torch.Generator().manual_seed(k)).tolist() for k in (3, 6, 2)]
    state = kvpot.Engine(model, method=make(), decode="eager").prefill_ids(context)
    tokens, reports = {}, {}
    for share, compiled in ((False, False), (True, True)):
        scheduler = Scheduler(kvpot.Engine(model, method=make(), compile_step=compiled), slots=3, capacity=256,
                              decode="static", share_documents=share, reader_room=room if share else None)
        requests = [Request(None, q, state=state, max_new_tokens=12, ignore_eos=True) for q in questions]
        run_all(scheduler, requests)
        tokens[share], reports[share] = [r.tokens for r in requests], scheduler.report
    assert scheduler.pool.stride == room  # (the shared run's pool: tail slots where asked)
    assert tokens[True] == tokens[False]
    assert reports[True]["document_loads"] == 1 and reports[True]["copy_on_write"] == 0
    assert counting.graphs and counting.runs > 0  # the shared steps ran through the compiled layer
