"""Batch-invariant decoding's kernels (`Engine(batch_invariant=True)`): a row's result must not depend on the
rows beside it, on where it sits in the batch, or (attention) on its slot's capacity.

- `kvpot.kernels.invariant.invariant_linear` against `F.linear` over named shapes, and bit for bit the same
  for a row alone, in a batch of any size and at any place in it.
- `decode_attention_batch(split_entries=...)` against the reference, and bit for bit the same for a row alone
  or in a batch, over a slot of any capacity.

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import BATCH_SHAPES, KERNEL_DEVICE, interpreter_runtime_loops, make_batch_inputs, needs_kernels

from kvpot.errors import KvpotError

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, N outputs, K inputs, bias)
LINEAR_SHAPES = [
    ("even", 128, 256, False),
    ("ragged-n-k", 70, 300, True),  # masks on both sides
    ("k-below-block", 16, 40, False),
    ("one-output-tile", 64, 64, True),
    ("long-k-tiles", 48, 1100, True),  # `tiles`: 512-wide K steps, the last one ragged
    ("wide-n-tiles", 9000, 1024, False),  # `tiles`: an MLP's 64 x 128 tiles
    ("head-tiles", 32800, 64, False),  # `tiles`: a vocabulary head's 128 x 64 tiles
]
if DEVICE == "cuda":  # the llama3-8b step's products and SmolLM2-135M's
    LINEAR_SHAPES += [("8b-q", 4096, 4096, False), ("8b-kv", 1024, 4096, False), ("8b-down", 4096, 14336, False),
                      ("smollm2-up", 1536, 576, False), ("smollm2-head", 49152, 576, False),
                      ("qwen-bias", 3584, 3584, True)]
LINEAR_IDS = [s[0] for s in LINEAR_SHAPES]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=2e-2)}
# bf16 matrix-unit products run on CUDA only: Triton 3.6's interpreter computes bf16 `tl.dot`s wrongly (their
# results were ~1e11 here), as the varlen kernel's tests found
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
BATCHES = (1, 2, 15, 16, 17, 40)  # one row, within one 16-row tile, one tile exactly, over it, several


def _linear_inputs(shape, dtype, rows):
    _, n, k, bias = shape
    gen = torch.Generator(device=DEVICE).manual_seed(n * 7 + k)
    weight = (torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5).to(dtype)
    x = torch.randn(rows, k, generator=gen, device=DEVICE).to(dtype)
    b = torch.randn(n, generator=gen, device=DEVICE).to(dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LINEAR_SHAPES, ids=LINEAR_IDS)
def test_invariant_linear_matches_linear(shape, dtype):
    from kvpot.kernels.invariant import invariant_linear

    x, weight, b = _linear_inputs(shape, dtype, 5)
    out = invariant_linear(x.view(5, 1, -1), weight, b)
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double()).to(dtype)
    assert out.shape == (5, 1, shape[1]) and out.dtype == dtype
    torch.testing.assert_close(out.view(5, -1), ref, **TOLERANCE[dtype])


INVARIANCE_SHAPES = [s for s in LINEAR_SHAPES if s[0] in ("even", "ragged-n-k", "long-k-tiles")]


def test_tiles_follow_the_weights_shape_alone():
    from kvpot.kernels.invariant import tiles

    assert tiles(4096, 4096) == (16, 512, 4, 3) and tiles(14336, 4096) == (64, 128, 4, 3)
    assert tiles(128256, 4096) == (128, 64, 4, 3) and tiles(576, 576) == (16, 256, 4, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", INVARIANCE_SHAPES, ids=[s[0] for s in INVARIANCE_SHAPES])
def test_each_row_comes_out_the_same_at_any_batch_and_place(shape, dtype):
    from kvpot.kernels.invariant import invariant_linear

    x, weight, b = _linear_inputs(shape, dtype, max(BATCHES))
    alone = torch.cat([invariant_linear(x[r : r + 1], weight, b) for r in range(x.shape[0])])
    for batch in BATCHES:
        assert torch.equal(invariant_linear(x[:batch], weight, b), alone[:batch]), batch
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert torch.equal(invariant_linear(x[order], weight, b), alone[order])  # each row at another place in its tile
    assert invariant_linear(x[:0], weight, b).shape == (0, shape[1])


@pytest.mark.parametrize("tile", [(64, 128, 4, 3), (128, 64, 4, 3), (16, 512, 4, 3)], ids=str)
def test_every_tile_shape_keeps_a_rows_bits(tile):
    """`tiles` picks other shapes for an MLP's and a vocabulary head's weights: each keeps rows independent."""
    from kvpot.kernels.invariant import invariant_linear

    x, weight, b = _linear_inputs(("tile", 200, 700, True), torch.float32, 20)
    batch = invariant_linear(x, weight, b, shape=tile)
    assert all(torch.equal(invariant_linear(x[r : r + 1], weight, b, shape=tile)[0], batch[r]) for r in (0, 7, 19))
    reference = F.linear(x.double(), weight.double(), b.double()).float()
    torch.testing.assert_close(batch, reference, **TOLERANCE[torch.float32])


def test_invariant_linear_refuses_what_it_cannot_take():
    from kvpot.kernels.invariant import invariant_linear

    x, weight, _ = _linear_inputs(LINEAR_SHAPES[0], torch.float32, 2)
    with pytest.raises(ValueError, match="last dimension"):
        invariant_linear(x[:, :-1], weight)
    with pytest.raises(ValueError, match="contiguous"):
        invariant_linear(x, weight.t().contiguous().t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width", [64, 576, 4096, 300])  # SmolLM2's and the 8B shape's hidden sizes, a ragged one
def test_invariant_mean_is_the_mean_and_the_same_at_any_batch(width, dtype):
    from kvpot.kernels.invariant import invariant_mean

    gen = torch.Generator(device=DEVICE).manual_seed(width)
    x = torch.randn(max(BATCHES), 1, width, generator=gen, device=DEVICE).pow(2).to(dtype)
    out = invariant_mean(x, keepdim=True)
    assert out.shape == (max(BATCHES), 1, 1) and out.dtype == dtype
    torch.testing.assert_close(out, x.double().mean(-1, keepdim=True).to(dtype), **TOLERANCE[dtype])
    for batch in BATCHES:
        assert torch.equal(invariant_mean(x[:batch]), out[:batch, :, 0]), batch
    assert invariant_mean(x[:0]).shape == (0, 1)


def _decode_case(shape, dtype, seed=3):
    query, keys, values, rows, lengths, extra = make_batch_inputs(shape, dtype, seed)
    return query, keys, values, rows, lengths, extra


INVARIANT_SHAPES = [s for s in BATCH_SHAPES if s[0].startswith(("b3", "shared", "empty"))]


@pytest.mark.parametrize("split_entries", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", INVARIANT_SHAPES, ids=[s[0] for s in INVARIANT_SHAPES])
def test_fixed_splits_give_each_row_the_same_alone_in_a_batch_and_at_any_capacity(shape, dtype, split_entries):
    from kvpot.kernels.decode import decode_attention_batch, decode_attention_batch_reference

    query, keys, values, rows, lengths, extra = _decode_case(shape, dtype)
    probs = torch.zeros(len(rows), keys.shape[1], keys.shape[2], device=DEVICE)
    out = decode_attention_batch(query, keys, values, rows, lengths, 0.125, probs=probs, split_entries=split_entries,
                                 **extra)
    ref_probs = torch.zeros_like(probs)
    ref = decode_attention_batch_reference(query, keys, values, rows, lengths, 0.125, probs=ref_probs, **extra)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-4)
    # each row alone: a batch of one, over the same pool
    for b in range(len(rows)):
        one = decode_attention_batch(query[b : b + 1], keys, values, rows[b : b + 1], lengths, 0.125,
                                     split_entries=split_entries, **extra)
        assert torch.equal(one[0], out[b]), b
    # the same entries in slots of a larger capacity: more (empty) splits after each row's last live one
    wider = keys.shape[2] + 3 * split_entries
    grown = [torch.zeros(t.shape[0], t.shape[1], wider, *t.shape[3:], dtype=t.dtype, device=DEVICE)
             for t in (keys, values, extra["key_positions"])]
    for big, small in zip(grown, (keys, values, extra["key_positions"])):
        big[:, :, : small.shape[2]] = small
    wide = decode_attention_batch(query, grown[0], grown[1], rows, lengths, 0.125, split_entries=split_entries,
                                  **{**extra, "key_positions": grown[2]})
    assert torch.equal(wide, out)


def test_split_entries_are_checked():
    from kvpot.kernels.decode import decode_attention_batch

    query, keys, values, rows, lengths, extra = _decode_case(BATCH_SHAPES[1], torch.float32)
    for bad in (dict(split_entries=100), dict(split_entries=0), dict(split_entries=64, num_splits=2)):
        with pytest.raises(KvpotError, match="split_entries"):
            decode_attention_batch(query, keys, values, rows, lengths, 0.125, **bad, **extra)
