"""InfiniteHiP's decoding step when no stage is due: one attention launch over the cached selection."""

from __future__ import annotations

import torch


def all_cached(masks, due: list[bool] | None) -> bool:
    """Whether a decoding step with these `due` stages reuses every stage of `masks` (a `reference.MaskCache`)."""
    return bool(masks is not None and masks.stages and due is not None and not any(due)
                and all(stage is not None for stage in masks.stages))


def cached_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, plan,
                   masks, table: tuple[torch.Tensor, torch.Tensor], gpu_cache=None) -> torch.Tensor:
    """A decoding step that recomputes no stage, on the kernels: one attention launch (and its
    merge) over the cached selection, with no index arithmetic on the device (the general path
    spends ~12 small launches there)."""
    from kvpot.kernels import hip

    selection = masks.stages[-1]
    masks.recomputed.append([])
    n = keys.shape[1]
    width = n - selection.window_starts[0]  # the window runs from where it started to the query (n - 1)
    return hip.sparse_attention(query, keys, values, scaling, selection.starts, selection.ends, plan.stages[-1].chunk,
                                selection.window_start, width, plan.sink, 1, plan.final_rope == "streaming", *table,
                                memo=selection.memo, gpu_cache=gpu_cache)
