"""H2O's, TOVA's and D2O's steady decoding step: what its eviction launches per layer, counted without a clock
(issue 30; the counter is tests/test_step_launches.py's: aten operations that run a kernel, and Triton launches).

Before the folds (kvpot.kernels.replace's `fold`, `d2o_step`), per layer: H2O one `add_` (the accumulation) and
one replacement launch; TOVA one `mean` over the heads and one launch; D2O one `add_` and three launches (find,
nearest-key search, merge with the move); D2O without merging one `add_` and one launch. Now: one launch each,
as StreamingLLM's ring, and no PyTorch operation around it. D2O's first steady step also allocates its
per-layer split counter (zeros, once, before a graph captures the step).

Runs where the kernels run: CUDA, or a CPU with Triton and `TRITON_INTERPRET=1`.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build, interpreter_runtime_loops, needs_kernels
from test_step_launches import Launches, _wrap_triton

import kvpot

pytestmark = needs_kernels()
interpreter_runtime_loops()

# name -> (method, model dtype, the one kernel a steady step launches per layer)
METHODS = {
    "h2o": (lambda: kvpot.H2O(heavy=12, recent=12, chunk_size=16), torch.float32, "_replace_kernel"),
    "h2o-absolute": (lambda: kvpot.H2O(heavy=12, recent=8, chunk_size=16, positions="absolute"), torch.bfloat16,
                     "_replace_kernel"),
    "tova": (lambda: kvpot.TOVA(budget=24, chunk_size=16), torch.float32, "_replace_kernel"),
    "d2o": (lambda: kvpot.D2O(budget=24, sinks=2, chunk_size=16), torch.bfloat16, "_d2o_kernel"),
    "d2o-nomerge": (lambda: kvpot.D2O(budget=24, chunk_size=32, merge=False, layer_budget=False), torch.float32,
                    "_replace_kernel"),
}


def steady_launches(name: str, monkeypatch) -> list[tuple[tuple, tuple]]:
    """(aten operations, Triton launches) of every steady step's `after_forward` in a fixed-shape decode."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    make, dtype, _ = METHODS[name]
    model = build("llama3").to(device, dtype)
    method = make()
    counter = Launches()
    _wrap_triton(monkeypatch, counter)
    original = method.after_forward
    steps = []

    def keeps(cache, step):
        if isinstance(method, kvpot.D2O):
            return cache.method_state.get("d2o.budgets")
        return [method.keep_count(layer, step) for layer in cache.layers]

    def spy(cache, step):
        keep = keeps(cache, step)
        if keep is None or not (cache.static and all(layer.n == k + 1 for layer, k in zip(cache.layers, keep))):
            return original(cache, step)
        counter.aten.clear()
        counter.triton.clear()
        counter.counting = True
        try:
            with counter:
                return original(cache, step)
        finally:
            counter.counting = False
            steps.append((tuple(counter.aten), tuple(counter.triton)))

    monkeypatch.setattr(method, "after_forward", spy)
    torch.manual_seed(3)
    context, question = torch.randint(3, VOCAB, (64,)), torch.randint(3, VOCAB, (4,))
    kvpot.Engine(model, method=method, decode="static").generate_ids(
        context.to(device), question.to(device), max_new_tokens=12, ignore_eos=True)
    return steps


@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_steady_step_is_one_launch_per_layer(name, monkeypatch, one_thread):
    steps = steady_launches(name, monkeypatch)
    layers = build("llama3").config.num_hidden_layers
    kernel = METHODS[name][2]
    assert len(steps) >= 8  # the steps at the budget were seen
    first, rest = steps[0], steps[1:]
    assert set(rest) == {((), (kernel,) * layers)}, rest  # per layer: one launch, no PyTorch operation
    assert first[1] == (kernel,) * layers
    assert set(first[0]) <= {"zeros"} and len(first[0]) <= layers  # D2O's counters, made once


def test_a_steady_steps_counts_settle_in_one_operation():
    """After the eviction the device-side counts go back to the host's: one `_foreach_sub_` for every layer
    where each dropped one entry (not a `fill_` per layer), each layer's own count otherwise."""
    from types import SimpleNamespace

    from kvpot.engine.sequence import settle_lengths

    def layers(counts, devices):
        return [SimpleNamespace(n=n, length=torch.tensor([d])) for n, d in zip(counts, devices)]

    steady = layers([24, 30, 24], [25, 31, 25])  # the append's count on the device, the eviction's on the host
    counter = Launches()
    counter.counting = True
    with counter:
        settle_lengths(steady, [25, 31, 25])
    assert counter.aten == ["_foreach_sub_"]
    assert [layer.length.item() for layer in steady] == [24, 30, 24]
    mixed = layers([24, 31], [25, 31])  # the second layer did not evict: each set from its host count
    settle_lengths(mixed, [25, 31])
    assert [layer.length.item() for layer in mixed] == [24, 31]
