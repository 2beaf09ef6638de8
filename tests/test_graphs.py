"""`StepGraphs`, the one manager of captured decoding steps (both decode runners use it): a key's first step
runs for real, the second is captured and replayed, later ones replay; moved buffers drop the graphs."""

import pytest
import torch

from kvpot.engine.graphs import REPLAYED, WARMED, StepGraphs


class Body:
    """A step that adds one to a device counter, and counts on the host how often Python ran it."""

    def __init__(self):
        self.value = torch.zeros(1, device="cuda")
        self.calls = 0

    def __call__(self):
        self.calls += 1
        self.value.add_(1)


@pytest.mark.gpu
def test_a_key_warms_then_captures_then_replays_on_cuda():
    graphs, body = StepGraphs(), Body()
    assert graphs.run(("a",), body) == (WARMED, None)
    assert (body.calls, body.value.item()) == (1, 1)  # ran for real
    assert graphs.run(("a",), body) == (REPLAYED, None)
    assert ("a",) in graphs and graphs.captures == 1
    assert (body.calls, body.value.item()) == (2, 2)  # captured (Python ran once more, recording), then replayed
    for _ in range(3):
        graphs.run(("a",), body)
    assert (body.calls, body.value.item(), graphs.replays) == (2, 5, 4)  # replays run no Python
    graphs.run(("b",), body)  # another key warms on its own
    assert (body.calls, body.value.item(), graphs.warmups) == (3, 6, 2)


@pytest.mark.gpu
def test_the_note_taken_around_the_capture_comes_back_with_every_replay_on_cuda():
    graphs, body = StepGraphs(), Body()
    host = {"n": 0}

    def step():
        host["n"] += 1  # a host-side count the step changes (as a steady step's eviction)
        body()

    def around(capture):
        before = host["n"]
        capture()
        after, host["n"] = host["n"], before  # capture only recorded the step: the count goes back
        return after

    graphs.run(("s",), step, around)
    assert host["n"] == 1
    assert graphs.run(("s",), step, around) == (REPLAYED, 2)
    assert host["n"] == 1  # put back by `around`; mirroring the replay is the runner's
    assert graphs.run(("s",), step, around) == (REPLAYED, 2) and body.value.item() == 3


@pytest.mark.gpu
def test_moved_buffers_drop_every_graph_on_cuda():
    graphs, body = StepGraphs(), Body()
    graphs.follow((1,))
    graphs.run(("a",), body)
    graphs.run(("a",), body)
    pool = graphs.pool
    graphs.follow((1,))  # the same addresses: kept
    assert ("a",) in graphs and graphs.pool is pool
    graphs.follow((2,))  # moved: dropped, and the next step of that key warms again
    assert ("a",) not in graphs and graphs.pool is None
    assert graphs.run(("a",), body)[0] == WARMED


@pytest.mark.gpu
def test_a_captured_sampling_step_draws_fresh_numbers_at_each_replay_on_cuda():
    """Sampling needs no generator state in a graph: the one-sequence sampler's seed and draw count are device
    buffers, so each replay draws with the next count, as an uncaptured run of the same steps does."""
    from kvpot.engine.decoding import OneRowSampler

    logits = torch.zeros(1000, device="cuda")  # uniform: every draw is the noise's
    graphs, out = StepGraphs(), torch.zeros(1, dtype=torch.long, device="cuda")
    sampler = OneRowSampler(torch.device("cuda"), 1.0, 1.0, seed=3)

    def draw():
        out.copy_(sampler.pick(logits))

    seen = []
    for _ in range(5):  # warmed, captured, replayed x3
        graphs.run(("r",), draw)
        seen.append(int(out))
    alone = OneRowSampler(torch.device("cuda"), 1.0, 1.0, seed=3)
    # a capture records without running and is replayed at once: counts 0, 1, 2, ... as uncaptured
    assert seen == [int(alone.pick(logits)) for _ in range(5)]
    assert len(set(seen)) > 1
