"""A prompt read into a run's cache one forward at a time, as the method cuts it (`Method.next_chunk`).

`PromptReader` says what the next forward reads before it runs (`peek`: its token ids and its `Step`)
and moves on once it ran (`advance`). The engine's own loop (`Engine._read`) runs each forward alone;
the batched scheduler may instead run the forwards of several prompts, and the decoding rows, in one
model forward (`kvpot.engine.mixed`). Either way the chunks are the method's: a forward is capped at
`run.max_chunk` only where the method is not `chunk_dependent`.
"""

from __future__ import annotations

import time

import torch

from kvpot.engine.documents import load_state, unshare
from kvpot.engine.mixed import mixable
from kvpot.engine.results import _Run
from kvpot.engine.sampling import _as_ids
from kvpot.errors import KvpotError
from kvpot.methods.base import Step


class PromptReader:
    """The segments (context, question) of one run, read in the method's chunks."""

    def __init__(self, method, run: _Run, segments: list[tuple[str, torch.Tensor]]):
        self.method, self.run = method, run
        self.segments = [(phase, ids) for phase, ids in segments if ids.numel()]
        self.index, self.offset = 0, 0
        self.pending: tuple[torch.Tensor, Step] | None = None

    @property
    def done(self) -> bool:
        return self.index >= len(self.segments)

    @property
    def remaining(self) -> int:
        """Prompt tokens not read yet (`Scheduler(prompt_order="shortest")` reads the fewest first)."""
        return sum(ids.numel() for _, ids in self.segments[self.index:]) - self.offset

    def peek(self) -> tuple[torch.Tensor, Step] | None:
        """The next forward's token ids [q] and step, or None once the prompt is read."""
        if self.pending is None and not self.done:
            phase, ids = self.segments[self.index]
            total = ids.numel()
            size = self.method.next_chunk(self.run.cache, total - self.offset)
            if self.run.max_chunk is not None and not self.method.chunk_dependent:
                size = min(size, max(1, self.run.max_chunk))
            if size <= 0:
                raise KvpotError(f"{self.method.name} has no room for the next tokens; check its sizes.")
            end = self.offset + size == total
            last = self.index == len(self.segments) - 1
            step = Step(phase, size, prompt_end=last and end, segment_end=end)
            self.pending = (ids[self.offset : self.offset + size], step)
        return self.pending

    def cut(self, limit: int) -> tuple[torch.Tensor, Step]:
        """The next forward peeked again, capped at `limit` tokens (a plan cut it to fill a step's budget; only
        for a method that is not `chunk_dependent`, whose result no cut changes)."""
        if self.method.chunk_dependent:
            raise KvpotError(f"{self.method.name}'s chunks depend on where its forwards end: they are never cut.")
        self.pending, self.run.max_chunk = None, limit
        return self.peek()

    def advance(self) -> int:
        """The peeked forward ran: move past it; returns its tokens."""
        ids, step = self.pending
        self.pending = None
        self.offset += step.n_new
        if step.segment_end:
            self.index, self.offset = self.index + 1, 0
        return ids.numel()


def begin_read(scheduler, active) -> None:
    """Start reading a request's prompt into its slot, just admitted (`Scheduler`; nothing is read until a step reads
    its chunks): a `PromptReader` over its context and question, or over its question after a stored state loaded in
    the slot; or the question is fed through the decoding steps, a token a step (`feeds_question`)."""
    engine, request, slot = scheduler.engine, active.request, active.request.slot
    if request.state is None:
        run, segments = engine._start(request.context_ids, request.question_ids,
                                      lambda _tokens: scheduler.pool.cache(slot))
    else:
        question = _as_ids(request.question_ids, engine.device, "question_ids")
        cache, chunked = load_state(scheduler, slot, request.state, question)  # chunked: read over the region
        run = engine._resumed(request.state, cache, question)
        segments = [("question", question)] if question.numel() else []
        if request.max_new_tokens and feeds_question(scheduler, run, question) and not chunked:
            active.run, active.feeding = run, question.tolist()  # greedy while fed (its picks overwritten)
            scheduler.decoder.start(slot, run.logits, run.next_position, 0.0, 1.0, 0,
                                    question.numel() + request.max_new_tokens)
            active.read_started = time.perf_counter()
            return
        if not chunked:  # read in a forward of its own: the forward reads the slot's keys
            unshare(scheduler, slot, "question")
    active.run, active.reader = run, PromptReader(scheduler.method, run, segments)
    active.read_started = time.perf_counter()


def feeds_question(scheduler, run: _Run, question: torch.Tensor) -> bool:
    """Whether this question is fed through the decoding steps (`Scheduler(feed_questions=...)`)."""
    if scheduler.feed_questions == "never" or not scheduler.method.feeds_question or not scheduler.batched:
        return False
    fits = 0 < question.numel() <= scheduler.feed_tokens and run.logits is not None and run.cache.attention is None
    if not fits or scheduler.feed_questions == "always":
        return fits
    copied = scheduler.pool.documents is None  # sharing documents, a forward of its own would copy the document
    if copied and scheduler.mix and mixable(scheduler.method, run):
        # one chunk of a mixed step beside the decoding rows, not a step a token: 64 readers' 32-token questions
        # fed took 32 of 288 steps, as chunks 8 (TTFT p50 0.64 -> 0.19 s, 3,374 -> 3,665 tok/s, an H100,
        # records/engine-core-h100/evict-inside/); shared readers' questions are chunks already (`question_chunk`)
        return False
    return len(scheduler.active) > 1 or bool(scheduler.waiting) or not copied
