"""What a batched step hands the model as its cache (`StepCache`), and the kernels it runs.

Each row of the step is a slot of the pool (`kvpot.engine.pool`): `StepLayer.update` writes each row's key and
value at its slot's next entry (one append kernel), and `StepCache.attend` reads every row's live entries with the
batched decode kernel (RoPE applied on load from stored positions, per-slot lengths read on the device), or, for
readers of shared documents, the document and the slot's tail merged (`kvpot.kernels.shared`). The step that runs
it is `kvpot.engine.batch.BatchDecoder`'s.
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvpot.attention import AttentionRequest
from kvpot.engine.pool import SlotPool


class StepLayer(CacheLayerMixin):
    """One layer of a batched step: appends each row's token to its slot in the pool."""

    is_compileable = False
    is_sliding = False
    # this layer's views of the pool's document region (keys, values, RoPE positions, lengths), set by
    # `kvpot.engine.documents.share_region`: read from the layer, never picked by index (a compiled step's
    # layers share one compilation only if nothing they read is picked by a Python integer)
    documents: tuple | None = None
    joined: tuple | None = None  # a joined region's views in the decode kernel's `documents=` order (batch-invariant)

    def __init__(self, cache: StepCache, index: int):
        super().__init__()
        self.step, self.index = cache, index
        self.storage = cache.pool.layers[index]
        self.lengths = cache.pool.lengths[index]  # [slots + 1] view: each slot's live entries in this layer
        self.appended: torch.Tensor | None = None  # [B] after a step: where each row wrote
        self.heads = torch.arange(self.storage.kv_heads, device=cache.pool.device).view(1, -1)
        # a device scalar: writing a Python float through advanced indexing copies it from the host,
        # which a CUDA graph capture refuses
        self.zero = torch.zeros((), dtype=torch.float32, device=cache.pool.device)
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool is allocated already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [B, kv_heads, 1, d] (keys un-rotated): written at each row's slot."""
        step, storage = self.step, self.storage
        rows, rope = step.rows, step.rope
        # the layer's own views, never `step.pool.lengths[self.index]`: a compiled step's layers share one
        # compilation only if nothing they read is picked by a Python integer (kvpot.attention.LayerView)
        lengths = self.lengths
        index = lengths[rows]  # [B]: the new entry's place in its slot
        keys = rope.unscale(key_states)
        rotated = step.policy.stores_rotated  # absolute: rotated once, at the token's stream position; rank
        if rotated:  # policies number entries 0..n-1, so the new entry's RoPE position is its index
            keys = rope.rotate(keys, step.stream_positions.view(-1, 1, 1).expand(-1, storage.kv_heads, 1),
                               step.max_position)
        # keys, values, both positions, the query position and the count: one launch where Triton runs
        append_kernel(keys.device)(storage.keys, storage.values, storage.positions, storage.rope_positions,
                                   storage.query_position, lengths, rows, index, keys[:, :, 0], value_states[:, :, 0],
                                   step.stream_positions, rotated)
        fresh = [score for name, score in storage.scores.items() if name not in step.written]
        if fresh:  # a new entry starts at zero, unless the method's `batch_append` writes it (`batch_scores`)
            at = (rows[:, None], self.heads, index[:, None])  # [B, kv_heads] each
            for score in fresh:
                score[at] = self.zero
        step.policy.decode_positions(storage.positions, storage.rope_positions, storage.query_position, rows, index)
        self.appended = index
        return storage.keys, storage.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.storage.capacity + query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    """The cache a batched step hands the model; the kvpot attention function calls `attend`."""

    batched = True

    def __init__(self, pool: SlotPool):
        self.pool, self.rope, self.policy = pool, pool.rope, pool.policy
        self.rows: torch.Tensor | None = None  # [B] long: each row's slot
        self.stream_positions: torch.Tensor | None = None  # [B] long: each token's position in its stream
        self.max_position = 0  # host bound of every stream position (sizes RoPE tables without a sync)
        self.request: AttentionRequest | None = None
        self.groups: tuple | None = None  # shared documents' readers grouped for this step (`_attend_shared`)
        self.split_entries: int | None = None  # the decode kernel's fixed split size (`Engine(batch_invariant=True)`)
        self.written: frozenset[str] = frozenset()  # scores the method writes at each new entry (`batch_scores`)
        super().__init__(layers=[StepLayer(self, i) for i in range(pool.num_layers)])

    @property
    def appended(self) -> list[torch.Tensor | None]:
        """Per layer [B]: where each row wrote in the last step."""
        return [layer.appended for layer in self.layers]

    @property
    def is_compileable(self) -> bool:
        return False

    def attend(self, layer: StepLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Attention of each row's token over its slot in `layer`: query [B, heads, 1, d] un-rotated -> [B, 1, heads, d]."""
        storage, rope = layer.storage, self.rope
        b, heads, _, d = query.shape
        query = rope.unscale(query)
        probs = storage.observation_buffer()[:b] if self.request is not None else None
        region = self.pool.documents
        if region is not None and not region.joined:  # readers of shared documents: two segments, merged
            return self._attend_shared(layer, query, scaling, probs).view(b, 1, heads, d)
        # a joined region's readers: each entry from the document or the slot, in the copied reader's sums
        kernel, lengths, documents = batch_kernel(query.device, d), layer.lengths, layer.joined
        if self.policy.stores_rotated:
            turned = rope.rotate(query, self.stream_positions.view(-1, 1, 1).expand(-1, storage.kv_heads, 1),
                                 self.max_position)
            out = kernel(turned[:, :, 0], storage.keys, storage.values, self.rows, lengths, scaling, probs=probs,
                         split_entries=self.split_entries, documents=documents)
        else:
            cos, sin = rope.table(storage.capacity + 1, query)
            out = kernel(query[:, :, 0], storage.keys, storage.values, self.rows, lengths, scaling, cos=cos, sin=sin,
                         key_positions=storage.rope_positions, query_positions=storage.query_position, probs=probs,
                         split_entries=self.split_entries, documents=documents)
        return out.view(b, 1, heads, d)

    def _attend_shared(self, layer: StepLayer, query: torch.Tensor, scaling: float, probs) -> torch.Tensor:
        """`attend` over each row's shared document and its slot's tail, merged by log-sum-exp (on a GPU the
        cascade kernel `kvpot.kernels.shared`, else its reference `kvpot.kernels.shared_reference`)."""
        from kvpot import kernels

        storage, rope = layer.storage, self.rope
        doc_keys, doc_values, doc_positions, doc_lengths, of_slot = layer.documents
        rotated = self.pool.documents.rotated  # the region's keys are stored rotated (kvpot.engine.documents)
        if kernels.available(query.device) and kernels.supports_head_dim(query.shape[-1]) and probs is None:
            from kvpot.kernels.shared import decode_attention_shared, shared_groups

            if self.groups is None:  # the first layer of the step: the same rows and documents for every layer
                self.groups = shared_groups(self.rows, of_slot, doc_keys.shape[0])
            kernel = functools.partial(decode_attention_shared, groups=self.groups)
        else:  # (with an observation, the reference writes it)
            from kvpot.kernels.shared_reference import decode_attention_shared_reference as kernel
        documents = (doc_keys, doc_values, of_slot, doc_lengths)
        if self.policy.stores_rotated:
            turned = rope.rotate(query, self.stream_positions.view(-1, 1, 1).expand(-1, storage.kv_heads, 1),
                                 self.max_position)
            return kernel(turned[:, :, 0], storage.keys, storage.values, self.rows, layer.lengths, *documents, scaling,
                          probs=probs)
        cos, sin = rope.table(storage.capacity + 1, query)
        return kernel(query[:, :, 0], storage.keys, storage.values, self.rows, layer.lengths, *documents, scaling,
                      cos=cos, sin=sin, key_positions=storage.rope_positions, doc_key_positions=doc_positions,
                      query_positions=storage.query_position, probs=probs, doc_rotated=rotated)


def append_kernel(device: torch.device):
    """The batched step's cache append: the Triton kernel where it runs, else its PyTorch reference."""
    from kvpot import kernels

    if kernels.available(device):
        from kvpot.kernels.append import append_rows

        return append_rows
    from kvpot.kernels.append_reference import append_rows_reference

    return append_rows_reference


def batch_kernel(device: torch.device, head_dim: int):
    """The batched Triton decode kernel where it runs, else its PyTorch reference (same arguments)."""
    from kvpot import kernels

    if kernels.available(device) and kernels.supports_head_dim(head_dim):
        from kvpot.kernels.decode import decode_attention_batch

        return decode_attention_batch
    from kvpot.kernels.decode_reference import decode_attention_batch_reference

    return decode_attention_batch_reference
