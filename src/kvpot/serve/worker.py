"""The generation thread: every torch call of the server runs here, in one step-driven loop of turns
(`kvpot.serve.turns`).

The HTTP side only feeds and drains. It takes a place first (`admit`: one of a pool's slots or a
place in its waiting queue, taken from the pool's own scheduler's admission, `kvpot.engine.admission`,
else 429 with Retry-After), then hands work over as named commands
(`command`: a request submitted to its method's pool, a stored state promoted or deleted, ...);
`read` queues a long text to read into a state (an uploaded document, a conversation's context to
keep), one forward per turn.

Pools: the server's method has one from the start, sized by `--max-slots` or the free GPU memory.
A request naming a stored state read with another method gets that method's own pool of
`--method-slots` slots, made while memory allows (idle pools of other methods are dropped to make
room), else a 429.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvpot.engine.admission import Admission, Place, QueueFull
from kvpot.errors import KvpotError
from kvpot.serve.protocol import ApiError
from kvpot.serve.turns import Command, Read, TurnLoop

log = logging.getLogger("kvpot.serve")


@dataclass
class Pool:
    """One method configuration's scheduler; the requests admitted to it (waiting or running) hold places
    of its admission (`Scheduler.admission`)."""

    key: str
    spec: str
    scheduler: object  # kvpot.engine.Scheduler
    last_used: float = field(default_factory=time.monotonic)

    @property
    def slots(self) -> int:
        return self.scheduler.pool.slots

    @property
    def admitted(self) -> int:
        return self.scheduler.admission.view().taken

    def describe(self) -> dict:
        s = self.scheduler
        return {"method": self.spec, "slots": self.slots, "slots_used": self.slots - len(s.pool.free),
                "capacity": s.capacity, "slot_bytes": s.slot_bytes(), "decoding": s.decoding,
                "reader_room": getattr(getattr(s, "pool", None), "stride", None),  # tail slots (`--reader-room`)
                "prefilling": s.prefilling, "waiting": len(s.waiting), "mix": getattr(s, "mix", False),
                "launch_ahead": getattr(s, "launch_ahead", False),
                "batch_invariant": getattr(getattr(s, "engine", None), "batch_invariant", False),
                **({"shared": s.pool.documents.metrics()} if getattr(getattr(s, "pool", None), "documents", None)
                   is not None else {})}


class Ticket:
    """An admitted request's place, its cancel flag, and (once submitted) its engine request."""

    def __init__(self, worker: Worker | None = None, pool: Pool | None = None, place: Place | None = None):
        self.worker, self.pool, self.place = worker, pool, place
        self.cancel = threading.Event()
        self.request = None  # kvpot.engine.Request
        self.released = False
        self.stopped_by_text = False  # a stop string ended it: not a cancellation
        self.shutdown = False  # the server stopped it (its shutdown grace ran out): not the client

    def stop(self, shutdown: bool = False) -> None:
        """Stop the work at the next step boundary (any thread): the client went away, a stop string ended it,
        or (`shutdown`) the server is stopping."""
        self.shutdown = self.shutdown or shutdown
        self.cancel.set()
        if self.request is not None:
            self.request.cancel_requested = True

    def cancelled_error(self) -> ApiError:
        """What the client is told when this work was stopped before it finished."""
        if self.shutdown:
            return ApiError(503, "the server is shutting down; retry with another server or in a moment.",
                            code="shutting_down", headers={"Retry-After": "5"})
        return ApiError(499, "the request was cancelled (the client went away).")

    def release(self) -> None:
        if not self.released and self.worker is not None:
            self.released = True
            self.worker._leave(self)


class Worker(TurnLoop):
    """The generation thread (its loop: `TurnLoop`). `engine_for(spec)` gives the engine of a method spec
    (the other ranks' pools and reads name their method so); `exchange` (`kvpot.serve.turns.TurnExchange`,
    tensor parallelism) sends rank 0's turns to the other ranks, whose worker runs no thread but `follow`."""

    def __init__(self, config, metrics, make_pool: Callable[[object, str, int | None], object],
                 engine_for: Callable[[str], object] | None = None, exchange=None):
        self.config, self.metrics, self.make_pool = config, metrics, make_pool
        self.engine_for, self.exchange = engine_for, exchange
        self.follower = exchange is not None and exchange.rank != 0
        self.broken: str | None = None  # the other ranks stopped answering: every request fails with this
        self.handlers: dict[str, Callable] = {"call": lambda fn, local=None: fn(), "pool": self._pool_command,
                                              "read": self._queue_read}
        self.pools: dict[str, Pool] = {}
        # the forwards, mixed forwards, copies on write and steps launched ahead of pools dropped: counters stay up
        self.dropped = [0, 0, 0, 0]
        self.lock = threading.Lock()  # admission counts, shared with the HTTP side
        self.wake = threading.Event()
        self.calls: deque[Command] = deque()
        self.reads: deque[Read] = deque()
        # texts admitted to `reads` (queued or being read): one read at a time, `--max-queue` waiting
        self.read_admission = Admission(1, config.max_queue)
        self.rejected = 0
        self.cancelled = 0
        self.recent = 2.0  # moving average of a request's seconds (for Retry-After while none has left lately)
        self.departures: deque[float] = deque(maxlen=32)  # when admitted requests left (the measured drain rate)
        self.tickets: set[Ticket] = set()  # admitted and not yet released
        self.draining = False  # shutting down: nothing new is admitted
        self.stopping = False
        self.outboxes: list = []  # kvpot.serve.service.Outbox: flushed after every turn
        self.thread = threading.Thread(target=self._loop, name="kvpot-generate", daemon=True)
        if not self.follower:
            self.thread.start()

    # ------------------------------------------------------------------ the HTTP side
    async def command(self, name: str, *args, local=None):
        """`handlers[name](*args, local=local)` on the generation thread between steps (on every rank under
        tensor parallelism: `args` must pickle); the awaitable raises what it raises."""
        future: Future = Future()
        if self.broken:
            raise ApiError(503, self.broken, code="tensor_parallel_failed")
        if self.stopping:
            raise ApiError(503, "the server is shutting down.")
        self.calls.append(Command(name, args, local, future))
        self.wake.set()
        return await asyncio.wrap_future(future)

    async def call(self, fn: Callable):
        """`fn()` on the generation thread between steps (one process only: a closure cannot be sent to
        other ranks, so under tensor parallelism use a named `command`)."""
        if self.exchange is not None:
            raise KvpotError("Worker.call runs a closure on rank 0 alone; under tensor parallelism every rank must "
                             "run the same work: register a handler and use Worker.command.")
        return await self.command("call", fn)

    async def read(self, start: tuple[str, tuple], ticket: Ticket, then: tuple[str, tuple] | None = None,
                   then_local=None):
        """Read a text one forward per turn: `handlers[start[0]](*start[1], should_stop=...)` makes the
        generator, whose return value (a state) is handed, in the turn it ends, to `then` (a handler name and
        its arguments, called with the state first, `then_local` as local). Returns (state, then's result)."""
        future: Future = Future()
        await self.command("read", start, then, local=(ticket, future, then_local))
        return await asyncio.wrap_future(future)

    async def pool(self, engine, spec: str, default: bool = False) -> Pool:
        """The pool of `engine`'s method (made on the generation thread if it has none yet)."""
        key = _key(engine)
        pool = self.pools.get(key)
        if pool is None:
            pool = await self.command("pool", spec, default, local=engine)
        return pool

    def pool_of(self, engine) -> Pool:
        """The pool of `engine`'s method, which must exist (a request admitted to it holds it)."""
        pool = self.pools.get(_key(engine))
        if pool is None:
            raise KvpotError(f"no pool runs {engine.method.config()}.")
        return pool

    def admit(self, pool: Pool) -> Ticket:
        """A place among the pool's slots or in its queue (`--max-queue` beyond the slots), else 429: the
        place of its scheduler's admission, handed with the request to `submit` (not taken twice)."""
        with self.lock:
            self._check_draining()
            self._check_broken()
            try:
                place = pool.scheduler.admission.take()
            except QueueFull:
                self.rejected += 1
                waiting = pool.scheduler.admission.view().waiting
                retry = self._retry(waiting + 1, pool.slots)
                raise ApiError(429, f"the server is busy ({pool.slots} slots taken, {waiting} requests waiting, "
                                    f"--max-queue {self.config.max_queue}); retry in about {retry} s.",
                               headers={"Retry-After": str(retry)}) from None
            pool.last_used = time.monotonic()
            return self._ticket(pool, place)

    def admit_read(self) -> Ticket:
        """A place among the texts waiting to be read (`--max-queue`, plus the one being read), else 429."""
        with self.lock:
            self._check_draining()
            self._check_broken()
            try:
                place = self.read_admission.take()
            except QueueFull:
                self.rejected += 1
                reading = self.read_admission.view().taken
                retry = self._retry(reading, 1)
                raise ApiError(429, f"the server is busy ({reading} documents being read or waiting); retry "
                                    f"in about {retry} s.", headers={"Retry-After": str(retry)}) from None
            return self._ticket(None, place)

    def _ticket(self, pool: Pool | None, place: Place) -> Ticket:
        ticket = Ticket(self, pool, place)
        self.tickets.add(ticket)
        return ticket

    def _check_draining(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry with another server or in a moment.",
                           code="shutting_down", headers={"Retry-After": "5"})

    def _check_broken(self) -> None:
        if self.broken:
            raise ApiError(503, self.broken, code="tensor_parallel_failed")

    def _leave(self, ticket: Ticket) -> None:
        with self.lock:
            self.tickets.discard(ticket)
            self.departures.append(time.monotonic())
            # a request the scheduler queued gives its place back when it ends there; one never queued
            # (its client left first, an error before `submit`) gives it back here
            if ticket.request is None or ticket.request.submitted is None:
                ticket.place.release()
            if ticket.cancel.is_set() and not ticket.stopped_by_text:
                self.cancelled += 1

    def finished(self, seconds: float) -> None:
        with self.lock:
            self.recent = 0.8 * self.recent + 0.2 * seconds

    def _retry(self, ahead: int, lanes: int) -> int:
        """Seconds until `ahead` requests have left: at the rate requests left lately (measured over the last
        departures within a minute), else at `lanes` per request's average time."""
        now, times = time.monotonic(), [t for t in self.departures if t > time.monotonic() - 60]
        if len(times) >= 4 and now - times[0] > 0:
            return max(1, math.ceil(ahead * (now - times[0]) / len(times)))
        return max(1, math.ceil(self.recent * max(1, ahead) / max(1, lanes)))

    def stop_all(self) -> int:
        """(any thread) Stop every admitted request for the server's shutdown; returns how many."""
        with self.lock:
            tickets = list(self.tickets)
        for ticket in tickets:
            ticket.stop(shutdown=True)
        return len(tickets)

    # ------------------------------------------------------------------ gauges (any thread)
    @property
    def waiting(self) -> int:
        with self.lock:
            views = [p.scheduler.admission.view() for p in self.pools.values()] + [self.read_admission.view()]
            return sum(view.waiting for view in views)

    @property
    def running(self) -> int:
        with self.lock:
            views = [p.scheduler.admission.view() for p in self.pools.values()] + [self.read_admission.view()]
            return sum(view.running for view in views)

    def shared(self) -> tuple[int, int, int]:
        """(shared documents loaded, their readers, copy-on-write events) over every pool (`--share-documents`)."""
        regions = [p.scheduler.pool.documents for p in list(self.pools.values())
                   if getattr(getattr(p.scheduler, "pool", None), "documents", None) is not None]
        return (sum(r.documents for r in regions), sum(r.readers for r in regions),
                self.dropped[2] + sum(sum(r.copies.values()) for r in regions))

    def forwards(self) -> tuple[int, int, int]:
        """(model forwards of the batched steps, those that read prompt chunks beside the decoding rows (`--mix`),
        steps launched before the last step's tokens were handed over (`--launch-ahead`)) over every pool; a model
        split over GPUs (`SoloScheduler`) counts none."""
        reports = [getattr(p.scheduler, "report", {}) for p in list(self.pools.values())]
        return tuple(self.dropped[i] + sum(r.get(name, 0) for r in reports)
                     for i, name in ((0, "forwards"), (1, "mixed_forwards"), (3, "ahead_steps")))

    def slots(self) -> tuple[int, int]:
        """(used, total) over every pool."""
        pools = list(self.pools.values())
        total = sum(p.slots for p in pools)
        return total - sum(len(p.scheduler.pool.free) for p in pools), total

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    def _pool_command(self, spec: str, default: bool, droppable: tuple = (), local=None) -> Pool:
        engine = local if local is not None else self.engine_for(spec)
        return self._make_pool(engine, spec, default, droppable)

    def _make_pool(self, engine, spec: str, default: bool, droppable: tuple = ()) -> Pool:
        key = _key(engine)
        if key in self.pools:
            return self.pools[key]
        import torch

        slots = self.config.max_slots if default else self.config.method_slots
        try:
            scheduler = self.make_pool(engine, spec, slots)
        except (KvpotError, torch.OutOfMemoryError) as err:
            if default:
                raise
            self._drop_idle_pools(droppable)
            try:
                scheduler = self.make_pool(engine, spec, slots)
            except (KvpotError, torch.OutOfMemoryError):
                with self.lock:
                    self.rejected += 1
                raise ApiError(429, f"no GPU memory for a pool of method {spec!r} now ({err}); retry later, or ask "
                                    "with the server's method.", headers={"Retry-After": "30"},
                               code="no_pool_memory") from None
        pool = self.pools[key] = Pool(key, spec, scheduler)
        log.info("pool for %s: %d slots of %d entries (%.1f MiB each)", spec, pool.slots, scheduler.capacity,
                 scheduler.slot_bytes() / 2**20)
        return pool

    def _droppable(self) -> tuple[str, ...]:
        """Pools no admitted request holds (rank 0 knows admissions; the other ranks drop what it says)."""
        with self.lock:
            return tuple(key for key, pool in self.pools.items() if pool.admitted == 0)

    def _drop_idle_pools(self, droppable: tuple) -> None:
        import torch

        first = next(iter(self.pools.values()), None)
        for key in droppable:
            pool = self.pools.get(key)
            if pool is not None and pool is not first and pool.scheduler.idle:
                report, region = getattr(pool.scheduler, "report", {}), getattr(pool.scheduler.pool, "documents", None)
                self.dropped[0] += report.get("forwards", 0)
                self.dropped[1] += report.get("mixed_forwards", 0)
                self.dropped[2] += sum(region.copies.values()) if region is not None else 0
                self.dropped[3] += report.get("ahead_steps", 0)
                del self.pools[key]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

def _key(engine) -> str:
    import json

    return json.dumps(engine.method.config(), sort_keys=True, default=str)
