"""CaM's steady step in one Triton launch (`kvpot.kernels.cam.cam_step`) against its PyTorch path
(`kvpot.methods.cam.steady_reference`: A += observation, the oldest entry past the start dropped, its value
merged into the m entries that follow it by stream position, the newest written over it), over named shapes.

The kept entries, keys, positions and A must be equal; merged values within one rounding of the cache's
dtype (the mean over the targets sums in another order). Runs on CUDA; on a CPU machine with Triton
installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels

from kvpot.methods.cam import steady_reference

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, slots, kv heads, capacity, head dim, live n, batch rows' slots or None, start, m); the recent
# window holds the n - start entries after the start, the dropped one first, the newest last
SHAPES = [
    ("one-sequence", 1, 2, 40, 64, 33, None, 4, 6),
    ("newest-a-target", 1, 2, 24, 32, 20, None, 2, 17),  # m = recent: the newest entry is merged into, then moves
    ("no-start-m1", 1, 3, 30, 16, 30, None, 0, 1),
    ("rows", 5, 2, 36, 64, 20, [3, 0, 4], 2, 5),
    ("blocks", 1, 2, 2100, 16, 2050, None, 8, 32),  # three loop steps over the entries
]
if DEVICE == "cuda":
    SHAPES += [("llama3-8b", 1, 8, 6144, 128, 4097, None, 2048, 32),
               ("llama3-8b-rows", 9, 8, 6144, 128, 4097, [0, 3, 5, 8], 2048, 32)]
IDS = [s[0] for s in SHAPES]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # bf16 interpreted: conftest rounds its casts as GPUs do
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float16: dict(rtol=2**-10, atol=1e-3),
             torch.bfloat16: dict(rtol=2**-7, atol=1e-2)}  # one unit in the last place


def inputs(shape, dtype, renumber: bool, seed: int):
    """Buffers as a ring of replacements leaves them: the start in its places, the window's consecutive
    positions shuffled over the other places (every head alike: a shared selection), the newest last."""
    _, slots, kv, capacity, d, n, rows, start, m = shape
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, kv, capacity, d, generator=g).to(dtype)
    values = torch.randn(slots, kv, capacity, d, generator=g).to(dtype)
    window = n - start
    order = torch.stack([torch.cat([torch.arange(start), start + torch.randperm(window - 1, generator=g),
                                    torch.tensor([n - 1])]) for _ in range(slots)]).view(slots, 1, n).expand(slots, kv, n)
    first = torch.randint(start + 1, 10**5, (slots, 1, 1), generator=g)
    positions = torch.randint(0, 10**6, (slots, kv, capacity), generator=g)
    positions[..., :n] = torch.where(order < start, order, first + order - start)
    rope_positions = torch.randint(0, 10**6, (slots, kv, capacity), generator=g)
    rope_positions[..., :n] = order if renumber else positions[..., :n]
    accumulated = torch.rand(slots, kv, capacity, generator=g) * 4
    accumulated[0, -1] = 0.0  # never attended: 0/0, the release's guard gives p = 0
    if kv > 2:
        accumulated[0, 1, :n] = torch.where(order[0, 1] == start, 1.0, 0.0)  # only the dropped one: x/0 -> p = 1
    batch = slots if rows is None else len(rows)
    observation = torch.rand(batch, kv, capacity + 3, generator=g)
    if rows is None:
        observation[0, -1] = 0.0
    to = lambda t: t.to(DEVICE)  # noqa: E731
    rows_t = None if rows is None else torch.tensor(rows, dtype=torch.long, device=DEVICE)
    return [to(t) for t in (keys, values, positions, rope_positions, accumulated)], to(observation), rows_t


@pytest.mark.parametrize("merge", [True, False], ids=["merge", "nomerge"])
@pytest.mark.parametrize("renumber", [True, False], ids=["rank", "absolute"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_kernel_steps_as_pytorch(shape, dtype, renumber, merge):
    from kvpot.kernels.cam import cam_step

    n, start, m = shape[5], shape[7], shape[8]
    for seed in range(2):
        buffers, observation, rows = inputs(shape, dtype, renumber, seed)
        expected = [b.clone() for b in buffers]
        want = steady_reference(*expected, observation, n, rows, start, m, merge, renumber)
        got = cam_step(*buffers, observation, n, rows, start, m, merge, renumber)
        assert torch.equal(got, want), seed
        for name, a, b in zip(("keys", "positions", "rope", "accumulated"), [buffers[0], *buffers[2:]],
                              [expected[0], *expected[2:]]):
            assert torch.equal(a, b), (name, seed)
        torch.testing.assert_close(buffers[1].cpu(), expected[1].cpu(), **TOLERANCE[dtype])


def test_the_merge_is_not_vacuous():
    """The reference moved the merged values (so the comparison above checks a merge): with merging on, the
    targets' values differ from a plain replacement's, on heads whose dropped entry was attended."""
    shape = SHAPES[0]
    n, start, m = shape[5], shape[7], shape[8]
    merged, observation, rows = inputs(shape, torch.float32, True, 0)
    plain = [b.clone() for b in merged]
    steady_reference(*merged, observation, n, rows, start, m, True, True)
    steady_reference(*plain, observation, n, rows, start, m, False, True)
    changed = (merged[1][0, :, : n - 1] != plain[1][0, :, : n - 1]).any(dim=-1).sum(dim=-1)  # [kv] entries changed
    assert changed.tolist() == [m, 0]  # head 1 never attended anything: p = 0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES[-2:], ids=IDS[-2:])
def test_captured_steps_replay_as_pytorch(shape):
    """The step captured once in a CUDA graph (it never waits for the host) and replayed step after step,
    each after a new entry was appended: the reference's entries at every step."""
    from kvpot.kernels.cam import cam_step

    n, start, m = shape[5], shape[7], shape[8]
    buffers, observation, rows = inputs(shape, torch.bfloat16, True, 0)
    expected = [b.clone() for b in buffers]
    args = (n, rows, start, m, True, True)
    warm = [b.clone() for b in buffers]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cam_step(*warm, observation, *args)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drop = cam_step(*buffers, observation, *args)
    for step in range(4):
        if step:
            for buf in (buffers, expected):  # the next token appended at place n - 1
                newest = buf[2][..., : n - 1].amax(dim=-1)
                buf[2][..., n - 1] = newest + 1
                buf[3][..., n - 1] = n - 1
                buf[4][..., n - 1] = 0.0
        observation.uniform_()
        graph.replay()
        want = steady_reference(*expected, observation, *args)
        assert torch.equal(drop, want), step
        for a, b in zip([buffers[0], *buffers[2:]], [expected[0], *expected[2:]]):
            assert torch.equal(a, b), step
        torch.testing.assert_close(buffers[1], expected[1], **TOLERANCE[torch.bfloat16])
