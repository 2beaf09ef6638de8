"""What a steady decoding step's eviction launches per layer, counted without a clock (issue 31).

RoCo's and CaM's steady steps (statistics or A updated, the entry dropped, CaM's merge, the newest written
into its slot) run as one Triton launch per layer where the kernels run; around it, nothing: no PyTorch
operation that runs a kernel. A `TorchDispatchMode` sees every aten operation (views and allocations run
none and are not counted) and the Triton launchers are wrapped, while `after_forward` runs in a steady
fixed-shape step. The PyTorch path before these kernels issued ~20-30 operations per layer here.

Runs where the kernels run: CUDA, or a CPU with Triton and `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build, interpreter_runtime_loops, needs_kernels
from torch.utils._python_dispatch import TorchDispatchMode

import kvpot

pytestmark = needs_kernels()
interpreter_runtime_loops()

FREE = {"empty", "empty_strided", "empty_like", "lift_fresh", "detach"}  # allocations and aliases: no kernel


class Launches(TorchDispatchMode):
    """Counts aten operations that run a kernel and Triton launches (`triton_calls`), where `counting`."""

    def __init__(self):
        super().__init__()
        self.aten: list[str] = []
        self.triton: list[str] = []
        self.counting = False
        self.inside_triton = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.counting and not self.inside_triton and not func.is_view and name not in FREE:
            self.aten.append(name)
        return func(*args, **(kwargs or {}))


def _wrap_triton(monkeypatch, counter: Launches) -> None:
    """Every Triton kernel launch (compiled or interpreted) goes through its class's `run`."""
    from triton.runtime import interpreter, jit

    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            if counter.counting:
                counter.triton.append(getattr(self, "__name__", getattr(self.fn, "__name__", "?")))
            counter.inside_triton = True  # what the interpreter does with the arguments is not the step's
            try:
                return _original(self, *args, **kwargs)
            finally:
                counter.inside_triton = False

        monkeypatch.setattr(cls, "run", run)


METHODS = {
    "streaming": lambda: kvpot.StreamingLLM(sinks=4, window=20, chunk_size=16),
    "roco": lambda: kvpot.RoCo(budget=24, sinks=2, recent=4, volatile=0.25, chunk_size=16),
    "roco-absolute": lambda: kvpot.RoCo(budget=24, sinks=0, recent=3, chunk_size=16, positions="absolute"),
    "cam": lambda: kvpot.CaM(start=4, recent=20, merge_budget=6, chunk_size=16),
    "cam-nomerge": lambda: kvpot.CaM(start=2, recent=16, merge=False, chunk_size=16, positions="absolute"),
}


def steady_counts(name: str, monkeypatch) -> list[tuple[int, int]]:
    """(aten operations, Triton launches) per layer of every steady step's eviction in a fixed-shape decode."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build("llama3").to(device)
    method = METHODS[name]()
    counter = Launches()
    _wrap_triton(monkeypatch, counter)
    original = method.after_forward
    counts = []

    def spy(cache, step):
        keep = method.keep_count(cache.layers[0], step)
        if not (cache.static and all(layer.n == keep + 1 for layer in cache.layers)):
            return original(cache, step)
        counter.aten.clear()
        counter.triton.clear()
        counter.counting = True
        try:
            with counter:
                return original(cache, step)
        finally:
            counter.counting = False
            layers = len(cache.layers)
            counts.append((len(counter.aten) / layers, len(counter.triton) / layers))

    monkeypatch.setattr(method, "after_forward", spy)
    torch.manual_seed(3)
    context, question = torch.randint(3, VOCAB, (64,)), torch.randint(3, VOCAB, (4,))
    kvpot.Engine(model, method=method, decode="static").generate_ids(
        context.to(device), question.to(device), max_new_tokens=12, ignore_eos=True)
    return counts


@pytest.mark.parametrize("name", ["roco", "roco-absolute", "cam", "cam-nomerge"])
def test_a_steady_step_is_one_launch_per_layer(name, monkeypatch, one_thread):
    counts = steady_counts(name, monkeypatch)
    assert len(counts) >= 8  # the steps at the budget were seen
    assert set(counts) == {(0, 1)}, counts  # per layer: no PyTorch operation, one Triton launch


def test_streaming_is_the_yardstick(monkeypatch, one_thread):
    """StreamingLLM's ring, the speed RoCo and CaM are measured against: one launch per layer too."""
    assert set(steady_counts("streaming", monkeypatch)) == {(0, 1)}
