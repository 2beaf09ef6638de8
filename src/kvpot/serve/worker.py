"""The generation thread: every torch call of the server runs here, in one step-driven loop.

The HTTP side only feeds and drains. It takes a place first (`admit`: one of a pool's slots or a
place in its waiting queue, else 429 with Retry-After), then hands work over: `submit` queues a
`Request` on its method's pool (`kvpot.engine.Scheduler`), `read` queues a long text to read into a
state (an uploaded document, a conversation's context to keep), `call` runs a small job (a stored
state loaded or saved). One turn of the loop:

1. the small jobs and submissions, in arrival order;
2. one step of every pool with work: one batched decode step for all its decoding requests, then
   new requests' prompts read within the step's token budget (`--prefill-tokens`);
3. one forward of the oldest text being read (documents are read between decode steps, so the
   users already decoding keep streaming while a long document is read);
4. if nothing is left, sleep until something arrives.

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
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvpot.errors import Cancelled, KvpotError
from kvpot.serve.protocol import ApiError

log = logging.getLogger("kvpot.serve")


@dataclass
class Pool:
    """One method configuration's scheduler, and the requests admitted to it (waiting or running)."""

    key: str
    spec: str
    scheduler: object  # kvpot.engine.Scheduler
    admitted: int = 0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def slots(self) -> int:
        return self.scheduler.pool.slots

    def describe(self) -> dict:
        s = self.scheduler
        return {"method": self.spec, "slots": self.slots, "slots_used": self.slots - len(s.pool.free),
                "capacity": s.capacity, "slot_bytes": s.slot_bytes(), "decoding": s.decoding,
                "prefilling": s.prefilling, "waiting": len(s.waiting),
                **({"shared": s.pool.documents.metrics()} if getattr(getattr(s, "pool", None), "documents", None)
                   is not None else {})}


class Ticket:
    """An admitted request's place, its cancel flag, and (once submitted) its engine request."""

    def __init__(self, worker: Worker | None = None, pool: Pool | None = None):
        self.worker, self.pool = worker, pool
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


@dataclass
class _Read:
    steps: Iterator[int]
    future: Future
    ticket: Ticket


class Worker:
    def __init__(self, config, metrics, make_pool: Callable[[object, str, int | None], object]):
        self.config, self.metrics, self.make_pool = config, metrics, make_pool
        self.pools: dict[str, Pool] = {}
        self.lock = threading.Lock()  # admission counts, shared with the HTTP side
        self.wake = threading.Event()
        self.calls: deque[tuple[Callable, Future]] = deque()
        self.reads: deque[_Read] = deque()
        self.reading = 0  # texts admitted to `reads` (queued or being read)
        self.rejected = 0
        self.cancelled = 0
        self.recent = 2.0  # moving average of a request's seconds (for Retry-After while none has left lately)
        self.departures: deque[float] = deque(maxlen=32)  # when admitted requests left (the measured drain rate)
        self.tickets: set[Ticket] = set()  # admitted and not yet released
        self.draining = False  # shutting down: nothing new is admitted
        self.stopping = False
        self.outboxes: list = []  # kvpot.serve.service.Outbox: flushed after every turn
        self.thread = threading.Thread(target=self._loop, name="kvpot-generate", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ the HTTP side
    async def call(self, fn: Callable):
        """`fn()` on the generation thread between steps; the awaitable raises what it raises."""
        future: Future = Future()
        if self.stopping:
            raise ApiError(503, "the server is shutting down.")
        self.calls.append((fn, future))
        self.wake.set()
        return await asyncio.wrap_future(future)

    async def read(self, steps: Callable[[], Iterator[int]], ticket: Ticket):
        """Run the generator `steps()` one forward per turn of the loop; returns its return value."""
        future: Future = Future()

        def queue():
            self.reads.append(_Read(steps(), future, ticket))

        await self.call(queue)
        return await asyncio.wrap_future(future)

    async def pool(self, engine, spec: str, default: bool = False) -> Pool:
        """The pool of `engine`'s method (made on the generation thread if it has none yet)."""
        key = _key(engine)
        pool = self.pools.get(key)
        if pool is None:
            pool = await self.call(lambda: self._make_pool(engine, spec, default))
        return pool

    def admit(self, pool: Pool) -> Ticket:
        """A place among the pool's slots or in its queue (`--max-queue` beyond the slots), else 429."""
        with self.lock:
            self._check_draining()
            if pool.admitted >= pool.slots + self.config.max_queue:
                self.rejected += 1
                waiting = pool.admitted - pool.slots
                retry = self._retry(waiting + 1, pool.slots)
                raise ApiError(429, f"the server is busy ({pool.slots} slots taken, {waiting} requests waiting, "
                                    f"--max-queue {self.config.max_queue}); retry in about {retry} s.",
                               headers={"Retry-After": str(retry)})
            pool.admitted += 1
            pool.last_used = time.monotonic()
            return self._ticket(pool)

    def admit_read(self) -> Ticket:
        """A place among the texts waiting to be read (`--max-queue`, plus the one being read), else 429."""
        with self.lock:
            self._check_draining()
            if self.reading >= self.config.max_queue + 1:
                self.rejected += 1
                retry = self._retry(self.reading, 1)
                raise ApiError(429, f"the server is busy ({self.reading} documents being read or waiting); retry "
                                    f"in about {retry} s.", headers={"Retry-After": str(retry)})
            self.reading += 1
            return self._ticket(None)

    def _ticket(self, pool: Pool | None) -> Ticket:
        ticket = Ticket(self, pool)
        self.tickets.add(ticket)
        return ticket

    def _check_draining(self) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down; retry with another server or in a moment.",
                           code="shutting_down", headers={"Retry-After": "5"})

    def _leave(self, ticket: Ticket) -> None:
        with self.lock:
            self.tickets.discard(ticket)
            self.departures.append(time.monotonic())
            if ticket.pool is None:
                self.reading -= 1
            else:
                ticket.pool.admitted -= 1
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
            return sum(max(0, p.admitted - p.slots) for p in self.pools.values()) + max(0, self.reading - 1)

    @property
    def running(self) -> int:
        with self.lock:
            return sum(min(p.admitted, p.slots) for p in self.pools.values()) + min(self.reading, 1)

    def shared(self) -> tuple[int, int, int]:
        """(shared documents loaded, their readers, copy-on-write events) over every pool (`--share-documents`)."""
        regions = [p.scheduler.pool.documents for p in list(self.pools.values())
                   if getattr(getattr(p.scheduler, "pool", None), "documents", None) is not None]
        return (sum(r.documents for r in regions), sum(r.readers for r in regions),
                sum(sum(r.copies.values()) for r in regions))

    def slots(self) -> tuple[int, int]:
        """(used, total) over every pool."""
        pools = list(self.pools.values())
        total = sum(p.slots for p in pools)
        return total - sum(len(p.scheduler.pool.free) for p in pools), total

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=10)

    # ------------------------------------------------------------------ the generation thread
    def _loop(self) -> None:
        trace = _Trace.open()
        while not self.stopping:
            begun, calls = time.perf_counter(), len(self.calls)
            self._run_calls()
            busy, called = False, time.perf_counter()
            for pool in list(self.pools.values()):
                if not pool.scheduler.idle:
                    self._step(pool)
                    busy = True
            stepped = time.perf_counter()
            reading = bool(self.reads)
            if reading:
                self._advance_read()
                busy = True
            for outbox in self.outboxes:
                outbox.flush()
            if trace is not None and (busy or calls):
                trace.turn(begun, calls, called, stepped, reading, self.pools)
            if not busy and not self.calls:
                self.wake.wait(1.0)
                self.wake.clear()
        self._abandon()

    def _run_calls(self) -> None:
        while self.calls:
            fn, future = self.calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the awaiting request
                future.set_exception(err)

    def _step(self, pool: Pool) -> None:
        scheduler = pool.scheduler
        before = scheduler.report["batched_rows"] + scheduler.report["eager_rows"]
        try:
            scheduler.step()
        except Exception as err:
            log.exception("a batched step failed; its requests end with an error")
            scheduler.abort(err)
            return
        rows = scheduler.report["batched_rows"] + scheduler.report["eager_rows"] - before
        if rows:
            self.metrics.batch(rows)

    def _advance_read(self) -> None:
        read = self.reads[0]
        try:
            if read.ticket.cancel.is_set():
                raise Cancelled("the read was stopped.")
            next(read.steps)
            return
        except StopIteration as done:
            read.future.set_result(done.value)
        except Cancelled:
            read.future.set_exception(read.ticket.cancelled_error())
        except Exception as err:  # noqa: BLE001 - handed to the awaiting request
            read.future.set_exception(err)
        self.reads.popleft()

    def _make_pool(self, engine, spec: str, default: bool) -> Pool:
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
            self._drop_idle_pools()
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

    def _drop_idle_pools(self) -> None:
        import torch

        for key, pool in list(self.pools.items()):
            if pool is not next(iter(self.pools.values())) and pool.admitted == 0 and pool.scheduler.idle:
                del self.pools[key]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _abandon(self) -> None:
        """The server stops: whatever still waits gets an error rather than hanging."""
        for fn, future in self.calls:
            future.cancel()
        for read in self.reads:
            if not read.future.done():
                read.future.set_exception(ApiError(503, "the server is shutting down."))
        for pool in self.pools.values():
            pool.scheduler.abort()
        for outbox in self.outboxes:
            outbox.flush()


def _key(engine) -> str:
    import json

    return json.dumps(engine.method.config(), sort_keys=True, default=str)


class _Trace:
    """One JSON line per busy turn of the generation thread (`KVPOT_SERVE_TRACE=FILE`): when it began,
    the calls it ran and each phase's seconds, and each pool's counts; for finding where latency goes."""

    def __init__(self, path: str):
        self.file, self.zero = open(path, "a", buffering=1), time.perf_counter()  # noqa: SIM115 - lives with the thread

    @classmethod
    def open(cls) -> _Trace | None:
        import os

        path = os.environ.get("KVPOT_SERVE_TRACE")
        return cls(path) if path else None

    def turn(self, begun: float, calls: int, called: float, stepped: float, reading: bool, pools: dict) -> None:
        import json

        end = time.perf_counter()
        pools = {pool.spec: {"decoding": pool.scheduler.decoding, "prefilling": pool.scheduler.prefilling,
                             "waiting": len(pool.scheduler.waiting)} for pool in pools.values()}
        self.file.write(json.dumps({"t": round(begun - self.zero, 4), "calls": calls, "calls_s": round(called - begun, 4),
                                    "steps_s": round(stepped - called, 4), "read_s": round(end - stepped, 4) if reading
                                    else 0.0, "pools": pools}) + "\n")
