"""Stored documents shared by their readers: one read-only copy in the pool, each reader's slot holding its tail.

`Scheduler(share_documents=True)` (docs/design.md, *Shared documents*). A `State` asked by several requests is
loaded once into a row of the pool's document region (`[documents, kv_heads, capacity, d]` per layer, the slots'
layout); each reader's slot keeps the indices it has when copied per reader, so entries `[0, n_doc)` are the
document's, read from the region, and what the reader appends lands at `[n_doc, ...)` of its own slot. The slot
holds a private copy of the document's positions and scores (a method's per-entry statistics are the reader's
own: H2O accumulates over the document too), never its keys and values.

A reader copies on write: before a step that would change the document's keys or values in place or read them
through the one-sequence engine (an eviction, a distillation, a question read in its own forward, a policy that
renumbers rotated entries while decoding), `copy_out` writes the document's keys and values into the reader's slot
and the row goes on exactly as a copied reader does. Each method states when that happens
(`Method.copies_document`).

Reference counting: a document's readers are the slots that read it; when the last one ends (or copies), the
document stays loaded but its row may be reused: the least recently used document without readers leaves when a
new one needs a row (an LRU bounded by the region's rows, so by its bytes, `nbytes`).
"""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch

# Why a reader copies (the report's `copy_on_write_<reason>` counts):
# question: its question is read in a forward of its own (not fed through the batched steps);
# eager, steady: its method reshapes or evicts at this step; positions: the policy renumbers entries while
# decoding (Self-Extend's window); attention: the method attends for itself (InfLLM, InfiniteHiP);
# full: every document row holds a document with readers, so this reader is copied at admission.
REASONS = ("question", "eager", "steady", "positions", "attention", "full")


@dataclass(eq=False)
class Document:
    row: int
    state: weakref.ref  # the State read: not kept alive by the region (a server's store may let it go)
    lengths: list[int]
    readers: set[int] = field(default_factory=set)


class DocumentRegion:
    """`rows` documents' keys, values and RoPE positions beside `pool`'s slots, counted once in its bytes."""

    def __init__(self, pool, rows: int, joined: bool = False):
        self.pool, self.rows = pool, rows
        like = pool.layers[0]
        # joined (batch-invariant decoding): each reader attends its document and its tail as one sequence, through
        # the decode kernel at its fixed splits, and reads its question in a forward of its own over the same entries
        # (`join`): its sums are then a copied reader's, bit for bit, and the document is read once per reader
        self.joined = joined
        # Keys stored rotated at their positions: a document is loaded once and read at every step by every
        # reader, so it is rotated once here rather than at each read (kvpot.kernels.shared: the document segment
        # then loads no RoPE table). A policy that stores keys rotated already needs nothing; a RoPE without a
        # fixed table (dynamic) is never batched with per-entry positions. Joined, they are stored as a slot keeps
        # them, so that the kernel loads and rotates each entry as it would a copy's.
        self.rotated = not joined and not pool.policy.stores_rotated and not pool.rope.dynamic
        shape = (rows, like.kv_heads, pool.capacity)
        self.keys = [torch.zeros(*shape, like.head_dim, dtype=like.dtype, device=pool.device) for _ in pool.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.rope_positions = [torch.zeros(shape, dtype=torch.long, device=pool.device) for _ in pool.layers]
        self.lengths = torch.zeros(pool.num_layers, rows, dtype=torch.long, device=pool.device)
        self.of_slot = torch.full((pool.rows,), -1, dtype=torch.long, device=pool.device)  # -1: no document
        self.loaded: OrderedDict[int, Document] = OrderedDict()  # id(state) -> document, least recent first
        self.reading: dict[int, Document] = {}  # slot -> the document it reads
        self.copies: Counter = Counter()  # reason -> readers that copied for it
        self.loads = 0
        self.tail_readers = 0  # readers admitted holding only their tail's lanes (`reader_lanes`)
        self.owner = None  # the scheduler, whose `report` is kept current (`metrics`) at every change

    # ------------------------------------------------------------------ readers
    def attach(self, slot: int, state) -> bool:
        """Slot `slot` reads `state`'s document from the region (loaded now unless it is already); False
        when every row holds a document that has readers (the caller copies the state into the slot)."""
        document = self.loaded.get(id(state))
        if document is not None and document.state() is not state:
            # its State is gone (every reader holds the one it reads, so it had none) and this one took its
            # identity: the row is free again
            del self.loaded[id(state)]
            document = None
        if document is None:
            document = self._load(state)
            if document is None:
                return False
        self.loaded.move_to_end(id(state))
        document.readers.add(slot)
        self.reading[slot] = document
        lanes = self.pool.lanes
        self.tail_readers += lanes is not None and lanes.held.get(slot, (0,))[0] > 0
        self.of_slot[slot] = document.row
        self._changed()
        return True

    def can_attach(self, state) -> bool:
        """Whether `attach` would find `state`'s document a row now (loaded, or a row free or idle)."""
        document = self.loaded.get(id(state))
        if document is not None and document.state() is state:
            return True
        return len(self.loaded) < self.rows or any(not d.readers for d in self.loaded.values())

    def shares(self, slot: int) -> bool:
        return slot in self.reading

    def join(self, slot: int, cache) -> None:
        """Hand the slot's cache layers their document's rows (`SlotLayer.document`): a forward over the slot then
        attends the document's entries and the slot's own as one sequence, as over a copy (joined regions)."""
        document = self.reading[slot]
        for i, layer in enumerate(cache.layers):
            layer.document = (self.keys[i][document.row], self.values[i][document.row], document.lengths[i])

    def detach(self, slot: int) -> None:
        """The slot reads its document no more (it ended, or copied); the document stays loaded."""
        document = self.reading.pop(slot, None)
        if document is not None:
            document.readers.discard(slot)
            self.of_slot[slot] = -1
            for layer in getattr(self.pool.caches.get(slot), "layers", ()):
                layer.document = None
            self._changed()

    def copy_out(self, slot: int, reason: str) -> None:
        """Copy on write: the document's keys and values into the slot's own row, which then reads only itself.
        The keys come from the stored state (as the slot keeps them: not rotated, where the region's are)."""
        document = self.reading[slot]
        state = document.state()
        if state is None:  # (its readers hold it: a reader without it is a bug, not a user's error)
            raise RuntimeError("a shared document's state is gone while a reader reads it")
        self.pool.widen(slot)  # (a tail slot holds its tail's lanes only: `kvpot.engine.pool`)
        for layer, source, n in zip(self.pool.layers, state.cache.layers, document.lengths):
            if n:
                layer.keys[slot, :, :n] = source.keys[0, :, :n].to(self.pool.device)
                layer.values[slot, :, :n] = source.values[0, :, :n].to(self.pool.device)
        self.copied(reason)
        self.detach(slot)

    def copied(self, reason: str) -> None:
        """A reader took (or was given at admission) its own copy of the document, for `reason` (`REASONS`)."""
        self.copies[reason] += 1
        self._changed()

    # ------------------------------------------------------------------ documents
    def _load(self, state) -> Document | None:
        used = {d.row for d in self.loaded.values()}
        free = [row for row in range(self.rows) if row not in used]
        if not free:  # the least recently used document nobody reads leaves
            idle = next((key for key, d in self.loaded.items() if not d.readers), None)
            if idle is None:
                return None
            free = [self.loaded.pop(idle).row]
        row, lengths = free[0], []
        for i, source in enumerate(state.cache.layers):
            n = source.n
            if n:
                keys = source.keys[0, :, :n].to(self.pool.device)
                positions = source.rope_positions[0, :, :n].to(self.pool.device)
                self.keys[i][row, :, :n] = self._rotate(keys, positions, source.max_rope) if self.rotated else keys
                self.values[i][row, :, :n] = source.values[0, :, :n].to(self.pool.device)
                self.rope_positions[i][row, :, :n] = source.rope_positions[0, :, :n].to(self.pool.device)
            lengths.append(n)
        self.lengths[:, row] = torch.tensor(lengths, dtype=torch.long).to(self.pool.device)
        document = self.loaded[id(state)] = Document(row, weakref.ref(state), lengths)
        self.loads += 1
        return document

    def _rotate(self, keys: torch.Tensor, positions: torch.Tensor, max_rope: int) -> torch.Tensor:
        """keys [kv, n, d] rotated at `positions` [kv, n] in float32 with the table the decode kernels index, then
        stored in the keys' dtype: what the kernels compute when they rotate a key on load."""
        from kvpot.kernels.decode_reference import _rotate_at

        # (the positions' maximum: read once per load, outside any captured step)
        cos, sin = self.pool.rope.table(max(max_rope, int(positions.max())) + 1, keys)
        return _rotate_at(keys.float(), cos.float(), sin.float(), positions.long()).to(keys.dtype)

    @property
    def readers(self) -> int:
        return len(self.reading)

    @property
    def documents(self) -> int:
        return len(self.loaded)

    @property
    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *self.rope_positions, self.lengths, self.of_slot)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _changed(self) -> None:
        if self.owner is not None:  # (its report dict may be replaced: `kvpot bench` zeroes it after a warm-up)
            self.owner.report.update(self.metrics())

    def metrics(self) -> dict:
        """Loaded documents, their readers now, readers admitted in tail slots, and copy-on-write events by reason
        (the scheduler's report)."""
        out = {"shared_documents": self.documents, "shared_readers": self.readers, "document_loads": self.loads,
               "tail_slot_readers": self.tail_readers, "copy_on_write": sum(self.copies.values())}
        out.update({f"copy_on_write_{reason}": self.copies[reason] for reason in REASONS})
        return out


# ---------------------------------------------------------------------- the scheduler's side
def share_region(scheduler, share: bool, rows: int) -> DocumentRegion | None:
    """The document region of `Scheduler(share_documents=True)`, `rows` documents; None when not sharing."""
    from kvpot.errors import KvpotError

    if not share:
        return None
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise KvpotError(f"documents (stored documents loaded at once) must be a positive integer, got {rows!r}.")
    if scheduler.engine.parallel is not None:
        raise KvpotError("share_documents does not run under tensor parallelism yet.")
    region = DocumentRegion(scheduler.pool, rows, joined=scheduler.engine.batch_invariant)
    region.owner = scheduler
    for i, layer in enumerate(scheduler.decoder.cache.layers):  # each step layer reads its own views
        layer.documents = (region.keys[i], region.values[i], region.rope_positions[i], region.lengths[i],
                           region.of_slot)
        if region.joined:  # the decode kernel's order; positions only where the slots rotate keys on load
            positions = None if scheduler.pool.policy.stores_rotated else region.rope_positions[i]
            layer.joined = (region.keys[i], region.values[i], positions, region.of_slot, region.lengths[i])
    region._changed()
    return region


def load_state(scheduler, slot: int, state, question: torch.Tensor) -> tuple:
    """(slot `slot`'s cache for a request that continues `state`, whether its question is read as a chunk over the
    shared document): a reader of the shared document where its question is fed through the batched steps or read
    as a chunk of the mixed step (`question_chunk`), so nothing reads the slot's first keys; else a copy."""
    pool, region = scheduler.pool, scheduler.pool.documents
    if region is None:  # (every load deferred: the scheduler flushes the step's admissions at once)
        return pool.load(slot, state.cache, defer=True), False
    fed = feeds(scheduler, state, question.numel())
    chunk = question_chunk(scheduler, state, question.numel())
    apart = question_apart(scheduler, state, question.numel())
    if not fed and not chunk and not apart:
        region.copied("question")
        return pool.load(slot, state.cache, defer=True), False
    if not region.attach(slot, state):
        region.copied("full")
        return pool.load(slot, state.cache, defer=True), False
    cache = pool.load(slot, state.cache, keys=False, defer=True)
    if region.joined:
        region.join(slot, cache)
    return cache, chunk


def feeds(scheduler, state, tokens: int) -> bool:
    """Whether a reader's question of `tokens` tokens may be fed through the batched steps, a token a step."""
    method = scheduler.method
    return (method.feeds_question and scheduler.batched and scheduler.feed_questions != "never"
            and 0 < tokens <= scheduler.feed_tokens and state.last_logits is not None
            and state.cache.attention is None and not state.cache.host_storage)


def question_chunk(scheduler, state, tokens: int) -> bool:
    """Whether a reader's question is read as one chunk of the mixed step over the shared document (attended in
    the region by the varlen kernel), rather than fed a token a step: mixing is on, `feed_questions` is not
    "always", the whole question is one chunk, and the method's read only appends (`_read_appends`). The region's
    keys must be what the kernel reads: stored rotated."""
    region, pool = scheduler.pool.documents, scheduler.pool
    return (region is not None and bool(scheduler.mix) and scheduler.feed_questions != "always"
            and 0 < tokens <= min(scheduler.prefill_tokens, scheduler.chunk_cap or tokens)
            and (region.rotated or pool.policy.stores_rotated) and not pool.policy.raw_keys
            and _read_appends(scheduler, state.cache, tokens))


def question_apart(scheduler, state, tokens: int) -> bool:
    """Whether a reader's question (any length, or none) may be read in a forward of its own over the shared
    document without copying it: the region is joined (batch-invariant decoding reads questions so, `join`) and the
    method's reading it only appends."""
    region = scheduler.pool.documents
    return region is not None and region.joined and _read_appends(scheduler, state.cache, tokens)


def _read_appends(scheduler, cache, tokens: int) -> bool:
    """Whether the batched engine's read of `tokens` over a reader's cache only appends to it: no attention of the
    method's own, no host storage, not a fixed-shape cache, no hook before the forward (as `mixed.mixable`), and the
    method's chunk appends (`Method.chunk_appends`: no tail probe, nothing compressed after it)."""
    from kvpot.methods.base import Method

    return (scheduler.batched and cache.attention is None and not cache.host_storage and not cache.static
            and type(scheduler.method).before_forward is Method.before_forward
            and scheduler.method.chunk_appends(cache, tokens))


def copy_reason(scheduler, cache, plan: str) -> str | None:
    """Why a reader of a shared document must copy it before this step (None: the step appends alone)."""
    from kvpot.positions import PositionPolicy

    if cache.attention is not None:
        return "attention"
    if plan != "append":
        return plan  # "eager" (a distillation, a chunk eviction) or "steady" (evicts after the append)
    if type(scheduler.pool.policy).decode_positions is not PositionPolicy.decode_positions:
        return "positions"
    return None


def copy_before_step(scheduler, rows, plans: dict[int, str]) -> None:
    """Copy on write for the step's decoding `rows` (slot, active) whose plan changes their entries."""
    region = scheduler.pool.documents
    if region is None:
        return
    for slot, active in rows:
        if region.shares(slot):
            reason = copy_reason(scheduler, active.run.cache, plans[slot])
            if reason is not None:
                region.copy_out(slot, reason)


def shares(pool, slot: int) -> bool:
    """Whether pool slot `slot` reads a shared document now."""
    return pool.documents is not None and pool.documents.shares(slot)


def unshare(scheduler, slot: int, reason: str) -> None:
    """Copy on write now, if the slot reads a shared document (its question is read in a forward after all), unless
    the region is joined (the forward reads the document where it is: `question_apart`)."""
    region = scheduler.pool.documents
    if region is not None and region.shares(slot) and not (reason == "question" and region.joined):
        region.copy_out(slot, reason)


def reader_lanes(scheduler, request) -> tuple[int, int | None]:
    """The lanes of its slot a request needs, `[lo, hi)` (hi None: the whole slot). With tail slots
    (`Scheduler(reader_room=...)`, `kvpot.engine.pool`), a reader that reads its document from the region to its
    end needs only its tail: `[n_doc, n_doc + question + new tokens)`. That is one whose question is fed, read as a
    chunk over the region, or read apart over a joined region (`load_state`), whose document gets a row, and whose
    method never changes the document's entries within that many tokens (`copies_document` "never", or its pot does
    not fill: `Method.chunk_appends`). Any other request holds its whole slot."""
    pool, state = scheduler.pool, request.state
    if pool.lanes is None or state is None or pool.documents is None:
        return 0, None
    question = 0 if request.question_ids is None else torch.as_tensor(request.question_ids).numel()
    own = question + request.max_new_tokens
    method, cache = scheduler.method, state.cache
    fed = feeds(scheduler, state, question) and request.max_new_tokens > 0
    read = fed or question_chunk(scheduler, state, question) or question_apart(scheduler, state, question)
    if not read or not pool.documents.can_attach(state):
        return 0, None
    if copy_reason(scheduler, cache, "append") is not None:
        return 0, None
    if method.copies_document != "never" and not method.chunk_appends(cache, own):
        return 0, None
    counts = [layer.n for layer in cache.layers]
    return min(counts), max(counts) + own


def reader_stride(room: int | None, share: bool) -> int | None:
    """The pool's slot stride for `Scheduler(reader_room=room)`: None (slots apart) unless sharing documents (the pool
    keeps slots apart too where tails gain nothing: `kvpot.engine.slot_sizes.tail_stride`)."""
    from kvpot.errors import KvpotError

    if room is None:
        return None
    if isinstance(room, bool) or not isinstance(room, int) or room < 1:
        raise KvpotError(f"reader_room (KV entries a shared document's reader holds of its own) must be a positive "
                         f"integer, got {room!r}.")
    if not share:
        raise KvpotError("reader_room sizes the slots of a shared document's readers; it needs share_documents=True.")
    return room
