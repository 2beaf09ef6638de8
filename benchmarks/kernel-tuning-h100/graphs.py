"""Timing one kernel alone: a CUDA graph of launches replayed, microseconds per launch (the scripts here)."""

from __future__ import annotations

import torch


def time_graph(launches: list, repeats: int) -> float:
    """Microseconds per launch: `launches` (callables, each one kernel launch) captured in one CUDA graph after
    three of them ran uncaptured (compilation, handles), the median of `repeats` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches[:3]:
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(launches))
    times.sort()
    return times[len(times) // 2]
