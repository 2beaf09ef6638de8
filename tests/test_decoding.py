"""Fixed-shape decoding (`kvpot.engine.decoding`): the same tokens as the eager loop, every method.

On a CPU the fixed-shape steps run uncaptured (`decode="static"`): they exercise the device-side
counts, the masked whole-buffer attention with RoPE applied on load, the per-token work of each
method in fixed shapes and the plans (append / steady / eager). The GPU tests capture them as
CUDA graphs (`decode="graph"`) and must give the eager path's tokens too.
"""

import shutil

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.engine.decoding import resolve_mode
from kvpot.errors import KvpotError

CONTEXT, QUESTION, NEW = 160, 6, 40


def methods():
    # budgets small enough that decoding crosses each method's shape events (distillations,
    # chunk evictions, per-token eviction at the budget)
    return {
        "full": kvpot.Full(chunk_size=64),
        "truncate": kvpot.Truncate(budget=96, chunk_size=32),
        "streaming": kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16),
        "streaming-short": kvpot.StreamingLLM(sinks=4, window=188, chunk_size=32),  # grows, then steady
        "h2o": kvpot.H2O(heavy=24, recent=24, chunk_size=16),
        "tova": kvpot.TOVA(budget=48, chunk_size=16),
        "snapkv": kvpot.SnapKV(budget=48, window=8, chunk_size=64),
        "infinipot": kvpot.InfiniPot(pot_size=64, catalyst=None),
        "citrus": kvpot.CItruS(keep=36, chunk_size=12, cache="none"),
        "d2o": kvpot.D2O(budget=40, chunk_size=64),
        "d2o-nomerge": kvpot.D2O(budget=40, chunk_size=64, merge=False, layer_budget=False),
        "pyramidkv": kvpot.PyramidKV(budget=48, window=8, beta=2, chunk_size=64),
        "scissorhands": kvpot.Scissorhands(budget=48, drop=16, history=12, chunk_size=16),  # eager when full
        "scissorhands-drop1": kvpot.Scissorhands(budget=48, drop=1, history=1, chunk_size=16),  # steady
        "roco": kvpot.RoCo(budget=48, chunk_size=16),
        "sirllm": kvpot.SirLLM(pot_size=64, decay=0.9, recent=4),
        "cam": kvpot.CaM(start=8, recent=40, chunk_size=16, merge_budget=8),
    }


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(1)
    return torch.randint(3, VOCAB, (CONTEXT,)), torch.randint(3, VOCAB, (QUESTION,))


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model(request):
    return build(request.param)


def generate(model, method, inputs, decode, **kw):
    context, question = inputs
    engine = kvpot.Engine(model, method=method, decode=decode, runner="sequence")
    return engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True, **kw)


@pytest.mark.parametrize("name", sorted(methods()))
def test_static_steps_give_the_eager_tokens(model, inputs, name, one_thread):
    eager = generate(model, methods()[name], inputs, "eager")
    static = generate(model, methods()[name], inputs, "static")
    assert static.token_ids == eager.token_ids
    assert static.stats.max_kv_entries == eager.stats.max_kv_entries
    assert static.stats.final_kv_entries == eager.stats.final_kv_entries
    assert static.stats.compressions == eager.stats.compressions
    report = static.stats.decode
    assert report["mode"] == "static" and report["static_steps"] + report["eager_steps"] == NEW - 1
    assert report["static_steps"] > 0  # the fixed-shape path really ran


@pytest.mark.parametrize("name,plans", [("streaming-short", {"append", "steady"}), ("infinipot", {"append", "eager"}),
                                        ("h2o", {"steady"}), ("full", {"append"}), ("citrus", {"append", "eager"})])
def test_each_method_plans_its_steps(model, inputs, name, plans, monkeypatch, one_thread):
    """The plans a method gives are the ones its eager behaviour implies (shape events run eagerly)."""
    method = methods()[name]
    seen = []
    original = type(method).decode_plan

    def spy(self, cache):
        plan = original(self, cache)
        seen.append(plan)
        return plan

    monkeypatch.setattr(type(method), "decode_plan", spy)
    generate(model, method, inputs, "static")
    assert set(seen) == plans


def test_static_decoding_holds_the_bound(model, inputs, one_thread):
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    out = generate(model, method, inputs, "static")
    assert out.stats.max_kv_entries <= method.max_entries()


def test_sampling_is_seeded_and_stays_in_the_nucleus(model, inputs, one_thread):
    method = kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16)
    a = generate(model, method, inputs, "static", temperature=0.8, top_p=0.9, seed=3)
    b = generate(model, method, inputs, "static", temperature=0.8, top_p=0.9, seed=3)
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == NEW
    # top_p this small leaves only the most likely token: sampling becomes greedy
    greedy = generate(model, method, inputs, "static")
    narrow = generate(model, method, inputs, "static", temperature=1.0, top_p=1e-6, seed=5)
    assert narrow.token_ids == greedy.token_ids


def test_eos_stops_static_decoding(model, inputs, one_thread):
    method = kvpot.Full(chunk_size=64)
    eager = generate(model, method, inputs, "eager")
    stop = eager.token_ids[5]
    model.generation_config.eos_token_id = stop
    try:
        context, question = inputs
        engine = kvpot.Engine(model, method=method, decode="static", runner="sequence")
        out = engine.generate_ids(context, question, max_new_tokens=NEW)
    finally:
        model.generation_config.eos_token_id = 2
    assert out.token_ids == eager.token_ids[: eager.token_ids.index(stop) + 1]


def test_streamed_tokens_arrive_in_order(model, inputs, one_thread):
    seen = []
    out = generate(model, kvpot.TOVA(budget=48, chunk_size=16), inputs, "static", )
    context, question = inputs
    engine = kvpot.Engine(model, method=kvpot.TOVA(budget=48, chunk_size=16), decode="static", runner="sequence")
    again = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True, on_token=seen.append)
    assert seen == again.token_ids == out.token_ids


def test_decode_modes_are_checked():
    assert resolve_mode("auto", torch.device("cpu")) == "eager"
    with pytest.raises(KvpotError, match="CUDA"):
        resolve_mode("graph", torch.device("cpu"))
    with pytest.raises(KvpotError, match="decode must be"):
        kvpot.Engine(build("llama3"), decode="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(methods()))
@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3"])
def test_graph_steps_give_the_eager_tokens_on_cuda(arch, name, inputs):
    model = build(arch).cuda()
    context, question = (t.cuda() for t in inputs)
    eager = generate(model, methods()[name], (context, question), "eager")
    graph = generate(model, methods()[name], (context, question), "graph")
    assert graph.token_ids == eager.token_ids
    assert graph.stats.max_kv_entries == eager.stats.max_kv_entries
    assert graph.stats.compressions == eager.stats.compressions
    assert graph.stats.decode["replays"] > 0 or graph.stats.decode["eager_steps"] == NEW - 1


@pytest.mark.gpu
def test_full_graph_decoding_equals_model_generate():
    from conftest import reference_greedy

    model = build("llama3").cuda()
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (200,), device="cuda")
    expected = reference_greedy(model, ids, NEW)
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=64), decode="graph", runner="sequence")
    out = engine.generate_ids(ids, max_new_tokens=NEW)
    assert out.token_ids == expected[: len(out.token_ids)]


def test_dynamic_rope_with_moving_positions_decodes_eagerly(inputs, one_thread):
    """`dynamic` RoPE has no fixed table to rotate keys from while loading them: shift-policy
    methods then take the ordinary step, and still give the eager tokens."""
    from conftest import ROPE_VARIANTS, build_llama

    model = build_llama(ROPE_VARIANTS["dynamic"])
    method = kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16)
    eager = generate(model, method, inputs, "eager")
    static = generate(model, method, inputs, "static")
    assert static.token_ids == eager.token_ids
    assert static.stats.decode["eager_steps"] == NEW - 1


def test_step_times_are_recorded_per_step(model, inputs, one_thread):
    for mode in ("eager", "static"):
        out = generate(model, kvpot.InfiniPot(pot_size=64, catalyst=None), inputs, mode, time_steps=True)
        times = out.stats.decode["step_ms"]
        assert len(times) == NEW - 1 and all(t > 0 for t in times)


def _counting_compile(monkeypatch) -> list:
    """torch.compile with a backend that counts the graphs dynamo hands it and runs them as traced."""
    graphs, real = [], torch.compile

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{**kw, "backend": backend}))
    return graphs


@pytest.mark.parametrize("name", ["streaming-short", "infinipot", "h2o"])
def test_a_compiled_step_compiles_once_and_gives_the_eager_tokens(model, inputs, name, monkeypatch, one_thread):
    # one compilation, of one decoder layer, for every layer, plan and length (kvpot.engine.regions): on a
    # GPU a recompile inside a graph capture would fail it (tests/test_compile_step.py: deeper models)
    torch._dynamo.reset()
    graphs = _counting_compile(monkeypatch)
    eager = generate(model, methods()[name], inputs, "eager")
    context, question = inputs
    engine = kvpot.Engine(model, method=methods()[name], decode="static", runner="sequence", compile_step=True)
    out = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    assert out.token_ids == eager.token_ids
    assert out.stats.decode["static_steps"] > 0
    assert len(graphs) == 1 and len(engine.decoder.layers) > 1
    assert engine.step_decoder() is engine.step_decoder() is not engine.decoder


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="inductor compiles C++ on a CPU and needs a C compiler")
def test_an_inductor_compiled_step_gives_the_eager_tokens(inputs, one_thread):
    # the real compiler (fused kernels, not the traced graph): greedy tokens through evictions at the budget,
    # one layer compiled for the four
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = build("llama3", num_hidden_layers=4)
    eager = generate(model, methods()["streaming-short"], inputs, "eager")
    context, question = inputs
    engine = kvpot.Engine(model, method=methods()["streaming-short"], decode="static", runner="sequence", compile_step=True)
    graphs = counters["stats"]["unique_graphs"]
    assert engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True).token_ids == eager.token_ids
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_compile_step_is_checked():
    with pytest.raises(KvpotError, match="compile_step"):
        kvpot.Engine(build("llama3"), compile_step="yes")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["streaming-short", "infinipot", "h2o", "full"])
def test_a_compiled_graph_step_gives_the_eager_tokens_on_cuda(name, inputs):
    torch._dynamo.reset()
    model = build("llama3").cuda()
    context, question = (t.cuda() for t in inputs)
    eager = generate(model, methods()[name], (context, question), "eager")
    engine = kvpot.Engine(model, method=methods()[name], decode="graph", runner="sequence", compile_step=True)
    out = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    assert out.token_ids == eager.token_ids
    assert out.stats.decode["replays"] > 0
