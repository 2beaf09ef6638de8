"""PotCache: a `transformers.Cache` whose layers kvpot can select from, per KV head.

Each layer holds preallocated buffers (gpt-fast style: appends write in place, no `torch.cat`
per token) of shape `[batch, kv_heads, capacity, ...]`, of which the first `n` entries are live:

- `keys`, `values`: `[b, kv_heads, capacity, head_dim]`. Keys are un-rotated unless the position
  policy never moves them (`absolute`), in which case they are stored rotated.
- `positions`: `[b, kv_heads, capacity]` each entry's token index in the input stream. Entries
  may differ per KV head: methods select per head, and GQA stays GQA (nothing repeats KV heads).
- `rope_positions`: `[b, kv_heads, capacity]` the position the policy gives each entry.
- `scores[name]`: `[b, kv_heads, capacity]` float32 per-entry scores a method keeps
  (accumulated attention, NuC, ...); selections carry them along.

Every layer holds the same number of entries in each of its KV heads, so "KV entries" below is
per KV head. The cache records the largest count any layer reached (`max_entries`).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpot.errors import KvpotError
from kvpot.host_memory import copy_buffer, empty_buffer, grow_buffer, on_host, store_on_host
from kvpot.positions import PositionPolicy
from kvpot.rope import Rope


class PotLayer(CacheLayerMixin):
    """One layer's entries. `n` live entries at the front of each buffer."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: PotCache, layer_idx: int):
        super().__init__()
        self.cache = cache  # held weakly: see the property
        self.layer_idx = layer_idx
        self.n = 0
        self.n_new = 0  # entries appended by the forward in progress (the last `n_new`)
        self.max_rope = -1  # host-side upper bound of rope_positions[:n]
        self.positions: torch.Tensor | None = None
        self.rope_positions: torch.Tensor | None = None
        self.scores: dict[str, torch.Tensor] = {}
        self.observation: torch.Tensor | None = None  # filled by the attention function
        # CPU only: keys kept rotated at their current positions, the first `rotated_valid` up to date,
        # so a forward rotates only the entries that are new or whose position moved (see attention_keys)
        self.rotated: torch.Tensor | None = None
        self.rotated_valid = 0
        # Fixed-shape decoding (`kvpot.engine.decoding`): the live count and the slot the step writes live
        # in device tensors, so one captured step serves every length (None outside it).
        self.length: torch.Tensor | None = None  # [1] long: live entries, the step's token included
        self.slot: torch.Tensor | None = None  # [1] long: where the step's token was written
        self.query_position: torch.Tensor | None = None  # [1] long: the RoPE position of the step's query

    # The cache holds its layers; a layer refers back to its cache weakly, so a dropped cache (with
    # gigabytes of buffers) is freed at once by reference counting rather than at the next collection.
    @property
    def cache(self) -> PotCache:
        return self._cache()

    @cache.setter
    def cache(self, cache: PotCache) -> None:
        self._cache = weakref.ref(cache)

    # ---- transformers' CacheLayerMixin surface ----
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, kv_heads, _, head_dim = key_states.shape
        self.batch, self.kv_heads, self.head_dim = b, kv_heads, head_dim
        self.dtype, self.device = key_states.dtype, key_states.device
        capacity = max(self.cache.capacity_hint, 1)
        # offloading (InfiniteHiP): entries live in page-locked host memory, which kernels read directly
        host = self.cache.host_storage and self.device.type == "cuda"
        self.keys = empty_buffer((b, kv_heads, capacity, head_dim), self.dtype, self.device, host)
        self.values = empty_buffer((b, kv_heads, capacity, value_states.shape[-1]), value_states.dtype, self.device,
                                   host)
        self.positions = empty_buffer((b, kv_heads, capacity), torch.long, self.device, host)
        self.rope_positions = empty_buffer((b, kv_heads, capacity), torch.long, self.device, host)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a forward's un-rotated keys/values; return rotated keys and values to attend to."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.cache.static:
            return self._static_update(key_states, value_states)
        self.append(key_states, value_states)
        return self.attention_keys(), self.values[:, :, : self.n]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """`update`'s append alone, for an attention that reads the buffers itself (a mixed step's varlen
        kernel, `kvpot.engine.mixed`): the whole cache's keys are not rotated for it."""
        cache, q = self.cache, key_states.shape[-2]
        original = cache.positions_on(key_states.device)
        if original is None or original.shape[-1] != q:
            raise KvpotError("PotCache.update was called outside kvpot.Engine (no positions were announced).")
        policy, rope = cache.policy, cache.rope
        rope_new = policy.new_positions(self, original)  # [b, kv_heads, q]
        max_rope = cache.pending_max_position if policy.stores_rotated else self.n + q - 1
        key_states = rope.unscale(key_states)
        if policy.stores_rotated:
            key_states = rope.rotate(key_states, rope_new, max_rope)
        self.reserve(self.n + q)
        end = self.n + q
        self.keys[:, :, self.n : end] = key_states
        self.values[:, :, self.n : end] = value_states
        self.positions[:, :, self.n : end] = original
        self.rope_positions[:, :, self.n : end] = rope_new
        for score in self.scores.values():
            score[:, :, self.n : end] = 0.0
        self.n, self.n_new = end, q
        self.max_rope = max(self.max_rope, max_rope)
        cache.note_entries(end)

    def _static_update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Append one token at the device-side slot `length` (no host value decides an index or a
        shape, so the step can be captured once and replayed at any length); return the whole
        buffers: the attention reads `length` live entries, rotating keys as it loads them."""
        cache, policy = self.cache, self.cache.policy
        b, kv = self.batch, self.kv_heads
        self.slot.copy_(self.length)
        original = cache.pending_positions.view(1, 1, 1).expand(b, kv, 1)  # the token's stream position
        # rank policies number entries 0..n-1, so the new entry's position is its slot
        rope_new = original if policy.stores_rotated or policy.raw_keys else self.slot.view(1, 1, 1).expand(b, kv, 1)
        key_states = cache.rope.unscale(key_states)
        if policy.stores_rotated:
            key_states = cache.rope.rotate(key_states, rope_new, cache.pending_max_position)
        if on_host(self.keys, self.device):  # offloaded (InfiniteHiP): a kernel writes into pinned host memory
            store_on_host(self, key_states, value_states, original, rope_new)
        else:
            self.keys.index_copy_(2, self.slot, key_states)
            self.values.index_copy_(2, self.slot, value_states)
            self.positions.index_copy_(2, self.slot, original)
            self.rope_positions.index_copy_(2, self.slot, rope_new)
        for score in self.scores.values():
            score.index_fill_(2, self.slot, 0.0)
        self.query_position.copy_(rope_new.reshape(-1)[:1])
        policy.decode_positions(self.positions, self.rope_positions, self.query_position, None, self.slot)
        self.length.add_(1)
        # host mirror of the count (the decoding loop keeps it in step with the device)
        self.n, self.n_new = self.n + 1, 1
        if not policy.stores_rotated:
            self.max_rope = self.n - 1
        cache.note_entries(self.n)
        return self.keys, self.values

    def enter_static(self) -> None:
        """Allocate the device-side counters and set them from the host count."""
        if self.slot is None:
            if self.length is None:  # (a pool's slot counts in the pool's device counts: `SlotPool.cache`)
                self.length = torch.zeros(1, dtype=torch.long, device=self.device)
            self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
            self.query_position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.length.fill_(self.n)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1

    # ---- kvpot's surface ----
    @property
    def parallel(self):
        """The tensor-parallel group this layer's heads are a part of (`kvpot.models.parallel.TensorParallel`), or None."""
        return self.cache.parallel

    @property
    def capacity(self) -> int:
        return 0 if not self.is_initialized else self.keys.shape[2]

    def reserve(self, size: int) -> None:
        """Grow the buffers to hold `size` entries (bounded methods preallocate their bound)."""
        if size <= self.capacity:
            return
        # doubling amortises small caches; past 64K entries grow by an eighth, so a million-entry
        # cache that decodes one more token does not ask for twice its memory
        step = self.capacity if self.capacity < 65536 else self.capacity // 8
        new_capacity = max(size, self.capacity + step)
        self.keys = grow_buffer(self.keys, new_capacity, self.n, self.device)
        self.values = grow_buffer(self.values, new_capacity, self.n, self.device)
        self.positions = grow_buffer(self.positions, new_capacity, self.n, self.device)
        self.rope_positions = grow_buffer(self.rope_positions, new_capacity, self.n, self.device)
        self.scores = {k: grow_buffer(v, new_capacity, self.n, self.device) for k, v in self.scores.items()}

    def attention_keys(self) -> torch.Tensor:
        """Keys [b, kv_heads, n, d] rotated at their current positions.

        On a GPU the whole cache is rotated in one pass per forward (the decoding steps rotate while
        loading instead: `kvpot.attention.static_attention`). On a CPU, where that pass is the
        bottleneck of decoding, rotated keys are kept and only the entries that are new or whose
        position a selection moved are rotated again, from the un-rotated keys (so nothing drifts).
        `dynamic` RoPE is evaluated per call with the model's call history, so it keeps the full pass.
        """
        keys = self.keys[:, :, : self.n]
        rope, policy = self.cache.rope, self.cache.policy
        if policy.stores_rotated or policy.raw_keys or self.device.type != "cpu" or rope.dynamic:
            return self.rotated_keys(keys)
        if self.rotated is None or self.rotated.shape[2] < self.n:
            self.rotated = torch.empty_like(self.keys)
            self.rotated_valid = 0
        start, end = self.rotated_valid, self.n
        if start < end:
            self.rotated[:, :, start:end] = rope.rotate(self.keys[:, :, start:end],
                                                        self.rope_positions[:, :, start:end], self.max_rope)
        self.rotated_valid = end
        return self.rotated[:, :, :end]

    def rotated_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """`keys` [b, kv_heads, m, d], this layer's first m entries' keys, as attention reads them: rotated at their
        current positions in one pass, unless the policy stores them rotated or attends to them raw."""
        policy = self.cache.policy
        if policy.stores_rotated or policy.raw_keys:
            return keys
        return self.cache.rope.rotate(keys, self.rope_positions[:, :, : keys.shape[2]], self.max_rope)

    def rotate_queries(self, query: torch.Tensor) -> torch.Tensor:
        """Rotate this forward's queries [b, heads, q, d] at the positions of the new entries."""
        q = query.shape[-2]
        positions = self.rope_positions[:, :, self.n - q : self.n]
        return self.cache.rope.rotate(self.cache.rope.unscale(query), positions, self.max_rope)

    def score(self, name: str) -> torch.Tensor:
        """The live part of per-entry score `name` [b, kv_heads, n] (created at zero on first use)."""
        if name not in self.scores:
            shape = (self.batch, self.kv_heads, self.capacity)
            self.scores[name] = torch.zeros(shape, dtype=torch.float32, device=self.device)
        return self.scores[name][:, :, : self.n]

    # The host-side counts (`n`, `n_new`, `max_rope`) mirror what the device did; they are written here only.
    def mirror_append(self, count: int, last_position: int | None = None) -> None:
        """The device appended `count` entries (a step's token, a chunk) that the host did not write: `n`, `n_new`,
        and `max_rope` (ranked positions: the last rank; keys stored rotated: at least `last_position`, if given)."""
        self.n += count
        self.n_new = count
        if not self.cache.policy.stores_rotated:
            self.max_rope = self.n - 1
        elif last_position is not None:
            self.max_rope = max(self.max_rope, last_position)

    def mirror_drop(self, n: int) -> None:
        """The device evicted down to `n` entries (in place, or replaced out of stream order): ranked positions end
        at `n - 1`; a CPU layer's rotated copy no longer matches its entries."""
        self.n, self.n_new = n, 0
        self.rotated_valid = 0
        if not self.cache.policy.stores_rotated:
            self.max_rope = n - 1

    def set_counts(self, n: int, max_rope: int, n_new: int | None = None) -> None:
        """Counts taken from elsewhere: a copied or loaded cache, the counts a captured step ends at."""
        self.n, self.max_rope = n, max_rope
        if n_new is not None:
            self.n_new = n_new

    def select(self, keep: torch.Tensor) -> None:
        """Keep entries `keep` [b, kv_heads | 1, k] (ascending indices into the live entries)."""
        keep = keep.expand(self.batch, self.kv_heads, -1)
        k = keep.shape[-1]
        for name in ("keys", "values"):
            buf = getattr(self, name)
            idx = keep.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1])
            buf[:, :, :k] = torch.gather(buf[:, :, : self.n], 2, idx)
        renumbered = self.cache.policy.renumbers
        for buf in (self.positions, *(() if renumbered else (self.rope_positions,)), *self.scores.values()):
            buf[:, :, :k] = torch.gather(buf[:, :, : self.n], 2, keep)
        if self.rotated is not None:  # entries up to the first one that moved keep their rotation
            moved = keep != torch.arange(k, device=keep.device)
            self.rotated_valid = min(self.rotated_valid, int(moved.any(dim=1).any(dim=0).int().argmax())
                                     if bool(moved.any()) else k)
        self.n = k
        self.n_new = 0
        self.cache.policy.after_select(self)
        if not self.cache.policy.stores_rotated:
            self.max_rope = k - 1

    def append_entries(self, other: PotLayer, start: int) -> None:
        """Append `other`'s entries from `start` on (stored keys, values, original positions).

        Both layers must belong to caches with the same position policy, so stored keys mean the
        same thing in both; the policy numbers the new entries as if they had been encoded here.
        Scores are not carried over (they start at 0).
        """
        if not self.is_initialized:
            self.lazy_initialization(other.keys[:, :, :0], other.values[:, :, :0])
        q = other.n - start
        original = other.positions[:, :, start : other.n]
        self.reserve(self.n + q)
        end = self.n + q
        rope_new = self.cache.policy.new_positions(self, original[0, 0])
        self.keys[:, :, self.n : end] = other.keys[:, :, start : other.n]
        self.values[:, :, self.n : end] = other.values[:, :, start : other.n]
        self.positions[:, :, self.n : end] = original
        self.rope_positions[:, :, self.n : end] = rope_new
        for score in self.scores.values():
            score[:, :, self.n : end] = 0.0
        self.max_rope = max(self.max_rope, other.max_rope if self.cache.policy.stores_rotated else end - 1)
        self.n, self.n_new = end, q
        self.cache.note_entries(end)

    def truncate(self, n: int) -> None:
        """Drop every entry after the first `n` (probe rollback); bit-exact for what remains."""
        self.n = min(self.n, n)
        self.n_new = 0
        self.rotated_valid = min(self.rotated_valid, self.n)

    def clone_into(self, cache: PotCache) -> PotLayer:
        twin = PotLayer(cache, self.layer_idx)
        twin.n, twin.max_rope = self.n, self.max_rope
        if self.is_initialized:
            twin.batch, twin.kv_heads, twin.head_dim = self.batch, self.kv_heads, self.head_dim
            twin.dtype, twin.device = self.dtype, self.device
            twin.keys, twin.values = copy_buffer(self.keys, self.device), copy_buffer(self.values, self.device)
            twin.positions = copy_buffer(self.positions, self.device)
            twin.rope_positions = copy_buffer(self.rope_positions, self.device)
            twin.scores = {k: v.clone() for k, v in self.scores.items()}
            twin.is_initialized = True
        return twin


def _clone_state(value):
    """Copies of tensors, caches and objects that know how to copy themselves (`clone()`)."""
    if callable(getattr(value, "clone", None)):  # tensors, caches, InfiniteHiP's runtime
        return value.clone()
    return value


class PotCache(Cache):
    """The cache kvpot's engine hands to the model (`kvpot.compat.cache_kwargs`).

    Besides the entries, it carries what the attention function needs for the forward in
    progress: the original positions of the incoming tokens (`pending_positions`) and the
    attention observation a method asked for (`request`).
    """

    def __init__(self, num_layers: int, rope: Rope, policy: PositionPolicy, capacity_hint: int = 0, parallel=None):
        self.rope = rope
        self.policy = policy
        self.capacity_hint = capacity_hint
        self.host_storage = False  # entries in pinned host memory (InfiniteHiP's offloading)
        self.pending_positions: torch.Tensor | None = None  # [q] long
        self._pending_copies: dict[torch.device, torch.Tensor] = {}  # the same on other devices
        self.pending_max_position = -1
        self.request = None  # kvpot.attention.AttentionRequest | None
        self.max_entries = 0
        self.method_state: dict = {}
        self.linked = None  # a second cache whose entries count with ours (CItruS); held weakly
        # A method's replacement of dense attention (InfiniteHiP): called by the kvpot attention
        # function as attention(layer, query, keys, values, scaling) -> [b, heads, q, d].
        self.attention = None
        self.static = False  # fixed-shape decoding steps (`kvpot.engine.decoding`); see PotLayer._static_update
        self.split_entries = None  # the decode kernel's fixed split size (`Engine(batch_invariant=True)`)
        self.unordered = False  # entries out of stream order in their places (`kvpot.methods.replace`)
        # tensor parallelism (`kvpot.models.parallel.TensorParallel`): this rank holds its own KV heads only; a method
        # whose selection spans heads gathers every rank's scores through it (`kvpot.models.parallel.all_heads`)
        self.parallel = parallel
        super().__init__(layers=[PotLayer(self, i) for i in range(num_layers)])

    def begin_forward(self, positions: torch.Tensor, max_position: int, request=None) -> None:
        """Announce the original positions [q] of the next forward's tokens and what to observe."""
        self.pending_positions = positions
        self._pending_copies = {}
        self.pending_max_position = max_position
        self.request = request
        for layer in self.layers:
            layer.observation = None

    def positions_on(self, device: torch.device) -> torch.Tensor | None:
        """The announced positions on `device`: a model split over GPUs by accelerate reads them in
        layers on every GPU, so each device gets one copy per forward, not one per layer."""
        positions = self.pending_positions
        if positions is None or positions.device == device:
            return positions
        copy = self._pending_copies.get(device)
        if copy is None:
            copy = self._pending_copies[device] = positions.to(device)
        return copy

    @property
    def linked(self) -> PotCache | None:
        return None if self._linked is None else self._linked()

    @linked.setter
    def linked(self, other: PotCache | None) -> None:
        # weak both ways: two linked caches would otherwise keep each other (and their buffers) alive
        self._linked = None if other is None else weakref.ref(other)

    def note_entries(self, n: int) -> None:
        """Record that a layer holds `n` entries; with a linked cache, the two count together."""
        if self.linked is not None:
            n += max(self.linked.lengths())
            self.linked.max_entries = max(self.linked.max_entries, n)
        self.max_entries = max(self.max_entries, n)

    def twin(self) -> PotCache:
        """An empty cache with the same layers, RoPE and policy, linked to this one for counting."""
        other = PotCache(len(self.layers), self.rope, self.policy, self.capacity_hint)
        other.parallel = self.parallel
        other.linked, self.linked = self, other
        return other

    def adopt(self, other: PotCache) -> None:
        """Take `other`'s entries as ours (CItruS answers from its instruction cache)."""
        self.layers = other.layers
        for layer in self.layers:
            layer.cache = self
        self.linked = None

    def lengths(self) -> list[int]:
        return [layer.n for layer in self.layers]

    def truncate(self, lengths: list[int]) -> None:
        for layer, n in zip(self.layers, lengths):
            layer.truncate(n)

    def clone(self) -> PotCache:
        """An independent copy (the engine's reusable prefill state is never consumed)."""
        twin = PotCache(len(self.layers), self.rope, self.policy, self.capacity_hint)
        twin.host_storage = self.host_storage
        twin.parallel = self.parallel
        twin.layers = [layer.clone_into(twin) for layer in self.layers]
        twin.max_entries = self.max_entries
        twin.unordered = self.unordered
        twin.attention = _clone_state(self.attention)
        twin.method_state = {}
        for key, value in self.method_state.items():
            copy = _clone_state(value)
            if value is not None and value is self.linked:  # keep a linked second cache linked to the copy
                twin.linked, copy.linked = copy, twin
            twin.method_state[key] = copy
        return twin

    @property
    def is_compileable(self) -> bool:
        return False
