"""The Triton shared-document decode kernel (`kvpot.kernels.shared`, cascade attention) against its PyTorch
reference (`kvpot.kernels.shared_reference`), over the named shapes of tests/test_shared_document.py and, on CUDA,
long ones. On CPU: `TRITON_INTERPRET=1` with Triton installed, as tests/test_decode_kernel.py runs. Entries the
kernel must not read (a shared row's own first entries, anything past a length) are NaN."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels
from test_shared_document import SHARED_SHAPES, shared_inputs

from kvpot.kernels.shared_reference import decode_attention_shared_reference

pytestmark = needs_kernels()
interpreter_runtime_loops()

LONG_SHAPES = [  # CUDA only: 64 readers of a llama3-8b-shaped 4,096-entry document, two documents, stragglers
    ("llama3-8b-64-readers-4k", 32, 8, 128, 4352, [4096], [(0, 4096 + 40 + i) for i in range(64)], list(range(64))),
    ("llama3-8b-two-docs-mixed", 32, 8, 128, 4352, [4096, 3000],
     [(i % 3 - 1, 4100 + i if i % 3 else 300 + i) for i in range(48)], list(range(48))),
]


def run(shape, rope: bool, dtype=torch.float32, probs: bool = False):
    from kvpot.kernels.shared import decode_attention_shared

    shared, _, rope_args, (key_positions, doc_positions, _) = shared_inputs(shape, rope)
    shared = tuple(t.to(KERNEL_DEVICE) for t in shared)
    shared = tuple(t.to(dtype) if t.is_floating_point() else t for t in shared)
    rope_args = {k: v.to(KERNEL_DEVICE) for k, v in rope_args.items()}
    extra = dict(key_positions=key_positions.to(KERNEL_DEVICE), doc_key_positions=doc_positions.to(KERNEL_DEVICE)) \
        if rope else {}
    batch, kv, capacity = len(shape[7]), shape[2], shape[4]
    kwargs = {}
    if probs:
        kwargs["probs"] = torch.zeros(batch, kv, capacity, device=KERNEL_DEVICE)
    out = decode_attention_shared(*shared, 0.125, **rope_args, **extra, **kwargs)
    expected = decode_attention_shared_reference(*shared, 0.125, **rope_args, **extra)
    return out, expected


@pytest.mark.parametrize("rope", [True, False], ids=["rope-on-load", "pre-rotated"])
@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=[s[0] for s in SHARED_SHAPES])
def test_shared_document_kernel_matches_the_reference(shape, rope):
    out, expected = run(shape, rope)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", LONG_SHAPES, ids=[s[0] for s in LONG_SHAPES])
def test_shared_document_kernel_matches_the_reference_on_long_documents(shape, dtype):
    out, expected = run(shape, rope=True, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_shared_document_kernel_with_an_observation_gives_the_reference():
    out, expected = run(SHARED_SHAPES[0], rope=True, probs=True)
    torch.testing.assert_close(out, expected)
