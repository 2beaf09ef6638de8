"""RoCo's steady step in one Triton launch (`kvpot.kernels.roco.roco_step`) against its PyTorch path
(`kvpot.methods.roco.steady_reference`: `update_scores`, `ranking`, `replace_reference`), over named shapes:
the same entry dropped and every buffer equal after the step, ties in std and in mean included.

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1` runs it in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels

from kvpot.methods.roco import steady_reference

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()

# (name, slots, kv heads, capacity, head dim, live n, batch rows' slots or None, sinks, recent, volatile)
SHAPES = [
    ("one-sequence", 1, 2, 40, 64, 33, None, 2, 4, 5),
    ("no-volatile", 1, 2, 24, 32, 24, None, 0, 0, 0),
    ("no-sinks-no-recent", 1, 3, 30, 16, 29, None, 0, 0, 6),
    ("one-left-in-scope", 1, 2, 20, 16, 20, None, 4, 6, 9),  # the scope holds 10 entries, 9 of them volatile
    ("rows", 5, 2, 36, 64, 20, [3, 0, 4], 2, 5, 3),
    ("tile-2048", 1, 2, 1200, 16, 1100, None, 4, 10, 110),
    # n = 2**k + 1 with a recent window of one place: the tile holds the 64 entries before the newest,
    # which is updated apart (as at bound 4,096: 4,097 entries, a 4,096-lane tile)
    ("newest-past-the-tile", 1, 2, 80, 16, 65, None, 2, 1, 7),
]
if DEVICE == "cuda":
    SHAPES += [("llama3-8b", 1, 8, 6144, 128, 4097, None, 4, 10, 410),
               ("llama3-8b-rows", 9, 8, 6144, 128, 4097, [0, 3, 5, 8], 4, 10, 410)]
IDS = [s[0] for s in SHAPES]


def inputs(shape, renumber: bool, ties: bool, seed: int):
    """Buffers as replacement leaves them (each head's places shuffled, sinks first, newest last) and
    statistics: with `ties`, drawn from a few (sum, squares, count) triples and a few observed values, so
    many entries share their std and their mean exactly; else continuous."""
    _, slots, kv, capacity, d, n, rows, sinks, recent, volatile = shape
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(slots, kv, capacity, d, generator=g)
    values = torch.randn(slots, kv, capacity, d, generator=g)
    order = torch.stack([torch.cat([torch.arange(sinks), sinks + torch.randperm(n - sinks - 1, generator=g),
                                    torch.tensor([n - 1])]) for _ in range(slots * kv)]).view(slots, kv, n)
    positions = torch.randint(0, 10**6, (slots, kv, capacity), generator=g)
    positions[..., :n] = 500 + order * 3 // 2  # increasing with stream order, with gaps
    rope_positions = torch.randint(0, 10**6, (slots, kv, capacity), generator=g)
    rope_positions[..., :n] = order if renumber else positions[..., :n]
    batch = slots if rows is None else len(rows)
    if ties:
        triples = torch.tensor([[0.5, 0.25, 2.0], [0.5, 0.5, 2.0], [1.0, 0.75, 3.0], [0.0, 0.0, 1.0], [0.25, 0.125, 1.0]])
        stats = triples[torch.randint(0, len(triples), (slots, kv, capacity), generator=g)].permute(3, 0, 1, 2)
        observation = torch.tensor([0.0, 0.25, 0.5])[torch.randint(0, 3, (batch, kv, capacity + 3), generator=g)]
    else:
        count = torch.randint(1, 20, (slots, kv, capacity), generator=g).float()
        sums = torch.rand(slots, kv, capacity, generator=g) * count
        squares = sums.square() / count + torch.rand(slots, kv, capacity, generator=g) / 10
        stats = torch.stack([sums, squares, count])
        observation = torch.rand(batch, kv, capacity + 3, generator=g)
    stats = stats.clone()
    stats[..., n - 1] = 0.0  # the newest entry, appended with no statistics yet
    to = lambda t: t.to(DEVICE)  # noqa: E731
    rows_t = None if rows is None else torch.tensor(rows, dtype=torch.long, device=DEVICE)
    buffers = [to(t) for t in (keys, values, positions, rope_positions)] + [to(t.contiguous()) for t in stats]
    return buffers, to(observation), rows_t


@pytest.mark.parametrize("ties", [True, False], ids=["ties", "continuous"])
@pytest.mark.parametrize("renumber", [True, False], ids=["rank", "absolute"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_kernel_steps_as_pytorch(shape, renumber, ties):
    from kvpot.kernels.roco import roco_step

    n, sinks, recent, volatile = shape[5], shape[7], shape[8], shape[9]
    for seed in range(3):
        buffers, observation, rows_t = inputs(shape, renumber, ties, seed)
        expected = [b.clone() for b in buffers]
        want = steady_reference(*expected[:4], expected[4:], observation, n, rows_t, sinks, recent, volatile, renumber)
        got = roco_step(*buffers, observation, n, rows_t, sinks, recent, volatile, renumber)
        assert torch.equal(got, want), (seed, got.flatten().tolist(), want.flatten().tolist())
        for name, a, b in zip(("keys", "values", "positions", "rope", "sums", "squares", "counts"), buffers, expected):
            assert torch.equal(a, b), (name, seed)


def test_ties_decide_the_drop():
    """The tie cases are not vacuous: the dropped entry's mean is shared by other entries of its scope."""
    shape = SHAPES[0]
    n, sinks, recent, volatile = shape[5], shape[7], shape[8], shape[9]
    buffers, observation, _ = inputs(shape, True, True, 0)
    drop = steady_reference(*buffers[:4], buffers[4:], observation, n, None, sinks, recent, volatile, True)
    sums, counts = buffers[4][0, 0, : n - 1], buffers[6][0, 0, : n - 1]  # after the step: the drop holds the newest
    assert drop[0, 0, 0] >= sinks
    assert len(set((sums / counts).tolist())) < n // 3  # few distinct means among many entries


def test_kth_largest_over_the_whole_int32_range():
    """The search behind the scope (`_kth_largest`), against a sort: values up to 2**31 - 1 (every bit
    pair), many ties, k from 1 to past the chosen count (then 0)."""
    from kvpot.kernels.roco import kth_largest

    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        high = [2**31 - 1, 2**31 - 1, 5, 2**20][trial % 4]
        values = torch.randint(0, high, (64,), generator=g, dtype=torch.int32)
        values[:4] = high - 1  # the top bits set
        chosen = (torch.rand(64, generator=g) < 0.7).to(torch.int32)
        ranked = values[chosen.bool()].sort(descending=True).values
        for k in (1, 2, len(ranked) // 2, len(ranked), len(ranked) + 3):
            out = kth_largest(values.to(DEVICE), chosen.to(DEVICE), torch.tensor([k], dtype=torch.int32, device=DEVICE))
            want = int(ranked[k - 1]) if k <= len(ranked) else 0
            assert int(out.item()) == want, (trial, k)


# (name, values, chosen, ks): the k-th largest search on its own, against a sort. Each case also takes k = 1,
# k = the number chosen and one past it.
def _kth_cases():
    g = torch.Generator().manual_seed(1)
    top = 2**31 - 1

    def rand(n, low, high):
        return torch.randint(low, high, (n,), generator=g, dtype=torch.int64).to(torch.int32)

    every = torch.ones(64, dtype=torch.int32)
    some = (torch.rand(64, generator=g) < 0.6).to(torch.int32)
    ties = torch.tensor([0, 1, 2**20, 2**30 + 5, top], dtype=torch.int32)
    edges = torch.tensor([(i << 27) + e for i in range(16) for e in (-1, 0, 1, 2)], dtype=torch.int64)
    return [
        ("distinct", rand(64, 0, top), some, [7, 20]),
        ("all-equal", torch.full((64,), 12345, dtype=torch.int32), every, [32]),
        ("top-bit-30", torch.cat([rand(48, 2**30, top), torch.tensor([top, 2**30] * 2, dtype=torch.int32),
                                  rand(12, 0, 2**30)]), every, [3, 48, 52, 53]),
        ("all-max", torch.full((64,), top, dtype=torch.int32), some, [5]),
        ("zeros", torch.zeros(64, dtype=torch.int32), every, [17]),
        ("zeros-and-ones", torch.arange(64, dtype=torch.int32) % 2, every, [32, 33]),
        ("many-ties", ties[torch.randint(0, 5, (64,), generator=g)], some, [2, 10, 25]),
        ("bin-edges", edges.clamp(0, top).to(torch.int32), every, [5, 6, 7, 8, 33]),  # one below, at and above each bin
        ("sparse-mask", rand(64, 0, top), (torch.arange(64) % 29 == 3).to(torch.int32), [2]),
        ("empty-mask", rand(64, 0, top), torch.zeros(64, dtype=torch.int32), [2]),
        ("unchosen-larger", torch.cat([rand(32, 0, 1000), rand(32, 2**30, top)]),
         (torch.arange(64) < 32).to(torch.int32), [10]),
        ("k-below-one", rand(64, 0, top), some, [0, -3]),  # every t qualifies: the largest int32
        ("full-tile", rand(16384, 0, top), torch.ones(16384, dtype=torch.int32), [8192]),  # counts at 2**14
        ("full-tile-equal", torch.full((16384,), 7, dtype=torch.int32), torch.ones(16384, dtype=torch.int32), [16383]),
    ]


KTH_CASES = _kth_cases()


def kth_reference(values: torch.Tensor, chosen: torch.Tensor, k: int) -> int:
    ranked = values[chosen.bool()].sort(descending=True).values
    if k < 1:
        return 2**31 - 1
    return int(ranked[k - 1]) if k <= len(ranked) else 0


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("case", KTH_CASES, ids=[c[0] for c in KTH_CASES])
def test_kth_largest_cases(case, bits):
    """The search (`_kth_largest`, 2, 3 or 4 bits a step) against a sort, over named edge cases: the largest
    t with at least k chosen values >= t, 0 where fewer than k are chosen; and the chosen values above and
    at t that `_kth_search` counts on the way (the kernel's tie-break reads them)."""
    from kvpot.kernels.roco import MAX_ENTRIES, SEARCH_BITS, kth_largest, kth_search

    _, values, chosen, ks = case
    many = int(chosen.sum())
    picked = values[chosen.bool()]
    for k in sorted(set(ks) | {1, many, many + 1}):
        args = values.to(DEVICE), chosen.to(DEVICE), torch.tensor([k], dtype=torch.int32, device=DEVICE), bits
        want = kth_reference(values, chosen, k)
        if 1 <= k <= MAX_ENTRIES:  # the search itself, and the counts it brings: above t, at t
            counts = [want, int((picked > want).sum()), int((picked == want).sum())]
            assert kth_search(*args).tolist() == counts, k
        if bits == SEARCH_BITS or not 1 <= k <= MAX_ENTRIES:  # the wrapper for any k (interpreted: slow)
            assert int(kth_largest(*args).item()) == want, k


@pytest.mark.parametrize("bits", [2, 3])
def test_search_bits_do_not_change_the_step(bits):
    """Settling 2 or 3 bits a search step instead of 4 (tuning only): the same step, ties in std included."""
    from kvpot.kernels.roco import roco_step

    shape = SHAPES[0]
    n, sinks, recent, volatile = shape[5], shape[7], shape[8], shape[9]
    for ties in (True, False):
        buffers, observation, _ = inputs(shape, True, ties, 0)
        expected = [b.clone() for b in buffers]
        want = steady_reference(*expected[:4], expected[4:], observation, n, None, sinks, recent, volatile, True)
        got = roco_step(*buffers, observation, n, None, sinks, recent, volatile, True, bits=bits)
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(buffers, expected))


def test_search_bits_are_checked():
    from kvpot.kernels.roco import roco_step

    buffers, observation, _ = inputs(SHAPES[0], True, False, 0)
    with pytest.raises(ValueError, match="2, 3 or 4 bits"):
        roco_step(*buffers, observation, SHAPES[0][5], bits=5)


def append_newest(buffers, n: int, renumber: bool) -> None:
    """A decoding step's append at place n - 1 (after a step left n - 1 live entries): the next stream
    position, no statistics yet."""
    positions, rope_positions = buffers[2], buffers[3]
    newest = positions[..., : n - 1].amax(dim=-1)
    positions[..., n - 1] = newest + 1
    rope_positions[..., n - 1] = n - 1 if renumber else newest + 1
    for stat in buffers[4:]:
        stat[..., n - 1] = 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES[-2:], ids=IDS[-2:])
def test_captured_steps_replay_as_pytorch(shape):
    """The step captured once in a CUDA graph (it never waits for the host) and replayed step after step,
    each after a new entry was appended: the reference's buffers at every step."""
    from kvpot.kernels.roco import roco_step

    n, sinks, recent, volatile = shape[5], shape[7], shape[8], shape[9]
    buffers, observation, rows = inputs(shape, True, False, 0)
    expected = [b.clone() for b in buffers]
    args = (n, rows, sinks, recent, volatile, True)
    warm = [b.clone() for b in buffers]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        roco_step(*warm, observation, *args)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        drop = roco_step(*buffers, observation, *args)
    for step in range(4):
        if step:
            append_newest(buffers, n, True)
            append_newest(expected, n, True)
        observation.uniform_()
        graph.replay()
        want = steady_reference(*expected[:4], expected[4:], observation, *args)
        assert torch.equal(drop, want), step
        for a, b in zip(buffers, expected):
            assert torch.equal(a, b), step
