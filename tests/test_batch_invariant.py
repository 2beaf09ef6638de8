"""Batch-invariant decoding (`Engine(batch_invariant=True)`, docs/design.md *Batch-invariant decoding*).

What does not depend on the GPU: the options it sets and refuses, that every decoding row's linear layers (one
row alone, many in a batch) reach `kvpot::invariant_linear`, that the batched scheduler reads prompts in the
forwards one request alone reads them in (no cap at its budget, no mixing, no fed questions), and that each
request's tokens are its tokens alone. The kernels' own invariance is tests/test_invariant_kernels.py. Under
`TRITON_INTERPRET=1` the operator runs the kernel interpreted; otherwise it is a plain product on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvpot
from conftest import VOCAB, build, compiled_graphs, graph_targets, interpreter_runtime_loops
from kvpot.engine import linear as linear_module
from kvpot.engine.linear import EveryRowLinear, decoding_numerics, resolve_linear
from kvpot.engine.offline import generate_many, run_all
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.errors import KvpotError

NEW = 12
LENGTHS = (150, 70, 33)
interpreter_runtime_loops()


class Spy:
    """Counts the rows of the calls that reach `kvpot::invariant_linear` (results stay the operator's)."""

    def __init__(self, monkeypatch):
        self.rows, self.real = [], linear_module.invariant_op
        monkeypatch.setattr(linear_module, "invariant_op", self)

    def __call__(self, x, weight, bias):
        self.rows.append(x.numel() // x.shape[-1])
        return self.real(x, weight, bias)


def invariant(model, method, decode="auto", runner="sequence") -> kvpot.Engine:
    """A batch-invariant engine whose decoding rows go through the operator on the CPU as well."""
    engine = kvpot.Engine(model, method=method, decode=decode, runner=runner, batch_invariant=True)
    engine.linear, engine._linear_devices = "invariant", ("cpu",)
    return engine


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(7)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in LENGTHS]


def test_the_options_it_sets_and_refuses(monkeypatch):
    model = build("llama3")
    engine = kvpot.Engine(model, batch_invariant=True)
    assert engine.batch_invariant and engine.split_entries == kvpot.defaults.SPLIT_ENTRIES
    assert kvpot.Engine(model).split_entries is None
    scheduler = Scheduler(engine, slots=2, capacity=256, decode="static", mix="auto", feed_questions="auto")
    assert scheduler.mix is False and scheduler.feed_questions == "never" and scheduler.chunk_cap is None
    with pytest.raises(KvpotError, match="mix='on' under batch-invariant"):
        Scheduler(engine, slots=2, capacity=256, decode="static", mix="on")
    with pytest.raises(KvpotError, match="feed_questions='always' under batch-invariant"):
        Scheduler(engine, slots=2, capacity=256, decode="static", feed_questions="always")
    with pytest.raises(KvpotError, match="batch_invariant must be True or False"):
        kvpot.Engine(model, batch_invariant="yes")
    with pytest.raises(KvpotError, match="leave linear at 'auto'"):
        kvpot.Engine(model, linear="torch", batch_invariant=True)
    with pytest.raises(KvpotError, match="tensor parallelism"):
        resolve_linear("auto", torch.device("cpu"), sharded=True, invariant=True)
    # on a GPU: kvpot's kernels or nothing (a head dim they do not take; without Triton; with eager steps)
    from kvpot import kernels

    gpu = torch.device("cuda")
    assert decoding_numerics("auto", gpu, False, False, 48, "eager")[2] is None  # the mode off: nothing asked
    monkeypatch.setattr(kernels, "available", lambda device: False)
    with pytest.raises(KvpotError, match="runs kvpot's Triton kernels: it needs Triton"):
        decoding_numerics("auto", gpu, False, True, 64, "auto")
    monkeypatch.setattr(kernels, "available", lambda device: True)
    with pytest.raises(KvpotError, match="this model's is 48"):
        decoding_numerics("auto", gpu, False, True, 48, "auto")
    with pytest.raises(KvpotError, match="decode='eager' under batch-invariant decoding"):
        decoding_numerics("auto", gpu, False, True, 64, "eager")
    assert decoding_numerics("auto", gpu, False, True, 64, "graph") == ("invariant", ("cuda",), 512)
    from kvpot import kernels

    expected = "invariant" if kernels.available("cpu") else "torch"  # the interpreter runs it on a CPU
    assert resolve_linear("auto", torch.device("cpu"), invariant=True) == expected


def test_the_mode_routes_every_row(monkeypatch):
    linear_module._warn_once.cache_clear()  # it warns once a message: an earlier test may have said this one
    spy, means = Spy(monkeypatch), []
    real_mean = linear_module.invariant_mean_op
    monkeypatch.setattr(linear_module, "invariant_mean_op", lambda x, keepdim: means.append(keepdim) or
                        real_mean(x, keepdim))
    weight, bias = torch.randn(6, 8), torch.randn(6)
    x = torch.randn(3, 1, 8)
    with EveryRowLinear(("cpu",)):
        one = F.linear(torch.randn(1, 1, 8), weight, bias)
        many = F.linear(torch.randn(5, 1, 8), weight, bias)
        with pytest.warns(UserWarning, match="went through torch's product"):  # a dtype it does not take: said
            F.linear(torch.randn(2, 8).double(), weight.double())
        variance = x.pow(2).mean(-1, keepdim=True)  # an RMSNorm's: routed
        flat = torch.mean(x, dim=[2])
        whole, first = x.mean(), x.mean(0)  # not over the last dimension alone: torch's
    assert spy.rows == [1, 5] and one.shape == (1, 1, 6) and many.shape == (5, 1, 6)
    assert means == [True, False]
    torch.testing.assert_close(variance, x.pow(2).mean(-1, keepdim=True))
    torch.testing.assert_close(flat, x.mean(-1))
    assert whole.shape == () and first.shape == (1, 8)


METHODS = {"full": (lambda: kvpot.Full(chunk_size=64), 256),
           "streaming": (lambda: kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16), None),
           "h2o": (lambda: kvpot.H2O(heavy=24, recent=24, chunk_size=16), None),
           "infinipot": (lambda: kvpot.InfiniPot(pot_size=64, catalyst=None), None),
           "selfextend": (lambda: kvpot.SelfExtend(group_size=4, window=16, chunk_size=64), 256)}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_each_request_gets_its_tokens_alone_through_the_fixed_kernels(name, prompts, monkeypatch, one_thread):
    make, capacity = METHODS[name]
    model = build("llama3")
    spy = Spy(monkeypatch)
    engine = invariant(model, make(), decode="eager")
    expected = [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True).token_ids for c, q in prompts]
    assert spy.rows and set(spy.rows) == {1}  # alone: one row a step
    spy.rows.clear()
    scheduler = Scheduler(invariant(model, make()), slots=3, capacity=capacity, decode="static", prefill_tokens=24)
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert scheduler.report["batched_rows"] > 0 and max(spy.rows) > 1  # batched rows took the operator together


def infllm() -> kvpot.InfLLM:
    return kvpot.InfLLM(initial=4, window=32, block_size=8, representatives=2, topk=3, lookup=16, chunk_size=32)


@pytest.mark.parametrize("name", sorted(METHODS) + ["infllm"])
def test_one_request_through_the_core_steps_as_its_batches_step(name, prompts, monkeypatch, one_thread):
    """`runner="auto"` takes a batch-invariant request through the core (a pool of one slot), whose rows step as a
    batch of that engine steps them: steady rows in the batched step, a method's own attention (InfLLM) eagerly,
    never as one sequence (`alone.sequence_steps`). The tokens are the one-sequence runner's."""
    make = infllm if name == "infllm" else METHODS[name][0]
    model = build("llama3")
    context, question = prompts[0]
    expected = invariant(model, make(), decode="eager").generate_ids(context, question, max_new_tokens=NEW,
                                                                     ignore_eos=True).token_ids
    spy = Spy(monkeypatch)
    result = invariant(model, make(), decode="static", runner="auto").generate_ids(context, question,
                                                                                  max_new_tokens=NEW, ignore_eos=True)
    report = result.stats.decode
    assert result.token_ids == expected and report["runner"] == "core" and report["sequence_rows"] == 0
    assert (report["eager_rows"] > 0 and report["batched_rows"] == 0) if name == "infllm" else \
        report["batched_rows"] > 0
    assert spy.rows and set(spy.rows) == {1}  # one row a step, through the fixed kernels


def test_the_scheduler_reads_prompts_in_the_forwards_alone_reads_them_in(prompts, monkeypatch, one_thread):
    """Full is not chunk-dependent, so a scheduler caps its forwards at its budget (24 tokens here); a batch-invariant
    one reads each prompt in the method's own chunks (64), as `Engine.generate` does: the same products."""
    model = build("llama3")
    forwards = []
    real = kvpot.Engine._forward
    monkeypatch.setattr(kvpot.Engine, "_forward", lambda self, run, ids, step: forwards.append(ids.numel()) or
                        real(self, run, ids, step))
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=64))
    for context, question in prompts:
        engine.prefill_ids(context, question)
    alone = sorted(forwards)
    for batch_invariant, same in ((True, True), (False, False)):
        forwards.clear()
        engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=64), batch_invariant=batch_invariant)
        requests = [Request(c, q, max_new_tokens=1) for c, q in prompts]
        run_all(Scheduler(engine, slots=3, capacity=256, decode="static", prefill_tokens=24), requests)
        assert (sorted(forwards) == alone) is same
        assert max(forwards) == (64 if batch_invariant else 24)


def test_generate_many_and_a_stored_state_question(prompts, one_thread):
    """A question asked of a stored state is read in a forward of its own, as alone (never fed token by token)."""
    model = build("llama3")
    engine = kvpot.Engine(model, method=kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16), batch_invariant=True)
    states = [engine.prefill_ids(c) for c, _ in prompts]
    expected = [engine.generate_ids(state=s, question_ids=q, max_new_tokens=NEW, ignore_eos=True).token_ids
                for s, (_, q) in zip(states, prompts)]
    requests = [Request(None, q, max_new_tokens=NEW, ignore_eos=True, state=s) for s, (_, q) in zip(states, prompts)]
    generate_many(engine, requests, batch_size=3)
    assert [r.tokens for r in requests] == expected


GPU_METHODS = {**METHODS, "infllm": (infllm, 1024)}


@pytest.mark.gpu
@pytest.mark.parametrize("name, compile_step, runner", [(n, False, r) for n in sorted(GPU_METHODS)
                                                        for r in ("auto", "sequence")] + [("streaming", True, "auto")])
def test_bf16_batches_give_each_request_its_tokens_alone_on_cuda(name, compile_step, runner):
    """In bf16 on a GPU, with the Triton kernels (head dim 64): captured batched steps of up to 4 rows give each
    request the tokens it gets alone, token for token, whatever decodes beside it: alone through the core (a pool of
    one, `runner="auto"`) or the one-sequence runner's captured steps (compiled steps too: both paths' decoder layer
    compiled). InfLLM's rows are eager steps on every path."""
    make, capacity = GPU_METHODS[name]
    model = build("llama3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2).to("cuda", torch.bfloat16)
    assert model.config.head_dim == 64  # the kernels' head dims: 32, 64, 128, 256
    torch.manual_seed(11)
    prompts = [(torch.randint(3, VOCAB, (n,)).cuda(), torch.randint(3, VOCAB, (5,)).cuda()) for n in (300, 150, 520, 90)]
    capacity = capacity and 1024
    alone = kvpot.Engine(model, method=make(), batch_invariant=True, compile_step=compile_step, runner=runner)
    assert alone.linear == "invariant" and alone.split_entries
    results = [alone.generate_ids(c, q, max_new_tokens=32, ignore_eos=True) for c, q in prompts]
    assert {r.stats.decode["runner"] for r in results} == {"core" if runner == "auto" else "sequence"}
    expected = [r.token_ids for r in results]
    scheduler = Scheduler(kvpot.Engine(model, method=make(), batch_invariant=True, compile_step=compile_step),
                          slots=4, capacity=capacity, decode="graph")
    requests = [Request(c, q, max_new_tokens=32, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert (scheduler.report["batched_rows"] > 0) is (name != "infllm")


def test_the_commands_refuse_what_the_mode_cannot_do(capsys, tmp_path):
    from conftest import run

    from kvpot.bench.config import BenchConfig
    from kvpot.eval.config import EvalConfig

    code, _, err = run(capsys, "generate", "--batch-invariant", "--linear", "gemv", "--context", "abc")
    assert code == 2 and "--batch-invariant chooses the linear layers' kernel itself" in err
    code, _, err = run(capsys, "eval", "passkey", "--method", "streaming", "--batch-invariant", "--mix", "on",
                       "--out", str(tmp_path / "e"))
    assert code == 2 and "--batch-invariant reads prompts as one sample alone" in err
    with pytest.raises(KvpotError, match="does not run with --mix on"):
        EvalConfig(task="passkey", methods=["streaming"], out=tmp_path / "e", batch_invariant=True, mix="on")
    with pytest.raises(KvpotError, match="drop --linear / --tp"):
        BenchConfig(mode="decode", shape="tiny", out=tmp_path / "b", methods=["streaming"], lengths=[256],
                    batch_invariant=True, linear="torch")
    for option in (dict(mixed=True), dict(mix="on")):
        with pytest.raises(KvpotError, match="--batch-invariant reads prompts as one request alone"):
            BenchConfig(mode="throughput", shape="tiny", out=tmp_path / "b", methods=["streaming"], lengths=[256],
                        batch_invariant=True, **option)


def test_the_compiled_step_holds_the_invariant_operators(prompts, monkeypatch, one_thread):
    """`compile_step=True` with the mode: the compiled decoder layer calls `kvpot::invariant_linear` for its seven
    products and `kvpot::invariant_mean` for its two norms, in one graph, and gives the eager path's tokens."""
    context, question = prompts[0]
    with compiled_graphs(monkeypatch) as (graphs, breaks):
        model = build("llama3")
        eager = invariant(model, kvpot.Full(), decode="eager").generate_ids(context, question, max_new_tokens=NEW,
                                                                            ignore_eos=True)
        engine = kvpot.Engine(model, method=kvpot.Full(), decode="static", runner="sequence", compile_step=True,
                              batch_invariant=True)
        engine.linear, engine._linear_devices = "invariant", ("cpu",)
        compiled = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    assert compiled.token_ids == eager.token_ids
    assert not breaks
    layer = [g for g in graphs if torch.ops.kvpot.invariant_linear.default in graph_targets(g)]
    assert len(layer) == 1
    assert graph_targets(layer[0]).count(torch.ops.kvpot.invariant_linear.default) == 7
    assert graph_targets(layer[0]).count(torch.ops.kvpot.invariant_mean.default) == 2


def test_bench_throughput_rows_say_they_are_batch_invariant(tmp_path, capsys, one_thread):
    import json

    from conftest import run

    code, _, _ = run(capsys, "bench", "throughput", "--shape", "tiny", "--device", "cpu", "--method",
                     "streaming:sinks=4,window=60", "--users", "3", "--lengths", "96", "--new-tokens", "4",
                     "--sequential-users", "1", "--batch-invariant", "--out", str(tmp_path / "b"))
    rows = {r["method"]: r for r in json.loads((tmp_path / "b" / "results.json").read_text())["rows"]}
    assert code == 0 and set(rows) == {"streaming [batch, batch-invariant]", "streaming [one at a time, batch-invariant]"}
    assert rows["streaming [batch, batch-invariant]"]["batch_invariant"] is True
    assert rows["streaming [batch, batch-invariant]"]["mix"] is False
    assert "| streaming [batch, batch-invariant] |" in (tmp_path / "b" / "summary.md").read_text()


def test_methods_a_batch_steps_eagerly_decode_eagerly_alone_too(prompts, one_thread):
    """InfLLM's rows are eager steps in a batch (its positions are not the batched kernels'): batch-invariant, alone
    decodes it eagerly too, so both run the same forward; without the mode alone takes the fixed-shape steps."""
    model = build("llama3")
    make = infllm
    context, question = prompts[0]
    plain = kvpot.Engine(model, method=make(), decode="static", runner="sequence").generate_ids(context, question,
                                                                                           max_new_tokens=4)
    engine = kvpot.Engine(model, method=make(), decode="static", runner="sequence", batch_invariant=True)
    alone = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    assert plain.stats.decode["mode"] == "static" and alone.stats.decode["mode"] == "eager"
    scheduler = Scheduler(engine, slots=2, capacity=256, decode="static")
    requests = [Request(context, question, max_new_tokens=NEW, ignore_eos=True), Request(*prompts[1], max_new_tokens=4)]
    run_all(scheduler, requests)
    assert requests[0].tokens == alone.token_ids and scheduler.report["batched_rows"] == 0


def test_the_server_reads_contexts_as_alone(monkeypatch, one_thread):
    """`kvpot serve` reads long contexts and uploads through `prefill_steps`, capped at --prefill-tokens a forward;
    batch-invariant, in the method's own forwards (no cap), as `Engine.generate` reads them."""
    from conftest import build_llama

    from kvpot.models.reference.tokenizer import build_tokenizer
    from kvpot.serve.config import ServeConfig
    from kvpot.serve.service import Service

    for batch_invariant, cap in ((False, 64), (True, None)):
        tokenizer = build_tokenizer()
        model = build_llama(vocab_size=320, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        engine = kvpot.Engine(model, tokenizer, method=kvpot.Full(chunk_size=128), batch_invariant=batch_invariant)
        asked = []
        monkeypatch.setattr(engine, "prefill_steps", lambda ids, **kw: asked.append(kw["max_chunk"]))
        service = Service(engine, ServeConfig(method="full:chunk_size=128", prefill_tokens=64))
        try:
            service._prefill("full:chunk_size=128", [5, 6, 7], should_stop=None)
        finally:
            service.worker.shutdown()
        assert asked == [cap]
