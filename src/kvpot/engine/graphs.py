"""The one manager of captured decoding steps: CUDA graphs of a fixed-shape step, keyed by its form.

Both decode runners hand it their step's body: the one-sequence `Decoder` (`kvpot.engine.decoding`: its
plan, its counts when a steady step evicts, InfiniteHiP's refresh form) and the batched `BatchDecoder`
(`kvpot.engine.batch`: the bucket, whether the step observes, whether a row samples). The body reads
and writes only static buffers and device-side counts, so one capture serves every later step of its
key (docs/design.md, *Fast decoding*).

A key's first step runs uncaptured on a side stream (Triton compiles, cuBLAS makes its handles: capture
requires both done), its second is captured and replayed, later ones replay. Capture records the step
without running it; what the body changed on the host while it was recorded is the runner's to put back
(`around`), and what a replay changes on the host is the runner's to mirror.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

WARMED = "warmed"  # the step ran uncaptured (its host-side effects happened)
REPLAYED = "replayed"  # the step's graph replayed (its host-side effects are the runner's to mirror)


class StepGraphs:
    """CUDA graphs of a runner's steps, in one private memory pool.

    `follow(identity)` drops every graph when what they were captured against changed: the buffers they
    read moved (a grown cache, a larger RoPE table; a graph replays the addresses it was captured with), or
    a buffer they should write appeared (a method's score array). Sampling needs no generator state here:
    its draws hash each row's seed and counter (`kvpot.engine.sampling.pick_rows`), buffers a replay reads.
    """

    def __init__(self):
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.warm: set[tuple] = set()
        self.pool = None
        self.identity: tuple = ()
        self.captures = self.replays = self.warmups = 0

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def clear(self) -> None:
        # the private memory pool goes with its last graph: later captures take a new one
        self.graphs.clear()
        self.warm.clear()
        self.pool = None

    def follow(self, identity: tuple) -> None:
        """Drop the graphs if `identity` (buffer addresses, array counts: what they were captured against)
        changed since the last call."""
        if identity != self.identity:
            self.clear()
            self.identity = identity

    def run(self, key: tuple, body: Callable[[], None],
            around: Callable[[Callable[[], None]], Any] | None = None) -> tuple[str, Any]:
        """Step `key`: warmed (`body` ran), or replayed. `around(capture)` wraps the capture, the first
        time, and what it returns is kept with the graph and returned with every replay (the one-sequence
        steady step's counts); without it, None. Returns (WARMED or REPLAYED, that note)."""
        if key not in self.warm:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                body()
            torch.cuda.current_stream().wait_stream(stream)
            self.warm.add(key)
            self.warmups += 1
            return WARMED, None
        if key not in self.graphs:
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()

            def capture() -> None:
                with torch.cuda.graph(graph, pool=self.pool):
                    body()

            note = around(capture) if around is not None else capture()
            self.graphs[key] = (graph, note)
            self.captures += 1
        graph, note = self.graphs[key]
        graph.replay()
        self.replays += 1
        return REPLAYED, note
