"""RoPE in one Triton launch (`kvpot.kernels.rope.rotate_tokens`) against `Rope.rotate`'s PyTorch operations:
equal bit for bit, over named shapes and dtypes: one token (a decoding step's query or key) and many (a prompt
chunk's queries, a whole cache's keys read through a slice of its buffer).

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, needs_kernels, rope_table

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()

# (name, batch, heads, kv heads, head dim): queries of GQA groups, keys, batched rows
SHAPES = [("query-gqa4", 1, 8, 2, 64), ("key", 1, 2, 2, 64), ("rows-d32", 3, 6, 3, 32), ("d128", 2, 4, 1, 128)]
if DEVICE == "cuda":
    SHAPES += [("llama3-8b-query", 1, 32, 8, 128), ("llama3-8b-rows", 64, 8, 8, 128)]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def pytorch_rotate(x, positions, cos, sin):
    """`Rope.rotate`'s arithmetic, written out (what the kernel must give bit for bit)."""
    b, heads, n, d = x.shape
    kv = positions.shape[1]
    c, s = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)
    grouped = x.view(b, kv, heads // kv, n, d)
    half = d // 2
    turned = torch.cat((-grouped[..., half:], grouped[..., :half]), dim=-1)
    return (grouped * c + turned * s).view(b, heads, n, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_one_token_rotation_is_pytorchs_bit_for_bit(shape, dtype):
    from kvpot.kernels.rope import rotate_tokens, supports

    _, b, heads, kv, d = shape
    g = torch.Generator().manual_seed(heads + d)
    cos, sin = rope_table(5000, d, dtype)
    x = (torch.randn(b, 1, heads, d, generator=g) * 3).to(DEVICE, dtype).transpose(1, 2)  # the model's layout
    positions = torch.randint(0, 5000, (b, kv, 1), generator=g).to(DEVICE)
    assert supports(x, positions)
    assert torch.equal(rotate_tokens(x, positions, cos, sin), pytorch_rotate(x, positions, cos, sin))
    shared = positions[:, :1].expand(b, kv, 1)  # one position for every head (a decoding step's query)
    assert torch.equal(rotate_tokens(x, shared, cos, sin), pytorch_rotate(x, shared, cos, sin))


# (name, batch, heads, kv heads, head dim, tokens, buffer capacity or None): tokens not a multiple of a program's
# 64, GQA groups, keys read as a slice of a larger buffer (the cache's `keys[:, :, :n]`)
MANY = [("chunk-queries-gqa4", 1, 8, 2, 64, 70, None), ("cache-keys-slice", 1, 2, 2, 64, 130, 256),
        ("rows-d32", 2, 6, 3, 32, 5, None), ("d128-one-group", 1, 4, 1, 128, 64, 100)]
if DEVICE == "cuda":
    MANY += [("llama3-8b-chunk-queries", 1, 32, 8, 128, 1024, None), ("llama3-8b-cache-keys", 1, 8, 8, 128, 4096, 5120)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MANY, ids=[s[0] for s in MANY])
def test_many_tokens_rotation_is_pytorchs_bit_for_bit(shape, dtype):
    from kvpot.kernels.rope import rotate_tokens, supports

    _, b, heads, kv, d, n, capacity = shape
    g = torch.Generator().manual_seed(heads + d + n)
    cos, sin = rope_table(9000, d, dtype)
    if capacity is None:  # the model's layout: [b, n, heads, d] transposed
        x = (torch.randn(b, n, heads, d, generator=g) * 3).to(DEVICE, dtype).transpose(1, 2)
    else:  # a slice of a buffer of `capacity` entries
        x = (torch.randn(b, heads, capacity, d, generator=g) * 3).to(DEVICE, dtype)[:, :, :n]
    positions = torch.randint(0, 9000, (b, kv, n), generator=g).to(DEVICE)
    assert supports(x, positions)
    out = rotate_tokens(x, positions, cos, sin)
    assert out.is_contiguous() and torch.equal(out, pytorch_rotate(x, positions, cos, sin))
    shared = positions[:, :1].expand(b, kv, n)  # every head at one set of positions (stride 0 over heads)
    assert torch.equal(rotate_tokens(x, shared, cos, sin), pytorch_rotate(x, shared, cos, sin))


def test_the_kernel_refuses_what_it_cannot_take():
    from kvpot.kernels.rope import supports

    x = torch.zeros(1, 4, 8, 64, device=DEVICE)
    assert not supports(x, torch.zeros(1, 2, 7, dtype=torch.long, device=DEVICE))  # a position per token
    assert not supports(x, torch.zeros(1, 3, 8, dtype=torch.long, device=DEVICE))  # heads over KV heads
    assert not supports(torch.zeros(1, 4, 8, 48, device=DEVICE), torch.zeros(1, 2, 8, dtype=torch.long,
                                                                            device=DEVICE))  # half dim 24
    assert not supports(x.transpose(2, 3), torch.zeros(1, 2, 64, dtype=torch.long, device=DEVICE))  # strided d
    if DEVICE == "cuda":  # positions on another device than the tokens (a split model's layer): PyTorch's path
        assert not supports(x, torch.zeros(1, 2, 8, dtype=torch.long))


def test_rope_rotates_many_tokens_with_the_kernel_as_without(monkeypatch):
    """`Rope.rotate` of a chunk's queries and of a cache's keys: the kernel's answer is the PyTorch path's."""
    from conftest import build

    from kvpot import rope as rope_module
    from kvpot.rope import Rope

    model = build("llama3").to(DEVICE)
    rope = Rope(model.model.rotary_emb)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 33, 16, generator=g).to(DEVICE)
    positions = torch.randint(0, 3000, (1, 2, 33), generator=g).to(DEVICE)
    fast = rope.rotate(x, positions, 3000)
    monkeypatch.setattr(rope_module, "_kernel_rotates", lambda *args: False)
    assert torch.equal(fast, rope.rotate(x, positions, 3000))


def test_rope_rotates_one_token_with_the_kernel_as_without(monkeypatch):
    """`Rope.rotate` of a decoding step's query: the kernel's answer is the PyTorch path's."""
    from conftest import build

    from kvpot import rope as rope_module
    from kvpot.rope import Rope

    model = build("llama3").to(DEVICE)
    rope = Rope(model.model.rotary_emb)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 1, 16, generator=g).to(DEVICE)
    positions = torch.tensor([[[70], [1234]]], device=DEVICE)
    fast = rope.rotate(x, positions, 2000)
    monkeypatch.setattr(rope_module, "_kernel_rotates", lambda *args: False)
    assert torch.equal(fast, rope.rotate(x, positions, 2000))
