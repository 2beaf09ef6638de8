"""The batched step's Triton cache append (`kvpot.kernels.append`) against its PyTorch reference
(`kvpot.kernels.append_reference`), over named shapes: every buffer equal after the append.

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels

from kvpot.errors import KvpotError
from kvpot.kernels.append_reference import append_rows_reference

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, slots incl. scratch, kv heads, capacity, head dim, rows' slots (the last slot is scratch), dtype, rotated)
SHAPES = [
    ("one-row", 2, 8, 40, 128, [0], torch.float32, False),
    ("rows-rank", 6, 2, 33, 64, [3, 0, 4], torch.float32, False),
    ("rows-rotated", 5, 4, 17, 32, [1, 2, 0], torch.float32, True),
    ("padding-on-scratch", 4, 2, 20, 64, [2, 0, 3, 3, 3], torch.float32, False),
    ("bf16-d256", 3, 1, 12, 256, [1, 0], torch.bfloat16, True),
    ("d-not-power-of-two", 3, 3, 9, 80, [0, 2], torch.float32, False),
]
if DEVICE == "cuda":
    SHAPES += [("llama3-8b-64-rows", 65, 8, 4097, 128, list(range(60)) + [64] * 4, torch.bfloat16, False)]
IDS = [s[0] for s in SHAPES]


def inputs(shape, seed: int = 0):
    _, slots, kv, capacity, d, rows, dtype, _ = shape
    g = torch.Generator().manual_seed(seed)
    pool = {
        "keys": torch.randn(slots, kv, capacity, d, generator=g).to(dtype),
        "values": torch.randn(slots, kv, capacity, d, generator=g).to(dtype),
        "positions": torch.randint(0, 10**6, (slots, kv, capacity), generator=g),
        "rope_positions": torch.randint(0, 10**6, (slots, kv, capacity), generator=g),
        "query_position": torch.randint(0, 10**6, (slots,), generator=g),
        "lengths": torch.randint(0, capacity, (slots,), generator=g),
    }
    pool["lengths"][-1] = 0  # the scratch slot, as each step starts it
    b = len(rows)
    rows = torch.tensor(rows)
    new = {
        "rows": rows,
        "index": pool["lengths"][rows].clone(),
        # made wider than they are stored, then sliced: the kernel reads any strides but the head dim's
        "new_keys": torch.randn(b, kv, d + 8, generator=g)[..., :d].to(dtype),
        "new_values": torch.randn(b, kv, d, generator=g).to(dtype),
        "stream_positions": torch.randint(0, 10**6, (b,), generator=g),
    }
    return ({k: v.to(DEVICE) for k, v in pool.items()}, {k: v.to(DEVICE) for k, v in new.items()})


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_the_append_kernel_writes_what_the_reference_writes(shape):
    from kvpot.kernels.append import append_rows

    rotated = shape[-1]
    pool, new = inputs(shape)
    expected = {k: v.clone() for k, v in pool.items()}
    append_rows_reference(**expected, **new, rotated=rotated)
    append_rows(**pool, **new, rotated=rotated)
    rows = new["rows"].tolist()
    shared = {(slot, at) for slot, at in zip(rows, new["index"].tolist()) if rows.count(slot) > 1}
    for slot, at in shared:  # padding rows on one slot: one of theirs lands there, per head (a race on CUDA)
        mine = [b for b, other in enumerate(rows) if other == slot]
        for name, source in (("keys", "new_keys"), ("values", "new_values")):
            for head in range(pool[name].shape[1]):
                written = pool[name][slot, head, at]
                assert any(torch.equal(written, new[source][b, head].to(written.dtype)) for b in mine), (name, head)
            pool[name][slot, :, at] = expected[name][slot, :, at]  # then compared with the rest
    for name in pool:
        assert torch.equal(pool[name], expected[name]), name
    # the rows' own entries were written (not only left equal): the count moved past each
    for slot, at in zip(new["rows"].tolist(), new["index"].tolist()):
        assert pool["lengths"][slot].item() == at + 1
        assert pool["positions"][slot, :, at].eq(pool["positions"][slot, 0, at]).all()


def test_the_append_kernel_refuses_buffers_that_do_not_fit():
    from kvpot.kernels.append import append_rows

    pool, new = inputs(SHAPES[1])
    with pytest.raises(KvpotError, match="do not fit"):
        append_rows(**pool, **{**new, "new_values": new["new_values"][:, :1]}, rotated=False)
    with pytest.raises(KvpotError, match="contiguous"):
        append_rows(**{**pool, "keys": pool["keys"].transpose(2, 3).contiguous().transpose(2, 3)}, **new,
                    rotated=False)
