"""The device side of the packed mixed step (`kvpot.engine.packed`): its cache and cache layers, which the model's
attention calls, the per-step inputs laid out in one buffer (`Meta`), and the kernels they run (the varlen attention
and the packed observation, or their PyTorch references off a GPU). docs/design.md, *The batched step*.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

ROWS = 8  # chunks a packed step reads at most (a 1,024-token budget takes a few)


class StepForwardLayer(CacheLayerMixin):
    """A cache layer of one batched forward over pool slots (the packed step's, the eager mixed step's): its storage
    exists already, and the kvpot attention function masks for itself (nothing for transformers to size)."""

    is_compileable = False
    is_sliding = False

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool is allocated already
        pass

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class PackedLayer(StepForwardLayer):
    """One layer of a packed step: the decoding rows' tokens to their slots (`StepLayer`), every chunk token to
    its slot in one indexed write."""

    def __init__(self, cache: PackedCache, index: int):
        super().__init__()
        self.packed, self.index = cache, index
        self.step_layer = cache.step.layers[index]
        self.storage = self.step_layer.storage
        self.cached: torch.Tensor | None = None  # [ROWS]: each row's entries before this forward (set by update)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [1, kv_heads, B + T, d], un-rotated: the rows' tokens, then the chunks' packed."""
        b = self.packed.batch
        if b:
            self.step_layer.update(as_rows(key_states[:, :, :b]), as_rows(value_states[:, :, :b]))
        self._write_chunks(key_states[:, :, b:], value_states[:, :, b:])
        return key_states, value_states

    @torch.compiler.disable  # eager inside a compiled layer, as `PackedCache._attend_chunks` (why there)
    def _write_chunks(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The packed chunk tokens' keys and values [1, kv_heads, T, d] into their slots, one indexed write each."""
        cache, storage, meta = self.packed, self.storage, self.packed.meta
        t = cache.tokens
        cached = meta.cached[self.index]  # [ROWS + 1]: the last is the padding tokens' row, 0
        self.cached = cached[:ROWS]
        index = cached[meta.token_row[:t]] + meta.offset[:t]  # [T]: each token's entry in its slot
        position, rope = meta.position[:t], cache.step.rope
        keys = rope.unscale(key_states)  # [1, kv, T, d]
        if cache.rotated:
            keys = rope.rotate(keys, position.view(1, 1, -1).expand(1, storage.kv_heads, -1), cache.max_position)
        at = (meta.slot[:t], slice(None), index)
        storage.keys[at] = keys[0].transpose(0, 1)
        storage.values[at] = value_states[0].transpose(0, 1)
        storage.positions[at] = position[:, None].expand(-1, storage.kv_heads)
        storage.rope_positions[at] = (position if cache.rotated else index)[:, None].expand(-1, storage.kv_heads)
        for score in storage.scores.values():
            score[at] = self.step_layer.zero


class PackedCache(Cache):
    """The cache a packed step hands the model; the kvpot attention function calls `attend`."""

    batched = True

    def __init__(self, step, meta: Meta):
        self.step, self.meta = step, meta
        self.batch, self.tokens, self.observes = 0, 0, False
        self.rotated = step.policy.stores_rotated
        self.max_position = 0
        self.observed: torch.Tensor | None = None  # [layers, observing rows, kv_heads, capacity] float32
        self.row_keys: torch.Tensor | None = None  # [ROWS, kv_heads, capacity, d]: keys rotated ahead (ROTATE_AHEAD)
        super().__init__(layers=[PackedLayer(self, i) for i in range(len(step.layers))])

    @property
    def is_compileable(self) -> bool:  # transformers' API
        return False

    def attend(self, layer: PackedLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """query [1, heads, B + T, d] un-rotated -> [1, B + T, heads, d]."""
        b, rows = self.batch, None
        if b:
            rows = self.step.attend(layer.step_layer, as_rows(query[:, :, :b]), scaling)  # [B, 1, heads, d]
            rows = rows.reshape(1, b, *rows.shape[2:])
        # a statement of its own: where a compiled layer breaks its graph at this call, nothing may be on the stack
        # (the former `outputs.append(...)` put a new bound method there, so the frame recompiled at every call)
        chunks = self._attend_chunks(layer, query[:, :, b:], scaling)
        chunks = chunks.unsqueeze(0)
        return chunks if rows is None else torch.cat([rows, chunks], dim=1)

    # Run eagerly inside a compiled layer (`kvpot.engine.packed.COMPILED`): inductor's post-grad pass failed on these
    # Triton launches with InfiniPot's observation (an H200, torch 2.11: an AssertionError in the pattern matcher's
    # replacement of a functionalized kernel call), and there is nothing here for it to fuse
    @torch.compiler.disable
    def _attend_chunks(self, layer: PackedLayer, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The packed chunk tokens' attention (query [1, heads, T, d] un-rotated) -> [T, heads, d], and their
        observations where the step observes."""
        meta, storage, rope = self.meta, layer.storage, self.step.rope
        query = rope.unscale(query)
        if self.rotated:  # each token's query turns at its stream position, as its key did
            query = rope.rotate(query, meta.position[: self.tokens].view(1, 1, -1).expand(1, storage.kv_heads, -1),
                                self.max_position)
            tables = (None, None, None)
        else:  # rotated on load from the entries' RoPE positions (a token's query at its own entry's)
            tables = (*rope.table(storage.capacity + 1, query), storage.rope_positions)
        ahead = {}
        if self.row_keys is not None and tables[0] is not None:  # each row's keys rotated once (ROTATE_AHEAD)
            from kvpot.kernels.varlen import rotate_rows

            rotate_rows(storage.keys, storage.rope_positions, tables[0], tables[1], meta.row_slot, meta.starts,
                        layer.cached, self.row_keys, **chunk_documents(layer.step_layer))
            ahead = {"row_keys": self.row_keys}
        packed = query[0].transpose(0, 1)  # [T, heads, d]
        out, lse = varlen_kernel(query.device, query.shape[-1])(
            packed, storage.keys, storage.values, meta.row_slot, meta.starts, layer.cached, scaling, self.tokens,
            *tables, **ahead, **chunk_documents(layer.step_layer))
        if self.observes:
            observe_kernel(query.device, query.shape[-1])(
                packed, storage.keys, meta.row_slot, meta.starts, layer.cached, meta.row0, meta.count, meta.mean,
                scaling, self.observed[layer.index], lse, *tables, **ahead)
        return out


def chunk_documents(step_layer) -> dict:
    """The varlen kernel's `document` argument where the pool shares documents (`kvpot.engine.documents`): a
    reader's chunk (its question) attends the document's entries in the region, the rest in its slot. Rows of
    slots reading none are unchanged by it."""
    if step_layer.documents is None:
        return {}
    doc_keys, doc_values, _, doc_lengths, of_slot = step_layer.documents
    return {"document": (doc_keys, doc_values, of_slot, doc_lengths)}


def varlen_kernel(device: torch.device, head_dim: int):
    """The varlen Triton kernel where it runs, else its PyTorch reference (one signature but `max_tokens`)."""
    from kvpot import kernels

    if kernels.available(device) and kernels.supports_head_dim(head_dim):
        from kvpot.kernels.varlen import varlen_attention

        return varlen_attention
    from kvpot.kernels.varlen_reference import varlen_attention_reference

    return lambda *args, **kwargs: varlen_attention_reference(*args[:7], *args[8:], **kwargs)  # no bucket there


def as_rows(states: torch.Tensor) -> torch.Tensor:
    """[1, heads, B, d] -> [B, heads, 1, d]: packed tokens as the batched step's rows."""
    return states[0].transpose(0, 1).unsqueeze(2).contiguous()


def observe_kernel(device: torch.device, head_dim: int):
    """The packed observation's Triton kernel where it runs, else its PyTorch reference (same arguments)."""
    from kvpot import kernels

    if kernels.available(device) and kernels.supports_head_dim(head_dim):
        from kvpot.kernels.observe import observe_varlen

        return observe_varlen
    from kvpot.kernels.observe_reference import observe_varlen_reference

    return observe_varlen_reference


class Meta:
    """A packed step's device-side inputs: one int64 buffer, uploaded once a step, viewed per field."""

    FIELDS = ("ids", "slot", "offset", "token_row", "position")  # per token

    def __init__(self, tokens: int, layers: int, device: torch.device):
        self.tokens, self.layers = tokens, layers
        size = 5 * tokens + 5 * ROWS + 1 + layers * (ROWS + 1)
        self.buffer = torch.zeros(size, dtype=torch.long, device=device)
        views, at = {}, 0
        for name in self.FIELDS:
            views[name], at = self.buffer[at : at + tokens], at + tokens
        for name, length in (("row_slot", ROWS), ("starts", ROWS + 1), ("row0", ROWS), ("count", ROWS),
                             ("mean", ROWS)):
            views[name], at = self.buffer[at : at + length], at + length
        views["cached"] = self.buffer[at:].view(layers, ROWS + 1)
        self.__dict__.update(views)

    def host(self) -> Meta:
        """A CPU twin laid out as this one, with the same views: filled by the caller, then copied to `buffer`."""
        like = Meta.__new__(Meta)
        like.tokens, like.layers = self.tokens, self.layers
        like.buffer = torch.zeros_like(self.buffer, device="cpu")
        offset = self.buffer.data_ptr()
        for name, view in list(self.__dict__.items()):
            if name in ("tokens", "layers", "buffer"):
                continue
            start = (view.data_ptr() - offset) // view.element_size()
            like.__dict__[name] = like.buffer[start : start + view.numel()].view(view.shape)
        return like
