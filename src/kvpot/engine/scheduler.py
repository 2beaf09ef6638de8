"""Many sequences at once: a step-driven scheduler over a slot pool (continuous batching).

A `Request` moves "waiting" (no slot) -> "prefilling" -> "decoding" -> "finished", "cancelled" or "failed".
Callers feed and drain: `submit`, `step`, `cancel`, `abort`. One step (docs/design.md, *The batched engine*):
cancelled requests leave; waiting ones take free slots, first come first served; rows whose method reshapes the
cache at this token step alone, or ride in the mixed forward as one-token chunks; then one forward gives every
other decoding row its token and reads the next chunk of prompts being read beside them, within `prefill_tokens`
(`kvpot.engine.mixed`; which chunks: `kvpot.engine.plan`); prompt chunks that need a forward of their own follow;
the new tokens are delivered at the start of the next step. A request that fails fails alone. Batch-invariant
engines read prompts as alone.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from kvpot.engine.admission import Admission, Place
from kvpot.engine.ahead import ahead_rows, resolve_launch_ahead
from kvpot.engine.agreement import StepAgreement
from kvpot.engine.alone import decode_alone, sequence_steps, step_sequences
from kvpot.engine.batch import BatchDecoder, batchable_request, batches_rows, step_observations
from kvpot.engine.decoding import resolve_mode
from kvpot.engine.delivery import TokenOutbox, hand_over
from kvpot.engine.documents import copy_before_step, reader_lanes, reader_stride, share_region, shares, unshare
from kvpot.engine.evict import evict_steady, mirror_append, steady_capture, steady_form
from kvpot.engine.mixed import (Chunk, capture_mixed, chunk_rows, mixable, mixed_forward, peek_candidate, resolve_mix,
                               tail_tokens)
from kvpot.defaults import (FEED_QUESTIONS, LAUNCH_AHEAD, MIX, PREFILL_TOKENS, PROMPT_ORDER, PROMPT_PATIENCE,
                            SLOT_MEMORY_FRACTION)
from kvpot.engine.plan import check_options, plan_chunks, reading_order
from kvpot.engine.pool import SlotPool
from kvpot.engine.slot_sizes import slot_bytes, slot_capacity, slot_count
from kvpot.engine.reading import begin_read
from kvpot.engine.requests import Active as _Active, QueueFull, Request, check_fits  # noqa: F401
from kvpot.engine.results import close_stats
from kvpot.engine.sampling import _eos_ids, picking, request_seed
from kvpot.engine.trace import NoTrace, StepTrace
from kvpot.errors import KvpotError
from kvpot.positions import make_policy


class Scheduler:
    """Continuous batching of `engine`'s method over a pool of `slots` KV caches.

    slots: sequences decoding at once; None: what `memory_fraction` of free GPU memory holds (<= `max_slots`), 8 on a CPU.
    capacity: KV entries per slot (per layer and KV head); default the method's bound (bounded methods),
        required for methods whose cache grows with the input (Full, SnapKV, D2O, InfiniteHiP).
    question_room: question tokens a slot leaves room for where the method's bound counts them (CItruS).
    max_waiting: requests queued beyond the slots; `submit` raises `QueueFull` past it (None: no limit).
    prefill_tokens: prompt tokens read per step across requests (at least one chunk per step).
    decode: "auto" (CUDA graphs on a GPU, fixed-shape steps uncaptured on a CPU), "graph" or "static".
    feed_questions: how a question of at most `feed_tokens` tokens asked of a stored state is read (`kvpot.defaults`):
        "auto" reads it as a chunk of the mixed forward where prompts mix, else feeds it through the batched decoding
        steps, one token a step, when other requests run or wait; "always" feeds it, "never" reads it in chunks (as
        `Engine.generate` does). Feeding is only for methods whose cache does not depend on how the question is cut.
    mix: read prompt chunks in the decoding rows' forward (`kvpot.engine.mixed`): the same tokens, fewer forwards.
        "auto" (`kvpot.defaults.MIX`, `kvpot.engine.mixed.resolve_mix`): on a CUDA GPU; "on", "off", "eager" or a bool.
    prompt_order: which prompts a step reads first, "arrival" (oldest) or "shortest" (fewest tokens left; `prompt_patience`
        seconds after taking its slot a prompt goes first; `kvpot.defaults.PROMPT_ORDER`, `kvpot.engine.plan.reading_order`).
    launch_ahead: launch a decode-only step before the previous step's tokens are handed over (`kvpot.engine.ahead`):
        "auto" (`kvpot.defaults.LAUNCH_AHEAD`: on a CUDA GPU, not under tensor parallelism), "on", "off" or a bool.
    share_documents: readers of a stored `State` read its keys and values from one copy, copied on write (`documents`
        at once; `kvpot.engine.documents`); a question read as a mixed step's chunk where it only appends, else fed.
    reader_room: tail slots (`kvpot.engine.pool`): a reader that never copies its shared document holds this many entries
        of its own (question, new tokens), not a whole slot; a sequence that does holds `capacity / reader_room` readers'.
    adopt: a spent state's cache whose buffers are the one slot's (`SlotPool(adopt=...)`; `Engine(runner="core")`).
    """

    mix_waits = False  # mixable chunks wait after a mixed forward; off: TTFT p50 4.7 / 3.3 s (engine-core-h100/invariant/)
    rides = True  # mixing, rows whose method reshapes the cache ride in the mixed forward (False: alone; `mix_rule_ab.py`)

    def __init__(self, engine, slots: int | None = None, capacity: int | None = None, question_room: int = 512,
                 max_waiting: int | None = None, prefill_tokens: int = PREFILL_TOKENS, decode: str = "auto",
                 max_slots: int = 256, memory_fraction: float = SLOT_MEMORY_FRACTION, feed_questions: str = FEED_QUESTIONS,
                 feed_tokens: int = 64, mix: bool | str = MIX, share_documents: bool = False, documents: int = 4,
                 reader_room: int | None = None, prompt_order: str = PROMPT_ORDER, prompt_patience: float = PROMPT_PATIENCE,
                 launch_ahead: bool | str = LAUNCH_AHEAD, adopt=None):
        if len(engine.devices) > 1:
            raise KvpotError("batched decoding runs a model on one device; a model split over several GPUs "
                             "(device_map) decodes one sequence at a time with Engine.generate.")
        feed_questions = check_options(prefill_tokens, max_waiting, feed_questions, decode, engine.batch_invariant,
                                       prompt_order, prompt_patience)
        mode = "static" if decode == "auto" and engine.device.type != "cuda" else resolve_mode(decode, engine.device)
        self.engine, self.method = engine, engine.method
        self.capacity = slot_capacity(self.method, capacity, question_room)
        dtype, stride = engine.head.weight.dtype, reader_stride(reader_room, share_documents)
        slots = slot_count(engine, self.capacity, slots, max_slots, memory_fraction, dtype, stride)
        self.pool = SlotPool(engine.model.config, engine.rope, make_policy(engine.method.positions), slots, self.capacity,
                             dtype, engine.device, engine.parallel, stride, adopt=adopt)
        self.agreement = StepAgreement.of(engine)  # tensor parallelism: every rank's step alike (engine/agreement.py)
        self.decoder, self.mode = BatchDecoder(engine, self.pool, graphs=mode == "graph"), mode
        self.max_waiting, self.prefill_tokens, self.prompt_order = max_waiting, prefill_tokens, prompt_order
        self.prompt_patience, self.chunk_cap = prompt_patience, None if engine.batch_invariant else prefill_tokens
        self.admission = Admission(slots, max_waiting)  # the one admission test (kvpot.engine.admission)
        self.places: dict[int, Place] = {}  # request id -> its place, given back when it ends
        self.feed_questions, self.feed_tokens = feed_questions, feed_tokens
        self.waiting, self.active = deque(), {}  # requests without a slot; slot -> its request (`_Active`)
        self.eos = frozenset(_eos_ids(engine.model))
        self.batched = batches_rows(engine, self.pool.policy)
        self.mix = resolve_mix(mix, engine.device, self.pool.layers[0].head_dim, engine.parallel is not None,
                               engine.batch_invariant) and self.batched  # in one forward
        self.decoder.fixed_mix = self.decoder.fixed_mix and mix != "eager"  # captured (`kvpot.engine.packed`) or not
        self.steady_ok = batchable_request(self.method.decode_request("steady"))
        self.sequence_steps = sequence_steps(self)  # a pool of one: rows the batched step cannot take (`row_plan`)
        self.append_ok = batchable_request(self.method.decode_request("append"))
        self.outbox = TokenOutbox()  # the tokens of a step, delivered at the start of the next
        self.launch_ahead = resolve_launch_ahead(launch_ahead, engine.device, engine.parallel is not None)
        self.report = {"steps": 0, "batched_rows": 0, "eager_rows": 0, "sequence_rows": 0, "riding_rows": 0,
                       "steady_rows": 0, "prefill_forwards": 0, "fed_tokens": 0, "mixed_forwards": 0, "forwards": 0,
                       "decode_seconds": 0.0, "prefill_seconds": 0.0, "deliver_seconds": 0.0, "ahead_steps": 0}
        self.pool.documents = share_region(self, share_documents, documents)  # None unless sharing
        self.trace: StepTrace | NoTrace = NoTrace()  # a StepTrace keeps each step's work and gap (engine/trace.py)

    def slot_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes one slot takes (KV, positions, two score arrays, the observation row, its logits)."""
        return slot_bytes(self.engine, self.capacity, dtype, self.pool.stride)

    @torch.no_grad()  # as `step`: a compiled step traced with grad on would need the kernels' backward
    def capture(self) -> int:
        """Capture the decoding step of every batch size and the mixed step of every token bucket now (CUDA graphs;
        nothing on a CPU), as a server does when it starts: otherwise they compile and capture while users wait."""
        inside = self.decoder.evict_inside and not self.sequence_steps  # (a pool of one's steady rows: `row_plan`)
        steady = steady_capture(self.method, self.pool, self.engine.parallel) if inside else None
        steps = self.decoder.capture(step_observations(self.method), steady) if self.batched else 0
        return steps + (capture_mixed(self.decoder, self.method, self.prefill_tokens) if self.mix else 0)

    # ------------------------------------------------------------------ feeding and draining
    def submit(self, request: Request, place: Place | None = None, admitted: bool = False) -> Request:
        """Queue `request`: it takes a place in `admission` (`QueueFull` when the slots and the queue are full),
        unless the caller took one for it already (`place`, a server admitting before it builds the request) or
        admitted it elsewhere (`admitted`: rank 0's under tensor parallelism). The place is given back when the
        request ends. Raises `KvpotError` when it can never run here (too long for a slot, a state read with
        another method); a `place` passed in then stays the caller's."""
        if request.status != "waiting" or request.submitted is not None:
            raise KvpotError("this request was submitted already; make a new Request.")
        check_fits(self.engine, self.capacity, request)
        if place is None and not admitted:
            place = self.admission.take()
        if place is not None:
            self.places[request.id] = place
        request.submitted = time.perf_counter()
        self.waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """Stop `request` at the next step boundary (safe from any thread)."""
        request.cancel_requested = True

    def abort(self, error: Exception | None = None) -> list[Request]:
        """End every request now, between steps (a server stopping, a step that broke): failed with `error`,
        or cancelled without one. Their slots are free at once; returns them."""
        ended: list[Request] = []
        for request in [a.request for a in self.active.values()] + [self.waiting.popleft() for _ in self.waiting.copy()]:
            self._fail(request, error, ended) if error is not None else self._end(request, "cancelled", "cancelled", ended)
        return ended

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active and self.outbox.empty

    @property
    def decoding(self) -> int:
        return sum(1 for a in self.active.values() if a.request.status == "decoding")

    @property
    def prefilling(self) -> int:
        return sum(1 for a in self.active.values() if a.request.status == "prefilling")

    def run(self) -> None:
        """Step until every submitted request is done."""
        while not self.idle:
            self.step()

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[Request]:
        """Advance every request by one step; returns the requests that ended in it."""
        ended: list[Request] = []
        self.agreement.agree(self)  # under tensor parallelism, rank 0's new requests and cancellations
        begun = time.perf_counter()
        ahead = ahead_rows(self) if self.launch_ahead else None
        if ahead is not None:
            return self._step_ahead(*ahead, ended, begun)
        self._deliver(ended)  # the previous step's tokens: the device ran ahead while the host came back here
        self.trace.begin(self.report, delivered := time.perf_counter(), self.active)
        self._drop_cancelled(ended)
        self._admit(ended)
        batch, stepped, rides = decode_alone(self, ended)  # rows that step alone (kvpot.engine.alone)
        chunks, budget = self._chunks(len(batch) + len(rides), rides)
        self._stage(self._decode(batch, stepped, rides, chunks, ended))
        decoded = time.perf_counter()
        self._stage(self._prefill(ended, budget, {slot for slot, _, _ in chunks}))
        self.trace.end(self.report, rides + chunks)
        # host wall time per phase: launches and Python, and (deliver) the wait for the device
        self.report["steps"] += 1
        self.report["deliver_seconds"] += delivered - begun
        self.report["decode_seconds"] += decoded - delivered
        self.report["prefill_seconds"] += time.perf_counter() - decoded
        return ended

    def _step_ahead(self, rows: list, plans: dict[int, str], ended: list[Request], begun: float) -> list[Request]:
        """A decode-only step launched, then the previous step's tokens handed over (`kvpot.engine.ahead`)."""
        self.trace.begin(self.report, begun, self.active)
        pending = self.outbox.take()
        self._prepare_rows(rows, plans)
        self._stage(self._decode(*step_sequences(self, rows, ended), [], [], ended))
        launched = time.perf_counter()
        self._deliver(ended, pending)
        self.trace.end(self.report, [])
        for name, value in (("steps", 1), ("ahead_steps", 1), ("decode_seconds", launched - begun),
                            ("deliver_seconds", time.perf_counter() - launched)):
            self.report[name] += value
        return ended

    def _drop_cancelled(self, ended: list[Request]) -> None:
        for request in [r for r in self.waiting if self.agreement.cancels(r)]:
            self.waiting.remove(request)
            self._end(request, "cancelled", "cancelled", ended)
        for active in [a for a in self.active.values() if self.agreement.cancels(a.request)]:
            self._end(active.request, "cancelled", "cancelled", ended)

    def _admit(self, ended: list[Request]) -> None:
        while self.waiting and (slot := self.pool.acquire(*reader_lanes(self, self.waiting[0]))) is not None:
            request = self.waiting.popleft()
            request.slot, request.status = slot, "prefilling"
            active = self.active[slot] = _Active(request, started=self.agreement.clock)
            active.eos = (frozenset() if request.ignore_eos else self.eos) | frozenset(request.stop_token_ids)
            try:
                begin_read(self, active)
            except Exception as err:  # noqa: BLE001 - whatever one request raises fails it alone
                self._fail(request, err, ended)
        self.pool.flush()  # the stored states' copies into the slots admitted, one per state (`load_state`)

    def _chunks(self, batch: int, rides: list) -> tuple[list[tuple[int, _Active, Chunk]], int]:
        """Prompt chunks joining this step's forward beside `batch` decoding rows (`plan_chunks`), within the budget
        `rides` (rows riding as chunks) leave; tokens left."""
        budget = self.prefill_tokens - sum(c.ids.numel() + tail_tokens(self.method, c.run, c.step) for *_, c in rides)
        if not self.mix or budget < 1:  # (no riders without mixing)
            return [], budget
        candidates, peeked = [], {}
        cuttable = self.chunk_cap is not None and not self.method.chunk_dependent  # a chunk cut to fill the step
        for slot, active in reading_order(self.active, self.prompt_order, self.agreement.clock, self.prompt_patience):
            active.run.max_chunk = self.chunk_cap
            candidate, chunk = peek_candidate(self.method, slot, active.run, active.reader, cuttable, self.pool)
            candidates.append(candidate)
            peeked[slot] = (active, chunk)
        plan = plan_chunks(candidates, budget, batch, chunk_rows(self.decoder, rides))
        if plan.cut_to is not None:
            peeked[plan.slots[-1]] = (last := peeked[plan.slots[-1]][0], last.reader.cut(plan.cut_to))
        return [(s, peeked[s][0], Chunk(peeked[s][0].run, *peeked[s][1])) for s in plan.slots], plan.budget_left

    def _prefill(self, ended: list[Request], budget: int, mixed: set[int]) -> list[int]:
        """Read chunks of prefilling requests in forwards of their own, oldest first, within what is left of the
        step's token budget; returns the slots whose prompt was read (their first token is picked). A chunk mixed this
        step mixes its next one too: apart, 10-12 such forwards took 90-190 ms (engine-core-h200/packed-3/). A shared
        document's reader mixes always. `mix_waits` (every mixable chunk waits) is off: see its A/B."""
        done, read = [], budget < self.prefill_tokens  # prompt tokens were read in this step's forward already
        waits = read and self.mix_waits  # (an A/B: `mix_rule_ab.py`, `mixed_probe.py --modes mix-apart`)
        for slot, active in reading_order(self.active, self.prompt_order, self.agreement.clock, self.prompt_patience):
            try:
                # a forward costs at least the weights' read: not worth it for a sliver of budget. Forwards apart are
                # capped at the whole budget, not what is left: cut to each remainder, a method's chunks could stay out
                # of step with its cycle (a pot) and double its forwards; a step's first may so run past the budget.
                while True:
                    active.run.max_chunk = self.chunk_cap
                    chunk = active.reader.peek()
                    if chunk is None:
                        self._start_decoding(active)
                        done.append(slot)
                        break
                    if budget < max(1, self.prefill_tokens // 4) or read and chunk[0].numel() > budget or self.mix \
                            and (waits or slot in mixed or shares(self.pool, slot)) and mixable(self.method, active.run):
                        break  # one forward past the budget only if none came; a mixable chunk mixes next step
                    unshare(self, slot, "question")  # (a reader's question read apart reads the slot's keys)
                    self.engine._forward(active.run, *chunk)
                    read = True
                    size = active.reader.advance()
                    self.report["forwards"] += 1
                    # a short forward (a question after a stored document) costs about what a longer one does (host-
                    # bound: ~80 ms on an 8B shape for 32 tokens): an eighth of the budget at least, not dozens a step
                    budget -= max(size, self.prefill_tokens // 8)
                    self.report["prefill_forwards"] += 1
            except Exception as err:  # noqa: BLE001 - a forward or a first pick of one request fails it alone
                self._fail(active.request, err, ended)
            if budget < self.prefill_tokens // 4:
                break
        return self._first_tokens(done, ended)

    def _first_tokens(self, done: list[int], ended: list[Request]) -> list[int]:
        """Of the slots whose prompt was just read, those that decode (a request for no token ends here)."""
        for slot in [slot for slot in done if slot in self.active and self.active[slot].request.max_new_tokens == 0]:
            self._end(self.active[slot].request, "finished", "length", ended)
        return [slot for slot in done if slot in self.active]

    def _start_decoding(self, active: _Active) -> None:
        request, run, slot = active.request, active.run, active.request.slot
        run.cache = self.pool.settle(slot, run.cache)
        run.stats.prefill_seconds += time.perf_counter() - active.read_started
        request.status, active.feeding = "decoding", None
        active.decode_started = time.perf_counter()
        if request.max_new_tokens == 0:
            return
        self.decoder.start(slot, run.logits, run.next_position, request.temperature, request.top_p,
                           request_seed(request.seed, request.temperature), request.max_new_tokens)
        self.decoder.picking[slot] = picking(request.temperature, request.top_p)
        self.decoder.pick([slot])

    def _prepare_rows(self, rows: list[tuple[int, _Active]], plans: dict[int, str]) -> dict[int, str]:
        """The decoding rows' inputs (fed question tokens), plans, and copies on write before their step."""
        self._feed(rows)
        copy_before_step(self, rows, plans)  # readers of a shared document whose step changes it copy first
        for slot, active in rows:
            active.plan = plans[slot]
        return plans

    def _decode(self, batch: list[tuple[int, _Active]], stepped: list[int], rides: list, chunks: list,
                ended: list[Request]):
        """One forward: a token for each row of `batch`, the riders' and the prompt `chunks` beside them; slots with
        a new token."""
        if batch or chunks or rides:
            slots = [slot for slot, _ in batch]
            live = [active.plan == "append" for _, active in batch]
            observe = self.method.decode_request("steady" if not all(live) else "append") if batch else None
            steady = [(row, slot, a.run) for row, (slot, a) in enumerate(batch) if a.plan == "steady"]
            inside = None if chunks or rides or not self.decoder.evict_inside else steady_form(
                self.method, [run for *_, run in steady], self.engine.parallel)
            try:
                if chunks or rides:
                    mixed_forward(self.decoder, slots, live, observe, [chunk for *_, chunk in rides + chunks])
                    self.report["mixed_forwards"] += 1
                else:
                    self.decoder.step(slots, live, observe, inside)
                self.report["forwards"] += 1
            except Exception as err:  # noqa: BLE001 - a failed forward fails its rows, not the server
                for request in [a.request for _, a in batch] + [a.request for _, a, _ in rides + chunks]:
                    self._fail(request, err, ended)
                return stepped
            for slot, active in batch:
                mirror_append(active.run)
                stepped.append(slot)
            if steady:  # rows at their budget evict back to it, in the step or after it (`kvpot.engine.evict`)
                self.report["steady_rows"] += len(steady)
                evict_steady(self.method, self.pool, steady, lambda run, err: self._fail(
                    next(a.request for _, a in batch if a.run is run), err, ended),
                    inside=inside is not None)
            self.report["batched_rows"] += len(batch)
            self.report["riding_rows"] += len(rides)
        riders, picked = [slot for slot, _, _ in rides], []
        for slot in stepped + riders:  # a rider's method work ran after the forward (`Engine._after_forward`)
            active = self.active.get(slot)
            try:
                if active is not None and slot in riders:
                    self.decoder.rode(slot, active.run)  # its logits, counts, and its next token picked
                if active is not None and self._fed(active):
                    picked.append(slot)
            except Exception as err:  # noqa: BLE001 - a rider's pick, a fed question's first: its request fails alone
                self._fail(active.request, err, ended)
        return picked + self._chunks_read(chunks, ended)

    def _chunks_read(self, chunks: list, ended: list[Request]) -> list[int]:
        """After a mixed forward: each chunk's reader moves on; prompts now read pick their first token."""
        done = []
        for slot, active, _ in chunks:
            try:
                active.reader.advance()
                self.report["prefill_forwards"] += 1
                if active.reader.peek() is None:
                    self._start_decoding(active)
                    done.append(slot)
            except Exception as err:  # noqa: BLE001 - one request's compression or first pick: it fails alone
                self._fail(active.request, err, ended)
        return self._first_tokens(done, ended)

    def _feed(self, rows: list[tuple[int, _Active]]) -> None:
        """Each fed row's next question token becomes its step's input (instead of its last pick)."""
        fed = [(slot, active.feeding[active.fed]) for slot, active in rows if active.feeding is not None]
        if fed:
            self.decoder.feed(*map(list, zip(*fed)))
            self.report["fed_tokens"] += len(fed)

    def _fed(self, active: _Active) -> bool:
        """After a step: False while the row's question is still being fed; at its last token the request starts
        decoding (its first token is picked from that step's logits) and True."""
        if active.feeding is None:
            return True
        active.fed += 1
        if active.fed < len(active.feeding):
            return False
        active.run.logits = self.decoder.logits[active.request.slot].clone()
        self._start_decoding(active)
        return True

    def _stage(self, slots: list[int]) -> None:
        self.outbox.stage(slots, [self.active[s].request for s in slots], self.decoder.last_token, self.pool.device)

    def _deliver(self, ended: list[Request], pending: list | None = None) -> None:
        """Hand the staged tokens (or `pending`'s) to their requests: `on_token`, then an end at an end-of-sequence or
        stop token or at `max_new_tokens` (which frees the slot at once)."""
        for slot, request, token, now in self.outbox.drain(pending):
            active = self.active.get(slot)
            if active is not None and active.request is request and not request.done:
                hand_over(self, active, request, token, now, ended)

    # ------------------------------------------------------------------ endings
    def _fail(self, request: Request, error: Exception, ended: list[Request]) -> None:
        request.error = f"{type(error).__name__}: {error}" if not isinstance(error, KvpotError) else str(error)
        request.exception = error
        self._end(request, "failed", "error", ended)

    def _end(self, request: Request, status: str, reason: str, ended: list[Request]) -> None:
        if request.done:
            return
        request.finished_time = time.perf_counter()
        active = self.active.pop(request.slot, None) if request.slot is not None else None
        if active is not None and active.run is not None:
            decode = {"mode": f"batch-{self.mode}", "slots": self.pool.slots, "capacity": self.capacity}
            request.stats = close_stats(self.engine, active.run, len(request.tokens), active.decode_started, decode)
        if active is not None:
            self.decoder.picking.pop(request.slot, None)
            self.pool.release(request.slot)
        place = self.places.pop(request.id, None)
        if place is not None:  # every ending passes here: done, cancelled, failed, aborted
            place.release()
        # done last: a thread that sees the request done (a server's handler) finds its slot and place given back
        request.status, request.finish_reason = status, reason
        ended.append(request)
        if request.on_finish is not None:
            request.on_finish(request)

