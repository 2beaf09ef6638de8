"""InfLLM's prefill forwards (issue 31): consecutive lookup chunks read their windows as strided views and
their queries as slices, with the same results, element by element, as the gathered path they replace."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import build_llama
from kvpot.kernels import sdpa
from kvpot.methods.infllm import runtime as runtime_module
from kvpot.methods.infllm.memory import SCORE, ramp
from kvpot.methods.infllm.runtime import InfLLMRuntime, Sizes
from kvpot.rope import Rope

KV, G, D = 2, 2, 16
SIZES = Sizes(initial=4, window=24, block=4, reps=2, topk=3, lookup=8)
BOUNDS = [0, 37, 69, 133, 134]  # a forward that starts mid-lookup, two of 4 lookups, one step


class Layer:
    def __init__(self, capacity: int):
        self.layer_idx, self.n = 0, 0
        self.scores = {SCORE: torch.zeros(1, KV, capacity)}

    def score(self, name: str) -> torch.Tensor:
        return self.scores[name][:, :, : self.n]


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def rope() -> Rope:
    model = build_llama(head_dim=D, hidden_size=KV * G * D, num_attention_heads=KV * G, num_key_value_heads=KV)
    return Rope(model.model.rotary_emb)


def cpu_split(query, key, value, scaling, causal):
    """CPU flash attention with its log-sum-exp, standing in for cuDNN's (the CUDA path's split attention)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal,
                                                                         scale=scaling)[:2]
    return out, lse.reshape(query.shape[:3])


def forwards(rope, dtype, log: Ops | None = None, device: str = "cpu"):
    torch.manual_seed(0)
    n = BOUNDS[-1]
    queries, keys, values = (torch.randn(KV * G, n, D, dtype=dtype), torch.randn(KV, n, D, dtype=dtype),
                             torch.randn(KV, n, D, dtype=dtype))
    queries, keys, values = queries.to(device), keys.to(device), values.to(device)
    runtime, layer = InfLLMRuntime(SIZES, rope, kernels="torch"), Layer(n)
    layer.scores[SCORE] = layer.scores[SCORE].to(device)
    outs = []
    for first, stop in zip(BOUNDS, BOUNDS[1:]):
        layer.n = stop
        # laid out as transformers hands queries over: [1, h, q, d], a transpose of [1, q, h, d]
        query = queries[:, first:stop].transpose(0, 1).contiguous().transpose(0, 1)[None]
        if log is not None and stop == BOUNDS[-2]:
            with log:
                outs.append(runtime(layer, query, keys[None, :, :stop], values[None, :, :stop], D**-0.5)[0])
        else:
            outs.append(runtime(layer, query, keys[None, :, :stop], values[None, :, :stop], D**-0.5)[0])
    return outs, layer.scores[SCORE].clone(), runtime.memory(0).summaries.clone()


def gathered(monkeypatch) -> None:
    """Every group through index tensors, as before the views."""
    monkeypatch.setattr(runtime_module, "arithmetic", lambda values: None)
    monkeypatch.setattr(InfLLMRuntime, "window_reader", staticmethod(lambda *a: None))


def assert_identical(a, b) -> None:
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("split", [False, True], ids=["reference", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_and_slices_equal_the_gathered_path(rope, monkeypatch, split, dtype):
    """The window views, query slices and slice write-back give the gathered path's outputs, scores and
    unit summaries exactly (no tolerance): on the reference attention and on the split one."""
    if split:
        monkeypatch.setattr(sdpa, "split_ok", lambda *a: True)
        monkeypatch.setattr(sdpa, "_cudnn", cpu_split)
    fast = forwards(rope, dtype)
    gathered(monkeypatch)
    assert_identical(fast, forwards(rope, dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_views_equal_the_gathered_path_on_cudnn(rope, monkeypatch):
    """On CUDA in bf16 (both parts on cuDNN when it runs): the same exactness."""
    fast = forwards(rope, torch.bfloat16, device="cuda")
    gathered(monkeypatch)
    assert_identical(fast, forwards(rope, torch.bfloat16, device="cuda"))


def test_a_forward_gathers_only_the_looked_up_units(rope, monkeypatch):
    """A forward of whole lookups on the device path: the chunk's windows and queries are not gathered,
    nor its output scattered, nor the representative scores' prefix sums read through index tensors.
    Its index operations are the distant keys and values (one each)."""
    monkeypatch.setattr(sdpa, "split_ok", lambda *a: True)
    monkeypatch.setattr(sdpa, "_cudnn", cpu_split)
    log = Ops()
    forwards(rope, torch.float32, log)  # the forward 69 .. 133: lookups of 8 from 69, all of one shape
    assert log.count["index"] == 2
    assert log.count["index_put_"] == 0 and log.count["_index_put_impl_"] == 0


def test_ramp_is_the_clamped_gather():
    """ramp(prefix, offset, count) = prefix[:, clamp(arange(count) + offset, 0, q)], exactly, for offsets
    that start before, inside and past the rows, and counts shorter and longer than them."""
    prefix = torch.randn(2, 6, 3)  # q = 5
    for offset in range(-9, 9):
        for count in (1, 3, 5, 12):
            index = (torch.arange(count) + offset).clamp(0, 5)
            assert torch.equal(ramp(prefix, offset, count), prefix[:, index])
