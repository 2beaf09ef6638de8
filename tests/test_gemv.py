"""One token's linear layer in Triton (`kvpot.kernels.gemv.gemv`) against `F.linear` over named shapes.

Float32 products must agree to float32 rounding; bf16/fp16 ones to one unit of the output's last place
(the kernel sums in float32 in another order than the reference). Runs on CUDA; on a CPU machine with
Triton installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, N outputs, K inputs, bias, launch shape or None for `config`'s)
SHAPES = [
    ("even", 64, 256, False, (4, 128, 4)),
    ("ragged-n-k", 70, 300, True, (4, 128, 4)),  # masks on both sides
    ("one-row-programs", 33, 64, True, (1, 64, 1)),
    ("k-below-block", 16, 40, False, None),
    ("default-shape", 96, 1024, False, None),
]
if DEVICE == "cuda":  # the llama3-8b and llama3.2-1b step's products, each at its tuned shape
    SHAPES += [("8b-q", 4096, 4096, False, None), ("8b-kv", 1024, 4096, False, None),
               ("8b-up", 14336, 4096, False, None), ("8b-down", 4096, 14336, False, None),
               ("8b-head", 128256, 4096, False, None), ("1b-kv", 512, 2048, False, None),
               ("qwen-bias", 3584, 3584, True, None)]
IDS = [s[0] for s in SHAPES]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2**-10, atol=2e-3),
             torch.bfloat16: dict(rtol=2**-7, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_gemv_matches_linear(shape, dtype):
    from kvpot.kernels.gemv import gemv

    _, n, k, bias, launch = shape
    gen = torch.Generator(device=DEVICE).manual_seed(n * 7 + k)
    weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(dtype)
    x = torch.randn(1, 1, k, generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    out = gemv(x, weight, b, shape=launch)
    # the reference in float64 from the same rounded inputs, rounded once to the output's dtype
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double()).to(dtype)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLERANCE[dtype])


def test_gemv_reads_strided_rows():
    """A weight whose rows are a slice of wider ones (a fused projection's part) is read in place."""
    from kvpot.kernels.gemv import gemv

    gen = torch.Generator(device=DEVICE).manual_seed(3)
    wide = torch.randn(48, 200, generator=gen, device=DEVICE)
    weight = wide[:, 8:136]
    x = torch.randn(128, generator=gen, device=DEVICE)
    torch.testing.assert_close(gemv(x, weight, shape=(4, 64, 2)), weight.double().mv(x.double()).float(),
                               rtol=1e-5, atol=1e-5)


def test_gemv_refuses_more_than_one_row():
    from kvpot.kernels.gemv import gemv

    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 16, device=DEVICE), torch.zeros(8, 16, device=DEVICE))


@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 14336), (512, 2048), (128256, 4096), (7, 3)])
def test_config_tiles_the_product(n, k):
    """Launch shapes are powers of two, a tile never wider than K rounded up, and warps the kernel takes."""
    from kvpot.kernels.gemv import config

    block_n, block_k, warps = config(n, k)
    for size in (block_n, block_k, warps):
        assert size & (size - 1) == 0
    assert block_k <= max(16, 1 << (k - 1).bit_length()) and 1 <= warps <= 16
