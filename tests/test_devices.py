"""Models split by accelerate (`device_map`): every method gives the tokens of the undispatched model.

On CPU the dispatch is real: accelerate's hooks run (`force_hooks`), and in the offloaded variant
some layers' weights rest on the `meta` device and are read from disk at each call, so nothing
may assume a parameter's device is where a module runs. With two GPUs, the same check splits the
layers over both, and each layer's cache must sit on its layer's GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.errors import KvpotError
from kvpot.models.devices import (
    execution_device,
    input_device,
    layer_devices,
    model_devices,
    output_device,
    parse_max_memory,
)

accelerate = pytest.importorskip("accelerate")

LAYERS = 4
CONTEXT, QUESTION, NEW = 120, 6, 6
# methods whose state crosses layers or runs extra forwards: also run with layers offloaded to disk
OFFLOADED = ("infinipot", "citrus-individual", "d2o", "infinitehip")


def every_method() -> list[kvpot.Method]:
    """Each method with sizes small enough that it compresses (or prunes) within CONTEXT tokens,
    in few forwards (a shared 2-core machine runs these)."""
    return [
        kvpot.Full(chunk_size=64),
        kvpot.Truncate(budget=64, chunk_size=32),
        kvpot.StreamingLLM(sinks=4, window=36, chunk_size=32),
        kvpot.H2O(heavy=24, recent=16, chunk_size=32),
        kvpot.TOVA(budget=40, chunk_size=32),
        kvpot.SnapKV(budget=48, window=8, chunk_size=64),
        kvpot.InfiniPot(pot_size=64, catalyst="question"),  # tail probe + NuC from the head's logits
        kvpot.CItruS(chunk_size=32, keep=32, cache="shared"),
        kvpot.CItruS(chunk_size=32, keep=32, cache="individual"),  # twin cache + separate probes
        kvpot.D2O(budget=24, chunk_size=64),  # layer budgets gathered over every layer
        kvpot.PyramidKV(budget=32, window=8, beta=2, chunk_size=64),  # a different budget in each layer
        kvpot.Scissorhands(budget=40, drop=12, history=8, chunk_size=32),
        kvpot.RoCo(budget=40, chunk_size=32),
        kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(32, 16, 8), early_keep=16, query_block=8,
                          chunk_size=64, refresh=(4, 2, 1)),
    ]


def label(method: kvpot.Method) -> str:
    return method.name + (f"-{method.cache}" if method.name == "citrus" else "")


def per_module_map(model, place) -> dict:
    """A device_map naming every top-level block: `place(i)` for decoder layer i."""
    layers = len(model.get_decoder().layers)
    first, last = place(0), place(layers - 1)
    return {"model.embed_tokens": first, **{f"model.layers.{i}": place(i) for i in range(layers)},
            "model.norm": last, "model.rotary_emb": first, "lm_head": last}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a shared 2-core machine can be many times slower
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny():
    return build("llama3", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(11)
    return torch.randint(3, VOCAB, (CONTEXT,)), torch.randint(3, VOCAB, (QUESTION,))


@pytest.fixture(scope="module")
def expected(tiny, ids):
    context, question = ids
    return {label(m): kvpot.Engine(tiny, method=m).generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
            for m in every_method()}


def dispatch(tiny, variant: str, folder):
    """The tiny model dispatched on the CPU: hooks on every block, or the embedding, the head and
    layers 1 and 3 offloaded to disk (their weights on `meta` between calls)."""
    model = copy.deepcopy(tiny)
    if variant == "hooks":
        device_map = per_module_map(model, lambda i: "cpu")
        return accelerate.dispatch_model(model, device_map=device_map, force_hooks=True)
    device_map = {**per_module_map(model, lambda i: "disk" if i % 2 else "cpu"), "model.embed_tokens": "disk",
                  "lm_head": "disk"}
    return accelerate.dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(folder))


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    return {variant: dispatch(tiny, variant, tmp_path_factory.mktemp("offload")) for variant in ("hooks", "offloaded")}


@pytest.fixture(scope="module", params=["hooks", "offloaded"])
def dispatched(request, models):
    return models[request.param]


def test_dispatched_model_runs_where_its_hooks_say(dispatched):
    assert all(hasattr(layer, "_hf_hook") for layer in dispatched.get_decoder().layers)
    engine = kvpot.Engine(dispatched)
    assert engine.device == torch.device("cpu") and engine.output_device == torch.device("cpu")
    assert layer_devices(dispatched) == [torch.device("cpu")] * LAYERS
    assert model_devices(dispatched) == [torch.device("cpu")]


def test_offloaded_layers_rest_on_meta_but_run_on_cpu(models):
    model = models["offloaded"]
    for module in (model.get_decoder().layers[1], model.get_input_embeddings(), model.get_output_embeddings()):
        assert next(module.parameters()).device.type == "meta"  # no parameter says where it runs...
        assert execution_device(module) == torch.device("cpu")  # ...its hook does


CASES = [(variant, index) for variant in ("hooks", "offloaded") for index, m in enumerate(every_method())
         if variant == "hooks" or label(m) in OFFLOADED]


@pytest.mark.parametrize("variant, index", CASES, ids=[f"{v}-{label(every_method()[i])}" for v, i in CASES])
def test_every_method_gives_the_same_tokens_dispatched(models, ids, expected, variant, index):
    method = every_method()[index]
    context, question = ids
    out = kvpot.Engine(models[variant], method=method).generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    reference = expected[label(method)]
    assert out.token_ids == reference.token_ids
    assert out.stats.max_kv_entries == reference.stats.max_kv_entries
    assert out.stats.compressions == reference.stats.compressions
    if method.name not in ("full", "truncate", "infinitehip"):
        assert out.stats.compressions > 0  # the sizes above do make every eviction method evict


def test_scoring_and_probes_on_a_dispatched_model(tiny, dispatched, ids):
    context, _ = ids
    method = kvpot.InfiniPot(pot_size=48, catalyst=None)
    plain = kvpot.Engine(tiny, method=method).score_ids(context, prompt_tokens=100)
    split = kvpot.Engine(dispatched, method=method).score_ids(context, prompt_tokens=100)
    torch.testing.assert_close(split.nll, plain.nll, rtol=0, atol=0)
    engine = kvpot.Engine(dispatched, method=kvpot.Full())
    state = engine.prefill_ids(context)
    before = [layer.keys[:, :, : layer.n].clone() for layer in state.cache.layers]
    observed = engine.probe(state.cache, state.next_position, [5, 6, 7], kvpot.attention.AttentionRequest())
    assert [o.shape[-1] for o in observed] == [CONTEXT] * LAYERS
    assert all(torch.equal(layer.keys[:, :, : layer.n], keys) for layer, keys in zip(state.cache.layers, before))


def test_sampling_is_seeded_on_the_output_device(tiny, dispatched, ids):
    context, question = ids
    runs = [kvpot.Engine(m).generate_ids(context, question, max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
            for m in (tiny, dispatched)]
    assert runs[0].token_ids == runs[1].token_ids


def test_stats_report_peak_memory_per_device(tiny, ids):
    out = kvpot.Engine(tiny).generate_ids(*ids, max_new_tokens=2)
    assert out.stats.peak_memory_by_device == {} and out.stats.peak_memory_bytes is None  # CPU: nothing to measure
    assert "peak_memory_by_device" in out.stats.to_dict()


def test_rope_keeps_one_table_per_device(tiny):
    from kvpot.models import rotary_embedding
    from kvpot.rope import Rope

    rope = Rope(rotary_embedding(tiny))
    x = torch.randn(1, 2, 5, 16)
    first = rope.rotate(x, torch.arange(5).view(1, 1, 5).expand(1, 2, 5), 4)
    table = rope.table(10, x)
    assert rope.table(10, x)[0] is table[0]  # reused, not rebuilt
    assert torch.equal(rope.rotate(x, torch.arange(5).view(1, 1, 5).expand(1, 2, 5), 4), first)


def test_from_pretrained_with_a_device_map(tiny_dir):
    engine = kvpot.Engine.from_pretrained(str(tiny_dir), device_map={"": "cpu"}, method=kvpot.StreamingLLM(
        sinks=4, window=28, chunk_size=16))
    assert engine.model.dtype == torch.float32  # a CPU-only map keeps float32
    out = engine.generate("The grass is green. " * 8, question="What colour?", max_new_tokens=4, ignore_eos=True)
    assert len(out.token_ids) == 4 and out.stats.compressions > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(device_map="everywhere"), "device_map must be one of"),
    (dict(device_map={}), "non-empty dict"),
    (dict(device="cpu", device_map="auto"), "either a device"),
    (dict(max_memory={0: "1GiB"}), "only applies with a device_map"),
    (dict(device_map="auto", max_memory="1GiB"), "max_memory must be a dict"),
])
def test_bad_device_maps_are_refused_before_loading(tiny_dir, kwargs, message):
    with pytest.raises(KvpotError, match=message):
        kvpot.Engine.from_pretrained(str(tiny_dir), **kwargs)


def test_parse_max_memory():
    assert parse_max_memory("0=70GiB, 1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    assert parse_max_memory(None) is None
    with pytest.raises(KvpotError, match="DEVICE=SIZE"):
        parse_max_memory("70GiB")


def test_split_shape_is_drawn_per_block_and_runs(tmp_path):
    """`shapes.build(device_map=...)` builds on `meta`, then draws each block where the map puts it."""
    from kvpot.models import shapes

    reference = shapes.build("tiny")
    split = shapes.build("tiny", device_map={"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu",
                                             "model.rotary_emb": "cpu", "lm_head": "cpu"}, seed=1)
    assert all(p.device.type == "cpu" for p in split.parameters()) and split.dtype == torch.float32
    for (name, buffer), (_, expected) in zip(split.named_buffers(), reference.named_buffers()):
        assert torch.equal(buffer, expected), name  # RoPE frequencies computed, not left uninitialised
    weight = split.get_decoder().layers[0].mlp.up_proj.weight
    assert abs(float(weight.detach().std()) - 0.02) < 0.002
    assert not torch.equal(weight, reference.get_decoder().layers[0].mlp.up_proj.weight)
    assert torch.equal(split.get_decoder().layers[0].input_layernorm.weight, torch.ones(256))
    out = kvpot.Engine(split, method=kvpot.InfiniPot(pot_size=64, catalyst=None)).generate_ids(
        list(range(3, 200)), max_new_tokens=3, ignore_eos=True)
    assert out.stats.compressions > 0


def test_llama3_70b_shape_and_refusal_without_gpus():
    from kvpot.models import shapes

    described = shapes.describe(shapes.get_shape("llama3-70b"))
    assert (described["num_hidden_layers"], described["hidden_size"], described["num_attention_heads"],
            described["num_key_value_heads"], described["intermediate_size"], described["vocab_size"]) == \
        (80, 8192, 64, 8, 28672, 128256)
    assert 70.0e9 < described["parameters"] < 71.0e9
    if not torch.cuda.is_available():  # 141 GB of bfloat16 cannot be split over GPUs that are not there
        with pytest.raises(KvpotError, match="does not fit on the GPUs"):
            shapes.build("llama3-70b", device_map="auto", max_memory={"cpu": "8GiB"})


def test_bench_and_generate_take_a_device_map(capsys, tmp_path, tiny_dir):
    import json

    from conftest import run

    code, _, err = run(capsys, "bench", "prefill", "--shape", "tiny", "--device-map", "auto", "--method",
                       "infinipot:pot_size=256", "--lengths", "512", "--no-floor", "--threads", "1",
                       "--out", str(tmp_path / "bench"))
    assert code == 0, err
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["config"]["device_map"] == "auto" and results["config"]["model_devices"] == "cpu"
    assert results["rows"][0]["peak_memory_by_device"] == {} and results["rows"][0]["compressions"] > 0
    code, out, err = run(capsys, "generate", "--model", str(tiny_dir), "--device-map", "auto", "--method",
                         "streaming:budget=32", "--context", "The grass is green. " * 6, "--question", "Colour?",
                         "--max-new-tokens", "3", "--json")
    assert code == 0, err
    assert "peak_memory_by_device" in json.loads(out)["stats"]
    code, _, err = run(capsys, "generate", "--model", str(tiny_dir), "--device", "cpu", "--device-map", "auto",
                       "--method", "full", "--context", "x")
    assert code == 2 and "not both" in err and "Traceback" not in err
    code, _, err = run(capsys, "eval", "passkey", "--method", "full", "--max-memory", "0=1GiB", "--out",
                       str(tmp_path / "eval"))
    assert code == 2 and "only applies with a device_map" in err


# ---------------------------------------------------------------------------- two GPUs


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")
@pytest.mark.parametrize("index", range(len(every_method())), ids=[label(m) for m in every_method()])
def test_every_method_split_over_two_gpus_gives_the_tokens_of_one(index):
    """Layers 0-1 on cuda:0, 2-3 on cuda:1 (head there too): the tokens of the model on cuda:0 alone,
    every layer's cache on its layer's GPU, peak memory reported for both. Head dim 32 so that
    InfiniteHiP runs its Triton kernels (which must launch on each layer's own GPU)."""
    model = build("llama3", num_hidden_layers=LAYERS, hidden_size=128, head_dim=32)
    single = copy.deepcopy(model).to("cuda:0")
    split = accelerate.dispatch_model(model, device_map=per_module_map(model, lambda i: 0 if i < LAYERS // 2 else 1))
    assert input_device(split) == torch.device("cuda", 0) and output_device(split) == torch.device("cuda", 1)
    torch.manual_seed(11)
    context, question = torch.randint(3, VOCAB, (CONTEXT,)), torch.randint(3, VOCAB, (QUESTION,))
    method = every_method()[index]
    reference = kvpot.Engine(single, method=method).generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    engine = kvpot.Engine(split, method=method)
    state = engine.prefill_ids(context, question)
    for layer, device in zip(state.cache.layers, layer_devices(split)):
        assert layer.keys.device == device
    # the same call as the reference (a state resumed without its question would re-begin the method)
    out = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    assert out.token_ids == reference.token_ids
    assert out.stats.compressions == reference.stats.compressions
    assert set(out.stats.peak_memory_by_device) == {"cuda:0", "cuda:1"}
    assert out.stats.peak_memory_bytes == sum(out.stats.peak_memory_by_device.values())
