"""The Triton replacement kernel (`kvpot.kernels.replace`) against its PyTorch path
(`kvpot.methods.replace.replace_reference`), over named shapes: every buffer equal after the step.

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels

from kvpot.methods.replace import replace_reference

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, slots, kv heads, capacity, head dim, live n, batch rows' slots or None, sinks, recent, ranking)
# ranking: "head" (per KV head, H2O/D2O), "shared" (one for the heads, TOVA), "age" (StreamingLLM's ring)
SHAPES = [
    ("h2o-recent", 1, 2, 40, 64, 33, None, 0, 8, "head"),
    ("tova-shared", 1, 4, 24, 32, 24, None, 0, 0, "shared"),
    ("streaming-ring", 1, 2, 30, 16, 29, None, 4, 0, "age"),
    ("d2o-sinks-recent", 1, 3, 50, 128, 41, None, 4, 9, "head"),
    ("rows-gathered", 5, 2, 36, 64, 20, [3, 0, 4], 2, 5, "head"),
    ("rows-shared", 4, 2, 36, 32, 36, [1, 2], 0, 0, "shared"),
    ("rows-age", 3, 2, 18, 16, 18, [2, 1, 0], 1, 0, "age"),
]
if DEVICE == "cuda":
    SHAPES += [("llama3-8b-h2o", 1, 8, 4097, 128, 4097, None, 0, 2048, "head"),
               ("llama3-8b-streaming", 1, 8, 4097, 128, 4097, None, 4, 0, "age"),
               ("llama3-8b-rows", 9, 8, 4097, 128, 4097, [0, 3, 5, 8], 0, 0, "shared")]
IDS = [s[0] for s in SHAPES]


def inputs(shape, renumber: bool, seed: int):
    _, slots, kv, capacity, d, n, rows, sinks, recent, ranking = shape
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, kv, capacity, d, generator=g)
    values = torch.randn(slots, kv, capacity, d, generator=g)
    # each head's places shuffled (as replacements leave them), the sinks first and the newest last
    order = torch.stack([torch.cat([torch.arange(sinks), sinks + torch.randperm(n - sinks - 1, generator=g),
                                    torch.tensor([n - 1])]) for _ in range(slots * kv)]).view(slots, kv, n)
    if ranking != "head":  # a shared selection: every head holds the same entries
        order = order[:, :1].expand(slots, kv, n)
    positions = torch.randint(0, 10**6, (slots, kv, capacity), generator=g)
    positions[..., :n] = 500 + order * 3 // 2  # increasing with stream order, with gaps
    positions[..., n - 1] = 500 + (n - 1) * 3 // 2
    rope = order.clone() if renumber else positions[..., :n].clone()
    rope_positions = torch.randint(0, 10**6, (slots, kv, capacity), generator=g)
    rope_positions[..., :n] = rope
    stored = torch.rand(slots, kv, capacity, generator=g)
    batch = slots if rows is None else len(rows)
    heads = kv if ranking == "head" else 1
    # small integers: many ties, which the oldest entry must win
    scores = None if ranking == "age" else torch.randint(0, 4, (batch, heads, capacity + 3), generator=g).float()
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    rows_t = None if rows is None else torch.tensor(rows, dtype=torch.long, device=DEVICE)
    return [to(t) for t in (keys, values, positions, rope_positions, stored)], to(scores), rows_t


@pytest.mark.parametrize("renumber", [True, False], ids=["rank", "absolute"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_kernel_replaces_as_pytorch(shape, renumber):
    from kvpot.kernels.replace import replace_newest

    n, sinks, recent = shape[5], shape[7], shape[8]
    for seed in range(3):
        buffers, scores, rows = inputs(shape, renumber, seed)
        expected = [b.clone() for b in buffers]
        want = replace_reference(*expected[:4], [expected[4]], n, None if scores is None else scores[..., :n], rows,
                                 sinks, recent, renumber)
        got = replace_newest(*buffers[:4], n, scores, buffers[4], rows, sinks, recent, renumber)
        assert torch.equal(got, want.expand_as(got)), seed
        for name, a, b in zip(("keys", "values", "positions", "rope", "stored"), buffers, expected):
            assert torch.equal(a, b), (name, seed)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=IDS[:2])
def test_kernel_finds_then_moves_as_one_launch(shape):
    """D2O's split: find (nothing written), merge elsewhere, then move the entries found."""
    from kvpot.kernels.replace import replace_newest

    n, sinks, recent = shape[5], shape[7], shape[8]
    buffers, scores, rows = inputs(shape, True, 7)
    together = [b.clone() for b in buffers]
    before = [b.clone() for b in buffers]
    drop = replace_newest(*buffers[:4], n, scores, buffers[4], rows, sinks, recent, True, move=False)
    for a, b in zip(buffers, before):
        assert torch.equal(a, b)
    replace_newest(*buffers[:4], n, None, buffers[4], rows, renumber=True, drop=drop, find=False)
    replace_newest(*together[:4], n, scores, together[4], rows, sinks, recent, True)
    for a, b in zip(buffers, together):
        assert torch.equal(a, b)
