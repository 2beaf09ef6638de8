"""Single-token steps' linear layers through `kvpot::gemv` (`Engine(linear=...)`, `kvpot.engine.linear`).

On a GPU the operator is kvpot's Triton kernel (its numerics: tests/test_gemv.py). Here the mode is pointed
at the CPU, where the operator is a plain product, to test what does not depend on the kernel: which calls
are routed (every linear layer of a single-token forward, none of a many-token one), that the eager, static
and compiled steps route alike and so give the same tokens, and that the compiled step holds the operator
in its one graph (no graph break, no trace into the kernel)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvpot
from conftest import VOCAB, build, compiled_graphs, graph_targets, interpreter_runtime_loops
from kvpot.engine import linear as linear_module
from kvpot.engine.linear import SingleRowLinear, resolve_linear
from kvpot.errors import KvpotError

CONTEXT, QUESTION, NEW = 120, 5, 10
interpreter_runtime_loops()  # under TRITON_INTERPRET=1 the operator runs the kernel interpreted


class Spy:
    """Counts the calls that reach the operator (wrapping it, so results stay the operator's)."""

    def __init__(self, monkeypatch):
        self.calls, self.real = 0, linear_module.gemv_op
        monkeypatch.setattr(linear_module, "gemv_op", self)

    def __call__(self, x, weight, bias):
        self.calls += 1
        return self.real(x, weight, bias)


def routed(model, method, decode, **kw) -> kvpot.Engine:
    """An engine whose single-token forwards route their linear layers on the CPU."""
    engine = kvpot.Engine(model, method=method, decode=decode, **kw)
    engine.linear, engine._linear_devices = "gemv", ("cpu",)
    return engine


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(4)
    return torch.randint(3, VOCAB, (CONTEXT,)), torch.randint(3, VOCAB, (QUESTION,))


def test_resolve_linear():
    assert resolve_linear("auto", torch.device("cpu")) == "torch"
    assert resolve_linear("torch", torch.device("cpu")) == "torch"
    with pytest.raises(KvpotError, match="CUDA"):
        resolve_linear("gemv", torch.device("cpu"))
    with pytest.raises(KvpotError, match="linear must be one of"):
        kvpot.Engine(build("llama3"), linear="cublas")


def test_the_mode_leaves_dtensors_to_torch(tmp_path):
    """A sharded model whose TP forward hands a layer DTensors (training, or a transformers that does not run
    inference on local shards) keeps torch's DTensor product, which holds the layout; plain shards take the
    kernel (tests/test_tensor_parallel.py: what transformers' TP forward hands the mode)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        weight = distribute_tensor(torch.randn(8, 4), DeviceMesh("cpu", [0]), [Replicate()])
        mode = SingleRowLinear(devices=("cpu",))
        linear_module._warn_dtensor_once.cache_clear()
        with pytest.warns(UserWarning, match="DTensors"):
            assert not mode._takes(torch.randn(1, 4), weight, None)
        assert mode._takes(torch.randn(1, 4), weight.to_local(), None)
    finally:
        dist.destroy_process_group()


def test_the_mode_routes_one_row_and_passes_the_rest(monkeypatch):
    spy = Spy(monkeypatch)
    weight, bias = torch.randn(6, 8), torch.randn(6)
    one, two = torch.randn(1, 1, 8), torch.randn(2, 8)
    with SingleRowLinear(("cpu",)):
        out_one = F.linear(one, weight, bias)
        assert spy.calls == 1
        out_two = F.linear(two, weight, bias)  # two rows: torch's product
        assert spy.calls == 1
    torch.testing.assert_close(out_one, F.linear(one, weight, bias))
    torch.testing.assert_close(out_two, F.linear(two, weight, bias))
    with SingleRowLinear(("cpu",)):  # a dtype the kernel does not take: torch's product
        F.linear(one.double(), weight.double(), bias.double())
    assert spy.calls == 1
    with SingleRowLinear(("cuda",)):  # not this device
        F.linear(one, weight, bias)
    assert spy.calls == 1


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])  # qwen2: biased projections
def test_every_single_token_forward_routes_every_linear_layer(arch, inputs, monkeypatch, one_thread):
    model = build(arch)
    engine = routed(model, kvpot.Full(), "eager")
    state = engine.prefill_ids(*inputs)
    spy = Spy(monkeypatch)  # counted from here: the prefill's forwards read many tokens
    out = engine.generate_ids(state=state, max_new_tokens=NEW, ignore_eos=True)
    layers = model.config.num_hidden_layers
    assert len(out.token_ids) == NEW
    assert spy.calls == (NEW - 1) * (7 * layers + 1)  # q, k, v, o, gate, up, down per layer, then the head


METHODS = {"streaming": lambda: kvpot.StreamingLLM(sinks=4, window=92, chunk_size=32),
           "infinipot": lambda: kvpot.InfiniPot(pot_size=64, catalyst=None)}


@pytest.mark.parametrize("method", list(METHODS.values()), ids=list(METHODS))
def test_the_decoding_paths_route_alike(method, inputs, monkeypatch, one_thread):
    """The operator rounds otherwise than F.linear (on a GPU: the kernel's float32 sums against cuBLAS'):
    eager and static steps both routed give the same tokens, routed or not."""
    model = build("llama3")
    eager = routed(model, method(), "eager").generate_ids(*inputs, max_new_tokens=NEW, ignore_eos=True)
    spy = Spy(monkeypatch)
    static = routed(model, method(), "static").generate_ids(*inputs, max_new_tokens=NEW, ignore_eos=True)
    assert static.token_ids == eager.token_ids
    assert spy.calls >= (NEW - 1) * (7 * model.config.num_hidden_layers + 1)


def test_the_compiled_step_holds_the_operator_in_its_one_graph(inputs, monkeypatch, one_thread):
    with compiled_graphs(monkeypatch) as (graphs, breaks):
        model = build("llama3")
        eager = routed(model, kvpot.Full(), "eager").generate_ids(*inputs, max_new_tokens=NEW, ignore_eos=True)
        compiled = routed(model, kvpot.Full(), "static", compile_step=True).generate_ids(
            *inputs, max_new_tokens=NEW, ignore_eos=True)
    assert compiled.token_ids == eager.token_ids
    assert not breaks  # the operator broke no graph
    # one graph holds the layer, its seven products as the operator. (The mode's pass-through of the
    # float arguments that dynamic compilation turns into tensors at run time compiles as tiny frames too.)
    layer_graphs = [g for g in graphs if torch.ops.kvpot.gemv.default in graph_targets(g)]
    assert len(layer_graphs) == 1
    assert graph_targets(layer_graphs[0]).count(torch.ops.kvpot.gemv.default) == 7
    assert all(F.linear not in graph_targets(g) for g in graphs)


def test_the_cli_says_when_the_kernel_cannot_run(capsys):
    from conftest import run

    code, _, err = run(capsys, "generate", "--device", "cpu", "--linear", "gemv", "--context", "abc",
                       "--question", "x", "--max-new-tokens", "2")
    assert code != 0 and "linear='gemv'" in err and "CUDA" in err


def test_bench_refuses_an_unknown_linear(tmp_path):
    from kvpot.bench.config import BenchConfig

    with pytest.raises(KvpotError, match="--linear"):
        BenchConfig(mode="decode", shape="tiny", out=tmp_path / "out", methods=["streaming"], lengths=[256],
                    linear="cublas")
