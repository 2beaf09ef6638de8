"""Kernel launchers' size arithmetic under `torch.compile(dynamic=True)` (kvpot's compiled step).

On an H100 the compiled step stalled in tracing: `triton.next_power_of_2` on symbolic sizes grew into
nested bitwise expressions. `kernels.common.next_power_of_2` compares instead, so the traced graph holds
no bit twiddling and the size is a constant under guards. Runs on CPU (no kernel is launched)."""

import pytest
import torch

triton = pytest.importorskip("triton")  # the launchers' module imports Triton (a GPU extra)
from kvpot.kernels.common import next_power_of_2  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 3, 16, 17, 1000, 4096, 4097, 2**20 + 1])
def test_equals_tritons_on_plain_ints(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)


def test_a_symbolic_size_becomes_a_constant_without_bit_operations():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm

    def block(x):
        return torch.zeros(max(16, next_power_of_2(x.shape[0]))) + x.sum()

    compiled = torch.compile(block, dynamic=True, backend=backend)
    assert compiled(torch.ones(20)).shape == (32,)
    assert compiled(torch.ones(30)).shape == (32,)  # same power of two: the same graph serves
    assert compiled(torch.ones(40)).shape == (64,)
    assert len(graphs) == 2
    for targets in graphs:
        assert not any(name in " ".join(targets) for name in ("rshift", "or_")), targets
