"""Per-token eviction for many pool slots at once (the batched engine's "steady" rows).

A method at its budget (StreamingLLM, H2O, TOVA) appends each generated token and evicts back to the
same count. One slot at a time that is ~15 small kernels per layer and slot; here the slots at the
same counts go together: per layer, their scores are gathered into a `RowsView` that looks to the
method like one `PotLayer` with a batch of rows, and the method's own `update_scores`, `keep_count`
and `ranking` (or `scores`) run on it unchanged. A method that ranks (`EvictionMethod.ranking`) drops
each row's one entry by replacement (`kvpot.methods.replace`: one arg-min, the new entry written into
the dropped one's slot); otherwise one top-k selects for every row and the kept entries (keys, values,
positions, scores) are gathered back into the pool in place. A method whose `after_forward` is not
`EvictionMethod`'s (D2O's merges, CItruS) keeps the one-slot path.

Where every steady row drops one entry a layer by the method's ranking from the same counts (`steady_form`), the
eviction runs inside the batched step's own fixed-shape body instead (`evict_in_step`), so a GPU captures it with the
step: one graph replay, no launches of its own, nothing for the host to decide between steps.
"""

from __future__ import annotations

import torch

from kvpot.cache import PotCache
from kvpot.errors import KvpotError
from kvpot.methods import replace
from kvpot.methods.base import DECODE_STEP, EvictionMethod, replaces_by_ranking, top_indices


def batch_evictable(method) -> bool:
    """Whether the method's eviction after a decoding step is `EvictionMethod`'s, so it can run batched."""
    return isinstance(method, EvictionMethod) and type(method).after_forward is EvictionMethod.after_forward


class RowsView:
    """Layer `storage` of several slots (`rows`), all holding `n` entries, as one batched layer."""

    def __init__(self, storage, rows: torch.Tensor, n: int, observation: torch.Tensor | None):
        self.storage, self.rows, self.n = storage, rows, n
        self.batch, self.kv_heads, self.device = rows.numel(), storage.kv_heads, storage.device
        self.parallel = storage.parallel  # tensor parallelism: the rank's own KV heads (kvpot.models.parallel)
        self.observation = observation  # [B, kv_heads, n]: each row's step observation
        self.gathered: dict[str, torch.Tensor] = {}  # score name -> [B, kv_heads, n] (written back after)

    @property
    def positions(self) -> torch.Tensor:
        """[B, kv_heads, n] the rows' stream positions (a ranking that reads them: RoCo's scope)."""
        return self.storage.positions[self.rows, :, : self.n]

    def score(self, name: str) -> torch.Tensor:
        if name not in self.gathered:
            self.gathered[name] = self.storage.score(name)[self.rows, :, : self.n]
        return self.gathered[name]


def steady_form(method, runs: list, parallel) -> tuple[int, ...] | None:
    """The host counts (per layer, before the step's append) at which a batched step of steady rows `runs` evicts them
    inside its body (`evict_in_step`), or None: after it (`evict_steady`). Inside where the method drops one entry by
    its ranking and every row holds the same counts (a plan of "steady": each layer at its keep count); not under
    tensor parallelism (not run there)."""
    if not runs or parallel is not None or not (replace.enabled and replaces_by_ranking(method)):
        return None
    counts = {tuple(run.cache.lengths()) for run in runs}
    return counts.pop() if len(counts) == 1 else None


def steady_capture(method, pool, parallel) -> tuple | None:
    """(its observation, counts) of the step whose steady rows evict inside it, known before any request, so that
    `Scheduler.capture` captures it too: the counts a steady row holds (the method's keep count in each layer).
    None where `steady_form` never gives counts."""
    if parallel is not None or not (replace.enabled and replaces_by_ranking(method)):
        return None
    counts = tuple(method.keep_count(layer, DECODE_STEP) for layer in PotCache(pool.num_layers, pool.rope,
                                                                               pool.policy).layers)
    return (method.decode_request("steady"), counts) if max(counts) < pool.capacity else None


def evict_in_step(method, pool, rows: torch.Tensor, live: torch.Tensor, counts: tuple[int, ...]) -> None:
    """Inside a fixed-shape step (`BatchDecoder`), after its append: every row that does not only append (`live` 0:
    the steady rows, and padding rows) drops one entry a layer from `counts + 1`, as `evict_rows` would; the rows
    that only append evict the scratch slot instead, whose entries nothing reads (its count goes back to 0), so the
    step's shapes and launches are the same whichever rows are steady. Nothing is read back on the host. A pool
    without a scratch slot (a pool of one) runs this only where its row is steady (`BatchDecoder.step` checks)."""
    targets = rows if pool.scratch is None else rows.masked_fill(live > 0, pool.scratch)
    renumbers = pool.policy.renumbers
    for index, storage in enumerate(pool.layers):
        n = counts[index] + 1
        probs = storage.probs
        view = RowsView(storage, targets, n, None if probs is None else probs[: rows.numel(), :, :n])
        if not method.replace_fused(view, DECODE_STEP, storage, targets, renumbers):
            method.update_scores(view, DECODE_STEP)
            _replace_rows(method, storage, view, targets, n, renumbers)
        pool.lengths[index].index_fill_(0, targets, n - 1)
    if pool.scratch is not None:
        pool.lengths[:, pool.scratch] = 0


def evict_steady(method, pool, steady: list[tuple], fail, inside: bool = False) -> None:
    """Evict the step's rows at their budget, `steady` (row in the step, slot, its `_Run`), back to it:
    together where the method's eviction is the base class's (slots at the same counts in one pass per
    layer), else one slot at a time. A row whose eviction fails goes to `fail(run, error)`, alone. `inside`:
    the step evicted them already (`evict_in_step`); only the host's counts follow."""
    if inside:
        for _, _, run in steady:
            for layer in run.cache.layers:
                layer.mirror_drop(layer.n - 1)
            run.cache.unordered = True
            run.stats.compressions += 1
        return
    if batch_evictable(method):
        groups: dict[tuple, list] = {}
        for item in steady:
            groups.setdefault(tuple(item[2].cache.lengths()), []).append(item)
        for group in groups.values():
            try:
                evict_rows(method, pool, [run.cache for _, _, run in group], [r for r, _, _ in group],
                           [s for _, s, _ in group])
            except KvpotError as err:
                for _, _, run in group:
                    fail(run, err)
                continue
            for _, _, run in group:
                run.stats.compressions += 1
        return
    for row, slot, run in steady:
        try:
            if evict_one(method, pool, run.cache, row, slot):
                run.stats.compressions += 1
        except KvpotError as err:
            fail(run, err)


def evict_rows(method: EvictionMethod, pool, caches: list, batch_rows: list[int], slots: list[int]) -> None:
    """Evict every layer of `slots` (their caches `caches`, rows `batch_rows` of the step just run) back to
    the method's keep count, as `method.after_forward(cache, DECODE_STEP)` would for each alone."""
    device = pool.device
    rows = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
    picks = torch.tensor(batch_rows, dtype=torch.long).to(device, non_blocking=True)
    renumbers = pool.policy.renumbers
    replacing = replace.enabled and replaces_by_ranking(method)
    if not replacing:
        for cache in caches:
            replace.restore_order(cache)  # a top-k keeps entries in the order of their places
    # slots are handed out lowest first, so a group is usually a run of neighbours: then plain slices
    # (strided copies at the memory's speed) replace advanced indexing (an index computed per element)
    span = slice(slots[0], slots[-1] + 1) if slots == list(range(slots[0], slots[-1] + 1)) else None
    for index, storage in enumerate(pool.layers):
        n = caches[0].layers[index].n  # the same in every slot of the group
        probs = storage.probs
        view = RowsView(storage, rows, n, None if probs is None else probs[picks, :, :n])
        keep = method.keep_count(view, DECODE_STEP)
        if not (replacing and keep == n - 1 and method.replace_fused(view, DECODE_STEP, storage, rows, renumbers)):
            method.update_scores(view, DECODE_STEP)
            if n <= keep:
                _write_scores(view, rows, n)
                continue
            if replacing and keep == n - 1:
                _replace_rows(method, storage, view, rows, n, renumbers)
            else:
                _select_rows(method, storage, view, rows, span, n, keep, renumbers)
        # a scalar through a fill, not `lengths[index, rows] = keep`: that copies it from the host, a blocking copy
        # that waits for the device, so the host sat idle behind every step (64 readers: StreamingLLM 26.4 ms a step
        # against InfiniPot's 19.0, records/engine-core-h100/launch-ahead/)
        pool.lengths[index].index_fill_(0, rows, keep)
        for cache in caches:
            layer = cache.layers[index]
            layer.mirror_drop(keep)
            cache.unordered = cache.unordered or replacing


def _select_rows(method, storage, view: RowsView, rows, span, n: int, keep: int, renumbers: bool) -> None:
    """The rows keep their top `keep` entries, gathered to the front of their slots."""
    chosen = top_indices(method.scores(view, DECODE_STEP), keep).expand(len(rows), storage.kv_heads, -1)
    for name in ("keys", "values"):
        buf = getattr(storage, name)
        at = chosen.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1])
        _put(buf, rows, span, keep, torch.gather(_take(buf, rows, span, n), 2, at))
    # rank policies renumber 0..keep-1, which the first `keep` entries already hold
    for buf in (storage.positions, *(() if renumbers else (storage.rope_positions,))):
        _put(buf, rows, span, keep, torch.gather(_take(buf, rows, span, n), 2, chosen))
    for name, values in view.gathered.items():
        _put(storage.score(name), rows, span, keep, torch.gather(values, 2, chosen))


def _replace_rows(method, storage, view: RowsView, rows, n: int, renumbers: bool) -> None:
    """Each row drops its one entry by the method's ranking; its newest entry (the last) takes the slot."""
    ranking = method.ranking(view, DECODE_STEP)
    _write_scores(view, rows, n)  # the step's update, before the newest entry's score moves
    replace.replace_newest(storage.keys, storage.values, storage.positions, storage.rope_positions,
                           list(storage.scores.values()), n, ranking.scores, rows, ranking.sinks, ranking.recent,
                           renumbers)


def _take(buf: torch.Tensor, rows: torch.Tensor, span: slice | None, n: int) -> torch.Tensor:
    """The first `n` entries of the rows' slots: a view when they are neighbours, else a gathered copy."""
    return buf[span, :, :n] if span is not None else buf[rows, :, :n]


def _put(buf: torch.Tensor, rows: torch.Tensor, span: slice | None, keep: int, kept: torch.Tensor) -> None:
    if span is not None:
        buf[span, :, :keep].copy_(kept)
    else:
        buf[rows, :, :keep] = kept


def evict_one(method, pool, cache, row: int, slot: int) -> bool:
    """One slot at its budget: the method's own `after_forward`, with row `row`'s observation of the
    step just run (D2O's merges, any method without the batched form). True if it evicted."""
    for layer in cache.layers:
        probs = layer.storage.probs
        layer.observation = None if probs is None else probs[row : row + 1, :, : layer.n]
    cache.static = True  # the batched step appended in place: the one-entry eviction may replace (D2O)
    try:
        return method.after_forward(cache, DECODE_STEP)
    finally:
        cache.static = False
        for layer in cache.layers:
            layer.observation = None
        pool.sync_lengths(slot)


def _write_scores(view: RowsView, rows: torch.Tensor, n: int) -> None:
    """Scores updated without an eviction (a layer below its keep count) go back as they are."""
    for name, values in view.gathered.items():
        view.storage.score(name)[rows, :, :n] = values


def mirror_append(run) -> None:
    """The host-side counts of a run after a batched step appended its token (the device did the append)."""
    cache = run.cache
    for layer in cache.layers:
        layer.mirror_append(1)
    cache.note_entries(max(layer.n for layer in cache.layers))
    run.next_position += 1
