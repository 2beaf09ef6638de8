"""One entry out, one in: the eviction of a steady decoding step without compaction (issue 30).

A method at its budget appends one entry per generated token and evicts one. Selecting the kept
entries with a top-k and gathering keys, values, positions and scores into place moves the whole
cache, twice, in ~15 small kernels per layer. Here instead the entry that leaves is found (one
arg-min) and the new entry, appended last, is written into its slot; under rank positions
(`shift`/`reset`) the entries ranked after it move down by one. StreamingLLM's oldest non-sink
entry is the arg-min of the stream positions: its slot is the next write, a ring.

The kept set is `top_indices`' own: entries are ranked by the same values and, among equal values,
the older goes first, as the arg-min over entries kept in stream order picks the first. Nothing may
read the order from the places afterwards: every rule that does (protected sinks and recent
entries, rank positions, recency) is computed here from stored positions:

- the first `sinks` entries never leave, so they keep their places (indices below `sinks`);
- the last `recent` entries are those whose stream position is above the newest one's less
  `recent`: a method that protects its `recent` newest entries at every eviction never drops one of
  the last `recent` tokens read (each was protected from its arrival until `recent` newer came),
  and the stream positions of a run are consecutive;
- rank positions are stored per entry and renumbered in place.

A cache whose entries left stream order is marked (`PotCache.unordered`); `restore_order` sorts it
back (one gather) before anything that reads the order from the places runs on it (an eager
eviction), and when decoding ends. Attention is the same over any order of its entries, up to the
order of floating-point sums.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

LAST = torch.iinfo(torch.long).max  # a position no entry has: loses every tie
enabled = True  # False: every eviction takes the top-k and gather path (tests compare the two)
# CUDA side streams a steady step's per-layer replacements take turns on (`spread`); 1: one after another
streams = 4
_side_streams: dict[torch.device, list] = {}


def spread(layers: list) -> Iterator[tuple[int, object]]:
    """`enumerate(layers)`, with each layer's loop body on the next of `streams` CUDA side streams, which
    wait for the current stream first and which it waits for after the last layer (also inside a graph's
    capture: the graph's branches). A steady step replaces one entry in every layer, each a launch of one
    program per KV head, a fraction of the GPU for tens of microseconds (D2O's step 30 us, RoCo's 15 on an
    H100); the layers' buffers are their own, so their launches can run side by side instead of 32 in a
    row. Plain `enumerate` off CUDA, across devices, or with `streams` 1."""
    device = layers[0].device if layers else None
    if streams <= 1 or device is None or device.type != "cuda" or any(layer.device != device for layer in layers):
        yield from enumerate(layers)
        return
    if device not in _side_streams:  # made at a first (uncaptured) step: a capture cannot create streams
        _side_streams[device] = [torch.cuda.Stream(device) for _ in range(streams)]
    side, main = _side_streams[device][:streams], torch.cuda.current_stream(device)
    for stream in side:
        stream.wait_stream(main)
    try:
        for index, layer in enumerate(layers):
            with torch.cuda.stream(side[index % len(side)]):
                yield index, layer
    finally:
        for stream in side:
            main.wait_stream(stream)


def drop_index(scores: torch.Tensor | None, positions: torch.Tensor, sinks: int = 0, recent: int = 0) -> torch.Tensor:
    """The entry a one-entry eviction drops: [b, h, 1] indices into the `n` live entries.

    scores [b, h, n] float (h = kv_heads, or 1 for a selection shared by the heads; None: all alike,
    so the oldest goes); positions [b, kv_heads, n] the entries' stream positions, the newest entry last.
    The lowest score goes, the oldest among equal ones; the first `sinks` entries and the `recent` newest
    by stream position never go.
    """
    heads = 1 if scores is None else scores.shape[1]
    positions = positions[:, :heads]  # a shared selection: every head holds the same entries
    newest = positions[..., -1:]
    rest = positions[..., sinks:]
    if scores is None:
        key = rest if not recent else rest.masked_fill(rest > newest - recent, LAST)
        return key.argmin(dim=-1, keepdim=True) + sinks
    rest_scores = scores[..., sinks:]
    if recent:
        rest_scores = rest_scores.masked_fill(rest > newest - recent, float("inf"))
    low = rest_scores.amin(dim=-1, keepdim=True)
    oldest = torch.where(rest_scores == low, rest, LAST)
    return oldest.argmin(dim=-1, keepdim=True) + sinks


def renumber(rope_positions: torch.Tensor, drop: torch.Tensor) -> None:
    """Rank positions [b, kv, n] (in place) after entry `drop` [b, kv, 1] leaves: those ranked after it
    move down by one, so the kept entries are numbered 0..n-2 in stream order again."""
    rank = rope_positions.gather(2, drop)
    rope_positions.sub_(rope_positions.gt(rank).to(rope_positions.dtype))


def move(buffers, drop: torch.Tensor, source: int, rows: torch.Tensor | None = None) -> None:
    """Entry `source` of every buffer ([slots, kv, capacity, ...]) written over entry `drop` [B, kv, 1]
    of each row (`rows` [B] their slots; None: the buffers' own first B)."""
    b, kv = drop.shape[:2]
    device = drop.device
    rows = torch.arange(b, device=device) if rows is None else rows
    at = (rows.view(-1, 1), torch.arange(kv, device=device).view(1, -1), drop[..., 0])
    for buf in buffers:
        buf[at] = buf[at[0], at[1], source]


def replace_newest(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, rope_positions: torch.Tensor,
                   stored: list[torch.Tensor], n: int, scores: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   sinks: int = 0, recent: int = 0, renumbers: bool = False, drop: torch.Tensor | None = None,
                   find: bool = True, write: bool = True) -> torch.Tensor:
    """Each row drops one of its `n` live entries (`drop_index`'s rule, or `drop` [B, kv, 1] given with
    `find=False`) and its newest entry (`n - 1`) takes the slot (`write`): keys/values [S, kv, C, d],
    positions/rope_positions and the `stored` score arrays [S, kv, C], rows [B] the slots (None: all S);
    scores [B, kv | 1, n] (None: by age). Returns the dropped entries [B, kv, 1]. One Triton launch
    where the kernels run (`kvpot.kernels.replace`), else a handful of PyTorch operations."""
    from kvpot import kernels

    if kernels.available(keys.device):
        from kvpot.kernels.replace import replace_newest as kernel

        drop = kernel(keys, values, positions, rope_positions, n, scores, stored[0] if stored else None, rows,
                      sinks, recent, renumbers, drop, find, write)
        if write and len(stored) > 1:
            move(stored[1:], drop.expand(-1, keys.shape[1], 1), n - 1, rows)
        return drop
    return replace_reference(keys, values, positions, rope_positions, stored, n, scores, rows, sinks, recent,
                             renumbers, drop, find, write)


def replace_reference(keys, values, positions, rope_positions, stored, n, scores=None, rows=None, sinks=0, recent=0,
                      renumbers=False, drop=None, find=True, write=True) -> torch.Tensor:
    """`replace_newest` in PyTorch (the CPU path, and the kernel's reference)."""
    kv = keys.shape[1]
    at = slice(None) if rows is None else rows
    if find:
        drop = drop_index(scores, positions[at, :, :n], sinks, recent)
    drop = drop.expand(drop.shape[0], kv, 1)
    if not write:
        return drop
    if renumbers:
        ranks = rope_positions[at, :, :n]  # a view without rows, else a copy written back
        renumber(ranks, drop)
        if rows is not None:
            rope_positions[rows, :, :n] = ranks
    move((keys, values, positions, rope_positions, *stored), drop, n - 1, rows)
    return drop


def fold_replace(layer, step, storage, rows: torch.Tensor | None, renumbers: bool, fold: str, score: str | None = None,
                 sinks: int = 0, recent: int = 0) -> bool:
    """A steady step's `update_scores`, `ranking` and replacement of `layer` in one launch, ranked by the step's
    observation folded in (`kvpot.kernels.replace.replace_newest`'s `fold`): "add" into stored score `score`
    (H2O's accumulated attention), or "heads" (its sum over the KV heads: TOVA's). `storage` holds the buffers
    (the layer, or the pool's layer with `rows` its slots; `EvictionMethod.replace_fused`'s arguments). False
    where the kernels do not run or the layer stores other scores that would have to move: nothing done."""
    from kvpot import kernels

    observed = layer.observation
    if step.n_new != 1 or observed is None or observed.dtype != torch.float32 or not kernels.available(storage.keys.device):
        return False
    if list(storage.scores) != ([] if score is None else [score]):
        return False
    from kvpot.kernels.replace import replace_newest as kernel

    kernel(storage.keys, storage.values, storage.positions, storage.rope_positions, layer.n, None,
           None if score is None else storage.scores[score], rows, sinks, recent, renumbers, observation=observed,
           fold=fold)
    return True


def take_newest(layer, scores: torch.Tensor | None = None, sinks: int = 0, recent: int = 0,
                drop: torch.Tensor | None = None) -> torch.Tensor:
    """Layer `layer` (a `PotLayer`, `n` entries, the newest last) drops one entry (by `scores`, `sinks`,
    `recent` as `drop_index`; or `drop` [b, kv | 1, 1]) and the newest takes its slot: `n - 1` entries
    remain, every rule that reads them in stream order answering as before. Returns the dropped entries."""
    drop = replace_newest(layer.keys, layer.values, layer.positions, layer.rope_positions, list(layer.scores.values()),
                          layer.n, scores, None, sinks, recent, layer.cache.policy.renumbers, drop, find=drop is None)
    took_newest(layer)
    return drop


def took_newest(layer) -> None:
    """The host side of `take_newest` (a kernel that merged first moved the entries: D2O)."""
    layer.mirror_drop(layer.n - 1)
    layer.cache.unordered = True


def find_drop(layer, scores: torch.Tensor | None, sinks: int = 0, recent: int = 0) -> torch.Tensor:
    """The entry `take_newest` would drop [b, kv, 1], nothing moved (D2O merges it first)."""
    return replace_newest(layer.keys, layer.values, layer.positions, layer.rope_positions, [], layer.n, scores,
                          sinks=sinks, recent=recent, write=False)


def restore_order(cache) -> None:
    """Put a cache's entries back in stream order (after replacements), for what reads the order from
    the places; nothing to do for a cache in order."""
    if not getattr(cache, "unordered", False):
        return
    for layer in cache.layers:
        if layer.n:
            n_new = layer.n_new
            layer.select(layer.positions[:, :, : layer.n].argsort(dim=-1))
            layer.set_counts(layer.n, layer.max_rope, n_new)
    cache.unordered = False
