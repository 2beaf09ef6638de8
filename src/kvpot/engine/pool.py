"""A slot pool: per-layer KV storage with a slot dimension, for many sequences at once.

A bounded method's cache has a size known before it starts (`Method.max_entries()`), so the KV of
`slots` sequences fits in buffers allocated once, `[slots + 1, kv_heads, capacity, d]` per layer.
A sequence owns one slot from admission to its end; a freed slot is reused. The last row is
scratch: padding rows of a batched step (a captured graph has a fixed batch size) write there. A pool of one
slot has none (`scratch=False`, the default there): its one bucket never pads, so a row of it would double a
growing cache's memory for nothing (docs/design.md, *Why two decode runners remain*).

Each slot is seen two ways:
- as an ordinary `PotCache` (`SlotPool.cache(slot)`) whose layers' buffers are views of the slot's
  row, so the one-sequence engine (chunked prefill, a method's evictions and distillations, its
  probes) runs on it unchanged and writes the pool in place; growing past `capacity` is refused;
- as a row of the batched decoding step (`kvpot.engine.batch`), which appends one token to each of
  many slots in one forward. Host-side counts (`PotLayer.n`) are the truth between steps; the
  device-side `lengths` `[layers, slots + 1]` follow them (`sync_lengths`).

Tail slots (`SlotPool(stride=G)`, `Scheduler(reader_room=...)`): a reader of a shared document reads the document's
keys and values from the document region (`kvpot.engine.documents`) and writes only its tail, lanes
`[n_doc, n_doc + room)` of its slot. So keys and values live in one arena per layer, `[kv_heads, lanes, d]`, and
slot `s`'s lane `j` is the arena's lane `s * G + j`: the `[slots + 1, kv_heads, capacity, d]` tensors every kernel
and view reads are strided views of it (slot stride `G * d`) whose slots overlap. `Lanes` keeps the lanes each
slot holds apart on the host: a reader holds its tail's, any other sequence its whole slot's, and a reader that
copies its document widens to its whole slot first (`widen`). Nothing else changes: a view with a small slot
stride is still a view. Positions and scores stay one row a slot (a reader keeps the document's own copy there).
"""

from __future__ import annotations

import torch

from kvpot.cache import PotCache, PotLayer, _clone_state
from kvpot.errors import KvpotError
from kvpot.positions import PositionPolicy
from kvpot.rope import Rope
from kvpot.engine.slot_sizes import kv_shape, tail_stride


class PoolLayer:
    """One layer's storage for every slot (row `slots`, where there is one, is scratch)."""

    def __init__(self, rows: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, stride: int | None = None, adopt: PotLayer | None = None):
        self.rows, self.kv_heads, self.capacity, self.head_dim = rows, kv_heads, capacity, head_dim
        self.parallel = None  # the pool's tensor-parallel group (set by SlotPool)
        self.dtype, self.device = dtype, device
        self.scores: dict[str, torch.Tensor] = {}  # name -> [rows, kv_heads, capacity] float32
        if adopt is not None:  # a spent state's layer, its buffers the slot's (`SlotPool(adopt=...)`): views
            self.keys, self.values, self.positions, self.rope_positions = (
                buf[:, :, :capacity] for buf in (adopt.keys, adopt.values, adopt.positions, adopt.rope_positions))
            self.scores = {name: buf[:, :, :capacity] for name, buf in adopt.scores.items()}
        elif stride is None:  # zeros, not empty: lanes past a slot's length are masked by the attention, but must be
            self.keys = torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)  # finite
            self.values = torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        else:  # tail slots: views of one arena of lanes a layer (the module's docstring)
            self.keys, self.values = (arena_view(rows, kv_heads, capacity, head_dim, stride, dtype, device)
                                      for _ in range(2))
        if adopt is None:
            self.positions = torch.zeros(rows, kv_heads, capacity, dtype=torch.long, device=device)
            self.rope_positions = torch.zeros(rows, kv_heads, capacity, dtype=torch.long, device=device)
        self.query_position = torch.zeros(rows, dtype=torch.long, device=device)  # the batched step's query
        self.heads = torch.arange(kv_heads, device=device).view(1, -1)  # [1, kv_heads]: a step's per-head index
        self.probs: torch.Tensor | None = None  # [rows, kv_heads, capacity]: a batched step's observation
        self.views: dict[int, tuple] = {}  # row -> its (keys, values, positions, rope_positions) views

    def row_views(self, row: int) -> tuple:
        """Row `row`'s (keys, values, positions, rope_positions), `[1, ...]` views made once: a row never moves, and
        making them for each new sequence took 65 ms of the host's time to admit 64 readers on an 8B shape (2,048
        layers; an H100, records/shared-document-h100/, call15)."""
        views = self.views.get(row)
        if views is None:
            at = slice(row, row + 1)
            views = self.views[row] = (self.keys[at], self.values[at], self.positions[at], self.rope_positions[at])
        return views

    def score(self, name: str) -> torch.Tensor:
        """Score buffer `name` for every slot, created at zero on first use."""
        if name not in self.scores:
            shape = (self.rows, self.kv_heads, self.capacity)
            self.scores[name] = torch.zeros(shape, dtype=torch.float32, device=self.device)
        return self.scores[name]

    def observation_buffer(self) -> torch.Tensor:
        if self.probs is None:
            self.probs = torch.zeros(self.rows, self.kv_heads, self.capacity, dtype=torch.float32, device=self.device)
        return self.probs

    @property
    def nbytes(self) -> int:
        buffers = (self.keys, self.values, self.positions, self.rope_positions, *self.scores.values())
        # (a tail slots' arena counted once: its views' slots overlap)
        return sum(b.untyped_storage().nbytes() for b in buffers) + (0 if self.probs is None else self.probs.nbytes)


def arena_view(rows: int, kv_heads: int, capacity: int, head_dim: int, stride: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """`[rows, kv_heads, capacity, head_dim]` over an arena `[kv_heads, (rows - 1) * stride + capacity, head_dim]`:
    row `s`'s lane `j` at the arena's lane `s * stride + j`, so rows overlap where `stride < capacity`."""
    lanes = (rows - 1) * stride + capacity
    arena = torch.zeros(kv_heads, lanes, head_dim, dtype=dtype, device=device)
    return arena.as_strided((rows, kv_heads, capacity, head_dim), (stride * head_dim, lanes * head_dim, head_dim, 1))


class Lanes:
    """Which lanes of a tail-slotted pool's arena each slot holds (host side; the module's docstring): slot `s`
    holding `[lo, hi)` holds the arena's `[s * stride + lo, s * stride + hi)`, and no two slots hold one lane."""

    def __init__(self, slots: int, capacity: int, stride: int):
        self.capacity, self.stride = capacity, stride
        self.taken = bytearray(slots * stride + capacity)  # 1: a slot holds the lane
        self.held: dict[int, tuple[int, int]] = {}
        self.hold(slots, 0, capacity)  # the scratch slot's padding rows write its first lanes

    def free(self, slot: int, lo: int, hi: int) -> bool:
        at = slot * self.stride
        return self.taken.find(1, at + lo, at + hi) < 0

    def hold(self, slot: int, lo: int, hi: int) -> None:
        at = slot * self.stride
        self.taken[at + lo : at + hi] = b"\x01" * (hi - lo)
        self.held[slot] = (lo, hi)

    def drop(self, slot: int) -> None:
        lo, hi = self.held.pop(slot)
        at = slot * self.stride
        self.taken[at + lo : at + hi] = bytes(hi - lo)

    def widen(self, slot: int) -> bool:
        """Slot `slot` holding all its lanes, if the ones it lacks are free (False, and unchanged, if not)."""
        lo, hi = self.held[slot]
        self.drop(slot)
        if self.free(slot, 0, self.capacity):
            self.hold(slot, 0, self.capacity)
            return True
        self.hold(slot, lo, hi)
        return False


class SlotLayer(PotLayer):
    """A `PotLayer` whose buffers are one slot's row of a `PoolLayer` (views: writes land in the pool)."""

    def __init__(self, cache: PotCache, layer_idx: int, storage: PoolLayer, row: int):
        super().__init__(cache, layer_idx)
        self.storage, self.row = storage, row
        self.keys, self.values, self.positions, self.rope_positions = storage.row_views(row)
        self.batch, self.kv_heads, self.head_dim = 1, storage.kv_heads, storage.head_dim
        self.dtype, self.device = storage.dtype, storage.device
        self.is_initialized = True

    # (keys [kv_heads, capacity, d], values, n_doc) of the shared document this slot reads in a joined region
    # (`kvpot.engine.documents.DocumentRegion.join`): its entries [0, n_doc) are there, not in the slot
    document: tuple | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """`PotLayer.update`; a joined reader's forward (its question) attends the document's entries and its own as
        one sequence: the same keys and values a copied reader's forward gets."""
        if self.document is None:
            return super().update(key_states, value_states, *args, **kwargs)
        self.append(key_states, value_states)
        keys, values, n_doc = self.document
        keys = torch.cat((keys[None, :, :n_doc], self.keys[:, :, n_doc : self.n]), dim=2)
        values = torch.cat((values[None, :, :n_doc], self.values[:, :, n_doc : self.n]), dim=2)
        return self.rotated_keys(keys), values

    # the pool owns the score buffers (a batched step updates them for every slot at once)
    @property
    def scores(self) -> dict[str, torch.Tensor]:
        return {name: buf[self.row : self.row + 1] for name, buf in self.storage.scores.items()}

    @scores.setter
    def scores(self, value: dict) -> None:
        if value:  # PotLayer.__init__ and reserve() assign; only the empty dict of __init__ reaches here
            raise KvpotError("a pool slot's scores live in the pool; they cannot be replaced.")

    def score(self, name: str) -> torch.Tensor:
        return self.storage.score(name)[self.row : self.row + 1, :, : self.n]

    def reserve(self, size: int) -> None:
        if size > self.capacity:
            raise KvpotError(
                f"this sequence needs {size:,} KV entries per layer and KV head, more than a pool slot holds "
                f"({self.capacity:,}); give the batch a larger capacity, or use a bounded method."
            )


class SlotPool:
    """KV storage for `slots` sequences of at most `capacity` entries per layer and KV head."""

    def __init__(self, config, rope: Rope, policy: PositionPolicy, slots: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, parallel=None, stride: int | None = None,
                 scratch: bool | None = None, adopt: PotCache | None = None):
        if not isinstance(slots, int) or slots < 1:
            raise KvpotError(f"a pool needs at least one slot, got {slots!r}.")
        scratch = slots > 1 if scratch is None else scratch
        if adopt is not None and (scratch or stride):
            raise KvpotError("a pool adopts a state's buffers as its one slot, without scratch or tail slots.")
        if not scratch and slots > 1:
            raise KvpotError(f"a pool of {slots} slots pads its batched steps' rows into a scratch slot; only a "
                             "pool of one slot goes without.")
        if not isinstance(capacity, int) or capacity < 1:
            raise KvpotError(f"a pool slot needs a capacity of at least one entry, got {capacity!r}.")
        self.rope, self.policy = rope, policy
        self.slots, self.capacity = slots, capacity
        self.scratch = slots if scratch else None  # the row padding rows of a batched step write to
        self.rows = slots + 1 if scratch else slots  # rows of every per-slot buffer (the slots, then scratch)
        self.parallel = parallel  # kvpot.models.parallel.TensorParallel: each rank's slots hold its own KV heads
        kv_heads, head_dim = kv_shape(config, parallel.size if parallel is not None else 1)
        self.num_layers = config.num_hidden_layers
        if stride is not None and (isinstance(stride, bool) or not isinstance(stride, int) or stride < 1):
            raise KvpotError(f"a pool's slot stride must be a positive integer, got {stride!r}.")
        self.stride = stride = tail_stride(stride, slots, capacity)  # tail slots (None: slots apart)
        if stride and not scratch:
            raise KvpotError("tail slots keep the scratch slot's lanes; a pool without one has none to give.")
        self.lanes = Lanes(slots, capacity, stride) if stride else None  # tail slots: the lanes each slot holds
        adopted = adopt_buffers(adopt, capacity) if adopt is not None else [None] * self.num_layers
        self.layers = [PoolLayer(self.rows, kv_heads, capacity, head_dim, dtype, device, stride, layer)
                       for layer in adopted]
        for layer in self.layers:
            layer.parallel = parallel
        self.lengths = torch.zeros(self.num_layers, self.rows, dtype=torch.long, device=device)
        self.device = device
        self.free: list[int] = list(range(slots))  # lowest first: low rows stay dense
        self.caches: dict[int, PotCache] = {}
        self.documents = None  # kvpot.engine.documents.DocumentRegion: stored documents shared by their readers
        self.pending: list[tuple[int, PotCache, bool]] = []  # loads whose device copies wait for `flush`

    # ------------------------------------------------------------------ slots
    def acquire(self, lo: int = 0, hi: int | None = None) -> int | None:
        """A free slot, or None when every slot is taken. With tail slots, the lowest free slot whose lanes
        `[lo, hi)` (default: all of them) are free in the arena, or None when none is."""
        self.free.sort()
        if self.lanes is None:
            return self.free.pop(0) if self.free else None
        hi = self.capacity if hi is None else min(hi, self.capacity)
        for i, slot in enumerate(self.free):
            if self.lanes.free(slot, lo, hi):
                self.lanes.hold(slot, lo, hi)
                return self.free.pop(i)
        return None

    def widen(self, slot: int) -> None:
        """Slot `slot` holding all its lanes, before its keys and values are written below its tail (a reader copying
        its document); raises if other slots hold them (`reader_lanes` places only readers that never copy)."""
        if self.lanes is not None and not self.lanes.widen(slot):
            raise KvpotError(f"slot {slot} reads a shared document in a tail slot and must copy it, but other slots "
                             "hold the lanes it needs; this reader was expected never to copy (a bug: please report).")

    def release(self, slot: int) -> None:
        if slot in self.free or not 0 <= slot < self.slots:
            raise KvpotError(f"slot {slot} is not in use.")
        self.caches.pop(slot, None)
        if self.documents is not None:
            self.documents.detach(slot)
        self.lengths[:, slot] = 0
        self.pending = [load for load in self.pending if load[0] != slot]
        if self.lanes is not None:
            self.lanes.drop(slot)
        self.free.append(slot)

    @property
    def used(self) -> int:
        return self.slots - len(self.free)

    @property
    def pad_row(self) -> int:
        """The row a batched step's padding rows, and the warm-ups of its captures, point at: the scratch slot, or in
        a pool without one (which never pads) its one slot, warmed only while free (`BatchDecoder.capture`)."""
        return 0 if self.scratch is None else self.scratch

    def clear_pad_row(self) -> None:
        """The pad row's count back to 0 (on the device): what a padding row or a warm-up wrote there is never read."""
        self.lengths[:, self.pad_row] = 0

    def cache(self, slot: int, capacity_hint: int | None = None) -> PotCache:
        """An empty `PotCache` over slot `slot`'s row (a new sequence starts here)."""
        cache = PotCache(self.num_layers, self.rope, self.policy, capacity_hint=self.capacity)
        cache.parallel = self.parallel
        cache.layers = [SlotLayer(cache, i, storage, slot) for i, storage in enumerate(self.layers)]
        for i, layer in enumerate(cache.layers):  # its one-sequence steps count where the batched steps do
            layer.length = self.lengths[i, slot : slot + 1]
        self.caches[slot] = cache
        self.lengths[:, slot] = 0
        self.pending = [load for load in self.pending if load[0] != slot]  # an earlier load of a slot reused
        return cache

    def load(self, slot: int, source: PotCache, keys: bool = True, defer: bool = False) -> PotCache:
        """Slot `slot` holding a copy of `source`'s entries, scores and method state (a stored document's
        state, or a cache a method built beside the pool: CItruS' instruction cache). `source` is unchanged.
        keys=False leaves the keys and values out: a reader of a shared document reads them from the pool's
        document region (`kvpot.engine.documents`) and copies them here only on write.
        defer=True sets the slot's host-side counts now and leaves its device copies to `flush`, which copies each
        source once for all the slots that load it (the caller flushes before the slot is read)."""
        if source.host_storage:
            raise KvpotError("a state offloaded to host memory (infinitehip offload=True) cannot decode in a batch.")
        if keys:
            self.widen(slot)
        cache = self.cache(slot)
        for layer, other in zip(cache.layers, source.layers):
            layer.reserve(other.n)
            layer.set_counts(other.n, other.max_rope)
        cache.max_entries = source.max_entries
        cache.attention = _clone_state(source.attention)
        cache.method_state = {key: _clone_state(value) for key, value in source.method_state.items()}
        self.pending.append((slot, source, keys))
        if not defer:
            self.flush()
        return cache

    def flush(self) -> None:
        """The device copies of the loads since the last flush: one indexed write per layer and buffer for all the
        slots that load one source. Loaded per slot, layer and buffer apart, 64 readers of one document admitted in one
        step took 202 of the step's 267 ms of host time on an H100 (records/shared-document-h100/, call7)."""
        groups: dict[tuple[int, bool], list] = {}
        for slot, source, keys in self.pending:
            groups.setdefault((id(source), keys), [source, keys, []])[2].append(slot)
        self.pending = []
        for source, keys, slots in groups.values():
            rows = torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True)
            for storage, other in zip(self.layers, source.layers):
                n = other.n
                if not n:
                    continue
                # (an indexed write takes no other dtype: a state's buffers are cast to the pool's, as a copy casts)
                pairs = [(getattr(storage, name), getattr(other, name))
                         for name in ("keys", "values", "positions", "rope_positions")[0 if keys else 2 :]]
                for target, buf in pairs + [(storage.score(name), buf) for name, buf in other.scores.items()]:
                    if target.data_ptr() != buf.data_ptr():  # (an adopted state's buffers are the slot's already)
                        target[rows, :, :n] = buf[:, :, :n].to(self.device, target.dtype)
            counts = torch.tensor([layer.n for layer in source.layers], dtype=torch.long)
            self.lengths[:, rows] = counts[:, None].to(self.device, non_blocking=True)

    def settle(self, slot: int, cache: PotCache) -> PotCache:
        """The slot's cache after a run that may have swapped its layers for others (CItruS answers
        from its instruction cache, `PotCache.adopt`): copied back into the slot's row if so."""
        if all(isinstance(layer, SlotLayer) and layer.row == slot for layer in cache.layers):
            self.sync_lengths(slot)
            return cache
        settled = self.load(slot, cache)
        settled.max_entries = max(settled.max_entries, cache.max_entries)
        return settled

    def sync_lengths(self, slot: int) -> None:
        """Device-side counts of `slot` from the host's (after work outside the batched step)."""
        counts = [layer.n for layer in self.caches[slot].layers]
        self.lengths[:, slot] = torch.tensor(counts, dtype=torch.long).to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ sizes
    @property
    def nbytes(self) -> int:
        shared = self.documents.nbytes if self.documents is not None else 0  # a shared document counts once
        return sum(layer.nbytes for layer in self.layers) + self.lengths.nbytes + shared


def adopt_buffers(cache: PotCache, capacity: int) -> list[PotLayer]:
    """`cache`'s layers, their buffers grown to `capacity` entries and zeroed past their counts (lanes past a slot's
    length are masked, but must be finite), for a pool of one slot to adopt: the state is spent."""
    if cache.host_storage:
        raise KvpotError("a state offloaded to host memory (infinitehip offload=True) cannot decode in a batch.")
    for layer in cache.layers:
        layer.reserve(capacity)
        for buf in (layer.keys, layer.values, layer.positions, layer.rope_positions, *layer.scores.values()):
            buf[:, :, layer.n :].zero_()
    return list(cache.layers)
