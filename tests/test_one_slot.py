"""One sequence through the core (`Engine(runner="core")`, `kvpot.engine.one_slot`): `generate_ids` as a request of
a scheduler of one slot gives the tokens, entries and compressions of the one-sequence runner, from token ids or a
stored state, streams its tokens, stops when asked, and raises a failing step's own error."""

from __future__ import annotations

import json

import pytest
import torch

import kvpot
from conftest import VOCAB, build, run
from kvpot.errors import Cancelled, KvpotError
from test_batch import LENGTHS, NEW, alone, methods


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(3)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in LENGTHS[:2]]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model(request):
    return build(request.param)


def core(model, method, **kw):
    return kvpot.Engine(model, method=method, decode="static", runner="core", **kw)


@pytest.mark.parametrize("name", sorted(methods()))
def test_the_core_gives_each_method_its_tokens_entries_and_compressions_alone(model, prompts, name, one_thread):
    method, _ = methods()[name]
    expected = alone(model, method, prompts)
    engine = core(model, method)
    results = [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    for key in ("max_kv_entries", "final_kv_entries", "compressions", "context_tokens", "question_tokens",
                "new_tokens"):
        assert [getattr(r.stats, key) for r in results] == [getattr(e.stats, key) for e in expected], key
    for result in results:
        assert result.stats.decode["runner"] == "core" and result.stats.decode["slots"] == 1
        assert result.stats.prefill_seconds > 0 and result.stats.decode_seconds > 0


# how each method's decoding steps run in a pool of one: the batched step, or the one-sequence step on the slot
# (`kvpot.engine.alone`): a method's own attention (InfLLM, InfiniteHiP), every steady step (an eviction at its counts)
SEQUENCE_STEPS = {"infllm", "infinitehip", "d2o", "cam", "h2o", "streaming", "tova", "roco"}


@pytest.mark.parametrize("name", sorted(methods()))
def test_a_pool_of_one_steps_what_the_batched_step_cannot_take_as_one_sequence_not_eagerly(prompts, name, one_thread):
    model = build("llama3")
    method, _ = methods()[name]
    context, question = prompts[0]
    decode = core(model, method).generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True).stats.decode
    steps = decode["batched_rows"] + decode["sequence_rows"] + decode["eager_rows"]
    assert steps == NEW - 1  # the first token comes from the prompt's forward
    if name in SEQUENCE_STEPS:
        assert decode["sequence_rows"] >= NEW // 2 and decode["eager_rows"] <= 1, decode
    else:
        assert decode["sequence_rows"] == 0, decode
    # InfiniPot's distillations, CItruS' chunk evictions and Scissorhands' window compressions step alone
    assert decode["eager_rows"] == 0 or name.startswith(("infinipot", "citrus", "scissorhands")), decode


def test_a_bounded_methods_scheduler_is_kept_and_a_growing_caches_is_not(prompts, one_thread):
    model = build("llama3")
    (context, question), other = prompts
    for name, kept in (("streaming", True), ("full", False)):
        engine = core(model, methods()[name][0])
        first = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
        held = engine.core
        assert (held is not None) == kept
        engine.generate_ids(other[0], other[1], max_new_tokens=NEW, ignore_eos=True)
        again = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
        assert again.token_ids == first.token_ids
        if kept:  # one pool and one scheduler served every call
            assert engine.core is held and held[1].report["steps"] > 3 * NEW
    engine = core(model, methods()["streaming"][0])
    with pytest.raises(Cancelled):
        engine.generate_ids(context, question, max_new_tokens=NEW, should_stop=lambda: True)
    assert engine.core is None


@pytest.mark.parametrize("name", ["infinipot", "h2o", "full", "citrus"])
def test_the_core_answers_from_a_stored_state_and_leaves_it_unchanged(model, prompts, name, one_thread):
    method, _ = methods()[name]
    context, question = prompts[0]
    engine = core(model, method)
    state = engine.prefill_ids(context)
    sequence = kvpot.Engine(model, method=method, decode="static", runner="sequence")
    expected = sequence.generate_ids(question_ids=question, state=state, max_new_tokens=NEW, ignore_eos=True)
    before = [layer.keys[:, :, : layer.n].clone() for layer in state.cache.layers]
    for _ in range(2):  # the state stays usable
        result = engine.generate_ids(question_ids=question, state=state, max_new_tokens=NEW, ignore_eos=True)
        assert result.token_ids == expected.token_ids
    assert all(torch.equal(b, layer.keys[:, :, : layer.n]) for b, layer in zip(before, state.cache.layers))


def test_the_core_streams_samples_stops_and_raises_a_steps_own_error(prompts, one_thread, monkeypatch):
    model = build("llama3")
    method, _ = methods()["streaming"]
    engine = core(model, method)
    context, question = prompts[0]
    streamed = []
    result = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True, on_token=streamed.append,
                                 time_steps=True)
    assert streamed == result.token_ids and len(result.stats.decode["step_ms"]) == NEW - 1
    sampled = [engine.generate_ids(context, question, max_new_tokens=NEW, temperature=0.8, seed=7).token_ids
               for _ in range(2)]
    sequence = kvpot.Engine(model, method=method, decode="static", runner="sequence")
    assert sampled[0] == sampled[1] == sequence.generate_ids(context, question, max_new_tokens=NEW, temperature=0.8,
                                                             seed=7).token_ids
    asked = []
    with pytest.raises(Cancelled):
        engine.generate_ids(context, question, max_new_tokens=NEW, should_stop=lambda: asked.append(1) or len(asked) > 3)

    def broken(*args, **kwargs):
        raise RuntimeError("a step broke")

    monkeypatch.setattr(type(method), "after_forward", broken)
    with pytest.raises(RuntimeError, match="a step broke"):
        engine.generate_ids(context, question, max_new_tokens=NEW)


def test_runners_are_checked(one_thread):
    model = build("llama3")
    with pytest.raises(KvpotError, match="runner must be one of"):
        kvpot.Engine(model, runner="batch")
    with pytest.raises(KvpotError, match="decode='eager'"):
        kvpot.Engine(model, decode="eager", runner="core")
    engine = core(model, kvpot.Full())
    with pytest.raises(KvpotError, match="not both"):
        engine.generate_ids([5, 6], state=engine.prefill_ids([5, 6]))
    with pytest.raises(KvpotError, match="input_ids"):
        engine.generate_ids()


def test_kvpot_generate_and_bench_decode_take_the_runner(capsys, tmp_path, one_thread):
    from test_cli import byte_tokenizer

    path = tmp_path / "model"
    build("llama3").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    payloads = []
    for runner in ("sequence", "core"):
        code, out, err = run(capsys, "generate", "--model", str(path), "--method", "h2o", "--budget", "48",
                             "--set", "chunk_size=16", "--context", "The grass is green. " * 10, "--question", "What?",
                             "--max-new-tokens", "8", "--decode", "static", "--runner", runner, "--json")
        assert code == 0, err
        payloads.append(json.loads(out))
    assert payloads[0]["token_ids"] == payloads[1]["token_ids"]
    assert payloads[1]["stats"]["decode"]["runner"] == "core"
    out = tmp_path / "bench"
    code, _, err = run(capsys, "bench", "decode", "--shape", "tiny", "--device", "cpu", "--out", str(out), "--method",
                       "infinipot", "--budget", "128", "--lengths", "300", "--decode-steps", "4", "--warmup-steps", "1",
                       "--no-floor", "--decode", "static", "--runner", "core")
    assert code == 0, err
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert row["runner"] == "core" and row["decode"]["runner"] == "core" and len(row["samples_ms"]) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["infinipot", "streaming", "h2o", "full", "d2o", "cam", "infinitehip", "infllm"])
def test_the_core_through_cuda_graphs_gives_the_tokens_alone(name, prompts):
    llama = build("llama3").cuda()
    method, _ = methods()[name]
    cuda_prompts = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts]
    expected = alone(llama, method, cuda_prompts)
    engine = kvpot.Engine(llama, method=method, runner="core")
    results = [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in cuda_prompts]
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert all(r.stats.decode["mode"] == "batch-graph" for r in results)
    if name in SEQUENCE_STEPS:  # its one-sequence steps replay graphs too: a warm-up and a capture a form, then replays
        assert all(r.stats.decode["sequence_rows"] >= NEW // 2 for r in results)
        if engine.core is not None:
            graphs = engine.core[1].decoder.sequence_graphs
            assert graphs.replays >= NEW // 4 and graphs.captures >= 1


@pytest.mark.parametrize("name, adopted", [("full", True), ("snapkv", True), ("d2o", True), ("infinipot", False)])
def test_a_spent_state_of_a_growing_cache_is_the_slot_itself(prompts, name, adopted, one_thread, monkeypatch):
    """`keep_state=False`: a growing cache's state lends its buffers to the pool of one (no copy of it), a bounded
    one's is copied into the kept slot; either way the tokens are the one-sequence runner's and the state is spent."""
    import kvpot.engine.pool as pool_module

    model = build("llama3")
    method = methods()[name][0]
    context, question = prompts[0]
    sequence = kvpot.Engine(model, method=method, decode="static", runner="sequence")
    expected = sequence.generate_ids(question_ids=question, state=sequence.prefill_ids(context), max_new_tokens=NEW,
                                     ignore_eos=True, keep_state=False)
    shared = []
    original = pool_module.PoolLayer.__init__

    def spy(self, *args):
        original(self, *args)
        adopt = args[7] if len(args) > 7 else None
        shared.append(adopt is not None and self.keys.data_ptr() == adopt.keys.data_ptr()
                      and self.values.data_ptr() == adopt.values.data_ptr() and self.keys.is_contiguous())

    monkeypatch.setattr(pool_module.PoolLayer, "__init__", spy)
    engine = core(model, method)
    state = engine.prefill_ids(context)
    result = engine.generate_ids(question_ids=question, state=state, max_new_tokens=NEW, ignore_eos=True,
                                 keep_state=False)
    assert result.token_ids == expected.token_ids
    assert result.stats.max_kv_entries == expected.stats.max_kv_entries
    assert shared and all(shared) == adopted and any(shared) == adopted
    assert state.cache is None
    with pytest.raises(KvpotError, match="spent"):
        engine.generate_ids(question_ids=question, state=state)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "snapkv"])
def test_a_spent_state_lent_to_the_slot_decodes_through_cuda_graphs(name, prompts):
    llama = build("llama3").cuda()
    method = methods()[name][0]
    context, question = (torch.tensor(ids).cuda() for ids in prompts[0])
    sequence = kvpot.Engine(llama, method=method, runner="sequence")
    expected = sequence.generate_ids(question_ids=question, state=sequence.prefill_ids(context), max_new_tokens=NEW,
                                     ignore_eos=True, keep_state=False)
    engine = kvpot.Engine(llama, method=method, runner="core")
    state = engine.prefill_ids(context)
    result = engine.generate_ids(question_ids=question, state=state, max_new_tokens=NEW, ignore_eos=True,
                                 keep_state=False)
    assert result.token_ids == expected.token_ids and state.cache is None


def test_the_cli_refuses_the_core_with_eager_decoding_before_loading_a_model(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "absent"), "--context", "x", "--decode", "eager",
                       "--runner", "core")
    assert code == 2 and "decode='eager'" in err
    code, _, err = run(capsys, "bench", "decode", "--shape", "tiny", "--device", "cpu", "--out", str(tmp_path / "b"),
                       "--decode", "eager", "--runner", "core")
    assert code == 2 and "decode='eager'" in err


def test_the_auto_runner_takes_the_core_wherever_it_can_take_the_sequence(prompts, one_thread):
    """`runner="auto"`: the core for fixed-shape steps on one device and one process, not batch-invariant, with the
    cache on the device; else the one-sequence decoder (or its eager loop)."""
    from types import SimpleNamespace

    from kvpot.engine.one_slot import core_decodes

    def engine(**kw):
        facts = dict(runner="auto", devices=[torch.device("cpu")], decode="static", device=torch.device("cpu"),
                     parallel=None, batch_invariant=False, method=SimpleNamespace())
        return SimpleNamespace(**{**facts, **kw})

    assert core_decodes(engine())
    assert not core_decodes(engine(decode="auto"))  # a CPU's auto decodes eagerly
    assert core_decodes(engine(batch_invariant=True))  # its pool of one steps rows as its batches do
    assert not core_decodes(engine(parallel=object()))
    assert not core_decodes(engine(method=SimpleNamespace(offload=True)))  # entries in host memory
    assert not core_decodes(engine(devices=[torch.device("cpu")] * 2))
    assert core_decodes(engine(runner="core")) and not core_decodes(engine(runner="sequence"))
    model = build("llama3")
    method = methods()["h2o"][0]
    context, question = prompts[0]
    auto = kvpot.Engine(model, method=method, decode="static", runner="auto").generate_ids(
        context, question, max_new_tokens=NEW, ignore_eos=True)
    sequence = kvpot.Engine(model, method=method, decode="static", runner="sequence").generate_ids(
        context, question, max_new_tokens=NEW, ignore_eos=True)
    assert auto.stats.decode["runner"] == "core" and sequence.stats.decode["runner"] == "sequence"
    assert auto.token_ids == sequence.token_ids
