"""InfiniteHiP's decoding step in fixed shapes: the step a CUDA graph captures and replays.

The eager step (`reference.sparse_attention` with a `MaskCache`) sizes its work from host counts that
grow with the context: the stage-1 candidate list (one chunk of `chunks[0]` keys from the sinks to the
window) and the window's width. A fixed-shape step (`kvpot.engine.decoding`, plan "append") reads the
layer's whole buffers, reserved for the whole decode, with the query's position on the device
(`layer.slot`: nothing is evicted, so an entry's index is its position). Here:

- stage 1 scans a candidate list sized for the last position of the decode (the buffers' capacity);
  chunks past the window's start are empty ranges, which score -inf. Stages keep their best chunks by
  a stable order (`reference.run_stage`), so every stage keeps the ranges the eager step keeps, in the
  same places of its list, followed by empty padding: chunk-indexed positions (Sec. 4, "Dynamic
  RoPE") and the streaming positions of the final attention are the eager step's;
- each stage's output lives in a buffer per layer (`FixedMasks`), written in place when the stage is
  due and read as it is otherwise (Sec. 4 "Sparse Attention Mask Caching", Algorithm 4);
- which stages a step recomputes follows from the step counter (`refresh_due`), which the host knows
  before the step: the due pattern is part of the step's graph key, so one graph per pattern serves
  the decode (the release's refresh (32, 16, 8) gives four: all, stages 2-3, stage 3, none);
- the window starts where it started when stage 1 last ran (as in the eager step), so it is at most
  `window` plus the steps since then wide (`width_bound`): the attention reads that many window lanes
  and masks the ones after the query.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpot.methods.infinitehip.reference import (
    LayerPlan,
    Rotate,
    Selection,
    _final_attention,
    _split,
    make_scorer,
    refresh_due,
    run_stage,
)


def width_bound(window: int, refresh: tuple[int, ...]) -> int:
    """The widest window a decoding step attends: `window` plus the most steps between the stage-1
    run whose window start the final attention uses and the step (the last stage keeps the window
    start of the stage-1 output it was computed from). The schedule repeats every lcm(refresh) steps
    from step 0, where every stage runs, so one period shows every age."""
    period = math.lcm(*refresh)
    if period > 1 << 16:  # an odd schedule: the bound that holds for any (a stage-1 run at most
        return window + refresh[0] + refresh[-1]  # refresh[0] - 1 steps old when the last stage ran)
    first = last = 0  # the latest stage-1 run; the stage-1 run the last stage's selection used
    oldest = 0
    for step in range(period):
        due = refresh_due(step, refresh)
        if due[0]:
            first = step
        if due[-1]:
            last = first
        oldest = max(oldest, step - last)
    return window + oldest


def stage_sizes(plan: LayerPlan, last_keep: int, capacity: int) -> tuple[int, list[int]]:
    """Stage 1's candidate ranges and the ranges each stage keeps, in a fixed-shape step over buffers
    of `capacity` entries: the candidates reach the latest window start of the decode, capacity - window."""
    first = plan.stages[0].chunk
    latest = max(plan.sink, capacity - plan.window)
    candidates = count = max(1, math.ceil((latest - plan.sink) / first))
    sizes, parent = [], first
    for i, stage in enumerate(plan.stages):
        if i:
            count *= parent // stage.chunk
        keep = last_keep if i == len(plan.stages) - 1 else stage.keep
        count = min(count, max(1, keep // stage.chunk))
        sizes.append(count)
        parent = stage.chunk
    return candidates, sizes


@dataclass
class FixedMasks:
    """One layer's stage outputs in fixed buffers (starts/ends [s, 1, C_i] long, empty ranges as
    padding), the window starts, and the streaming offsets of the last selection (for the kernel)."""

    candidates: int  # stage 1's candidate ranges
    starts: list[torch.Tensor]
    ends: list[torch.Tensor]
    window_start: torch.Tensor  # [1] long: stage 1's window start, the one pruning uses
    final_start: torch.Tensor  # [1] long: the window start the last stage's selection was made with
    memo: dict  # nsink [1], selbase [s, 1, C], base [s, 1]: what `kvpot.kernels.hip.sparse_attention` reuses

    @classmethod
    def allocate(cls, plan: LayerPlan, last_keep: int, capacity: int, kv_heads: int,
                 device: torch.device) -> FixedMasks:
        s = 1 if plan.shared else kv_heads
        candidates, sizes = stage_sizes(plan, last_keep, capacity)

        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.long, device=device)

        memo = {"nsink": zeros(1), "selbase": zeros(s, 1, sizes[-1]), "base": zeros(s, 1)}
        return cls(candidates, [zeros(s, 1, c) for c in sizes], [zeros(s, 1, c) for c in sizes], zeros(1), zeros(1), memo)

    def clone(self) -> FixedMasks:
        return FixedMasks(self.candidates, [t.clone() for t in self.starts], [t.clone() for t in self.ends],
                          self.window_start.clone(), self.final_start.clone(),
                          {k: v.clone() for k, v in self.memo.items()})


def fixed_step(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, t: torch.Tensor,
               plan: LayerPlan, last_keep: int, due: tuple[bool, ...], masks: FixedMasks, width: int,
               rotate: Rotate, table: tuple[torch.Tensor, torch.Tensor] | None, gpu_cache=None) -> torch.Tensor:
    """One decoding query [h, 1, d] (un-rotated) at position `t` ([1] long on the device) over a layer's
    whole buffers keys/values [kv, capacity, d]: the stages that are `due` rerun into `masks`, then
    sinks + selection + window are attended (Triton with a RoPE `table`, else the PyTorch reference).
    Offloaded (`gpu_cache`, a `kvpot.methods.infinitehip.offload.GpuKvCache`; keys/values in pinned host
    memory), the attention reads through the GPU cache, which then takes the keys it read: the whole
    read set after a new selection, else only the newest key (as the eager step). No host value
    depends on `t`. Returns [h, 1, d]."""
    h, _, d = query.shape
    kv = keys.shape[0]
    if any(due):
        _prune(query.view(kv, h // kv, 1, 1, d), keys, t, plan, last_keep, due, masks, rotate, table)
    chunk = plan.stages[-1].chunk
    if table is not None:
        from kvpot.kernels import hip

        out = hip.sparse_attention(query, keys, values, scaling, masks.starts[-1], masks.ends[-1], chunk,
                                   masks.final_start, width, plan.sink, 1, plan.final_rope == "streaming", *table,
                                   memo=masks.memo, position=t, gpu_cache=gpu_cache)
        if gpu_cache is not None:
            _touch(gpu_cache, keys, values, t, plan, due, masks, width)
        return out
    selection = Selection(masks.starts[-1], masks.ends[-1], masks.final_start)
    rows_valid = torch.ones(1, 1, dtype=torch.bool, device=keys.device)
    out = _final_attention(query.view(1, h, 1, d), keys, values, scaling, selection, chunk, plan, t.view(1, 1),
                           rows_valid, rotate, width)  # [1, h, 1, d]
    return out[0]


def _touch(gpu_cache, keys: torch.Tensor, values: torch.Tensor, t: torch.Tensor, plan: LayerPlan,
           due: tuple[bool, ...], masks: FixedMasks, width: int) -> None:
    """The GPU cache takes what this step read: a new selection's whole read set, else the newest key."""
    if not any(due):
        gpu_cache.touch_newest(t, keys, values)
        return
    tokens, valid = fixed_used_tokens(plan.sink, masks.memo["nsink"], masks.starts[-1].flatten(),
                                      masks.ends[-1].flatten(), plan.stages[-1].chunk, masks.final_start, width, t)
    gpu_cache.touch(tokens, valid, keys, values)


def _prune(grouped: torch.Tensor, keys: torch.Tensor, t: torch.Tensor, plan: LayerPlan, last_keep: int,
           due: tuple[bool, ...], masks: FixedMasks, rotate: Rotate, table) -> None:
    """The due stages of `reference.prune` for one query (grouped [kv, g, 1, 1, d]), in place in `masks`."""
    if due[0]:
        masks.window_start.copy_((t + 1 - plan.window).clamp(min=plan.sink))
    rows_valid = torch.ones(1, 1, dtype=torch.bool, device=t.device)
    args = (grouped, rows_valid, keys, plan, t.view(1, 1), rotate)
    scorer = make_scorer(args, plan, table, one_block=True, live=t + 1)  # keys: the whole buffer, t + 1 live
    s = masks.starts[0].shape[0]
    first = plan.stages[0].chunk
    starts = plan.sink + torch.arange(masks.candidates, device=t.device) * first
    starts = starts.view(1, 1, -1).expand(s, 1, -1)
    ends = torch.minimum(starts + first, masks.window_start.view(1, 1, 1))
    parent = first
    for i, stage in enumerate(plan.stages):
        if due[i]:
            if i > 0:
                starts, ends = _split(starts, ends, parent, stage.chunk)
            keep = last_keep if i == len(plan.stages) - 1 else stage.keep
            starts, ends = run_stage(scorer, starts, ends, stage, keep)
            masks.starts[i].copy_(starts)
            masks.ends[i].copy_(ends)
        starts, ends = masks.starts[i], masks.ends[i]
        parent = stage.chunk
    if due[-1]:  # a new selection: its window start and streaming offsets (as the kernel computes them)
        masks.final_start.copy_(masks.window_start)
        lengths = (ends - starts).clamp(min=0)
        nsink = masks.final_start.clamp(max=plan.sink)
        masks.memo["nsink"].copy_(nsink)
        masks.memo["selbase"].copy_(nsink.view(1, -1, 1) + lengths.cumsum(-1) - lengths)
        masks.memo["base"].copy_(nsink.view(1, -1) + lengths.sum(-1))


def fixed_used_tokens(sink: int, nsink: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, chunk: int,
                      window_start: torch.Tensor, width: int, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`offload.used_tokens` in fixed shapes, for a captured step: sinks [0, sink) valid below `nsink`
    ([1] long), the selected ranges starts/ends [C] (at most `chunk` keys each), and `width` window
    lanes from `window_start` ([1] long) valid up to the query's `position` ([1] long). The same valid
    tokens as the eager step's list. Returns tokens [L] and their validity [L]."""
    device = starts.device
    sinks = torch.arange(sink, device=device)
    offsets = torch.arange(chunk, device=device)
    selected = (starts.unsqueeze(-1) + offsets).flatten()
    selected_valid = selected < ends.unsqueeze(-1).expand(-1, chunk).flatten()
    window = window_start + torch.arange(width, device=device)
    tokens = torch.cat([sinks, selected, window])
    valid = torch.cat([sinks < nsink, selected_valid, window <= position])
    return tokens, valid
