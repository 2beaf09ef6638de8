"""The generation thread: every torch call of the server runs here, in one step-driven loop.

The HTTP side only feeds and drains. It takes a place first (`admit`: one of a pool's slots or a
place in its waiting queue, else 429 with Retry-After), then hands work over as named commands
(`command`: a request submitted to its method's pool, a stored state promoted or deleted, ...),
`read` queues a long text to read into a state (an uploaded document, a conversation's context to
keep). One turn of the loop (`Turn`, planned before any of it runs):

1. the commands, in arrival order;
2. one step of every pool that had work when the turn was planned: one batched decode step for all
   its decoding requests, then new requests' prompts read within the step's token budget
   (`--prefill-tokens`);
3. one forward of the oldest text being read (documents are read between decode steps, so the
   users already decoding keep streaming while a long document is read);
4. if nothing is left, sleep until something arrives (at most a second).

Commands are names and picklable arguments, not closures, because under tensor parallelism
(`kvpot serve --tp N`, `kvpot.serve.parallel`) rank 0 sends each turn's plan to the other ranks before
running it, and they run the same turn: the same commands, steps and forwards in the same order.
What only rank 0 has (a ticket, the callbacks that stream tokens to a client) travels beside a command
as its `local` part and is None elsewhere.

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
class Command:
    """One piece of work for the generation thread: `handlers[name](*args, local=local)`."""

    name: str
    args: tuple = ()
    local: object = None  # rank 0's own part (a ticket, callbacks, an engine): never sent to other ranks
    future: Future | None = None  # rank 0's caller awaits it; None on the other ranks


@dataclass
class Turn:
    """What one turn of the loop does, decided before any of it runs (rank 0 sends it to the other ranks)."""

    commands: list[Command] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)  # keys of the pools stepped
    read: str | None = None  # the oldest read: "advance" one forward, "stop" it (cancelled), or None
    stop: bool = False  # the server stops: the loop ends

    def wire(self) -> dict:
        """The turn as the other ranks receive it: names and arguments only."""
        return {"commands": [(c.name, c.args) for c in self.commands], "steps": self.steps, "read": self.read,
                "stop": self.stop}

    @classmethod
    def from_wire(cls, sent: dict) -> Turn:
        return cls([Command(name, args) for name, args in sent["commands"]], sent["steps"], sent["read"], sent["stop"])


@dataclass
class _Read:
    steps: Iterator[int] | None = None
    future: Future | None = None
    ticket: Ticket | None = None
    then: tuple | None = None  # (handler name, args): run with the state when the read is done
    then_local: object = None
    stopped: bool = False  # the turn said stop: the engine's `should_stop` sees it (the same on every rank)


class Worker:
    """The generation thread. `engine_for(spec)` gives the engine of a method spec (the other ranks' pools
    and reads name their method so); `exchange` (`kvpot.serve.parallel.TurnExchange`, tensor parallelism)
    sends rank 0's turns to the other ranks, whose worker runs no thread of its own but `follow`."""

    def __init__(self, config, metrics, make_pool: Callable[[object, str, int | None], object],
                 engine_for: Callable[[str], object] | None = None, exchange=None):
        self.config, self.metrics, self.make_pool = config, metrics, make_pool
        self.engine_for, self.exchange = engine_for, exchange
        self.follower = exchange is not None and exchange.rank != 0
        self.broken: str | None = None  # the other ranks stopped answering: every request fails with this
        self.handlers: dict[str, Callable] = {"call": lambda fn, local=None: fn(), "pool": self._pool_command,
                                              "read": self._queue_read}
        self.pools: dict[str, Pool] = {}
        self.lock = threading.Lock()  # admission counts, shared with the HTTP side
        self.wake = threading.Event()
        self.calls: deque[Command] = deque()
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
        """A place among the pool's slots or in its queue (`--max-queue` beyond the slots), else 429."""
        with self.lock:
            self._check_draining()
            self._check_broken()
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
            self._check_broken()
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

    def _check_broken(self) -> None:
        if self.broken:
            raise ApiError(503, self.broken, code="tensor_parallel_failed")

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
        if self.thread.is_alive():
            self.thread.join(timeout=10)

    # ------------------------------------------------------------------ the generation thread
    def follow(self) -> None:
        """A rank other than 0 under tensor parallelism: run rank 0's turns on this thread until it stops.
        Raises when this rank falls out of step (rank 0 gone, a step that broke here alone)."""
        self._loop()

    def _loop(self) -> None:
        trace = _Trace.open()
        while True:
            turn = self._agree(None if self.follower else self._plan())
            if turn is None or turn.stop:
                break
            if not self._run(turn, trace) and not self.follower and not self.calls and not self.stopping:
                # at most a second: an idle turn is also the other ranks' sign that rank 0 is alive
                self.wake.wait(1.0)
                self.wake.clear()
        self._abandon()

    def _plan(self) -> Turn:
        """Rank 0's next turn: the commands queued (not those whose caller gave up), the pools with work now,
        and what the oldest read does. Decided before any of it runs, so other ranks can run it alike."""
        if self.stopping:
            return Turn(stop=True)
        commands = []
        while self.calls:
            command = self.calls.popleft()
            if command.future is None or command.future.set_running_or_notify_cancel():
                commands.append(command)
        for command in commands:
            if command.name == "pool":  # which idle pools may make room depends on admissions: rank 0's to say
                command.args = (*command.args[:2], self._droppable())
        steps = [key for key, pool in self.pools.items() if not pool.scheduler.idle]
        read = None
        if self.reads:
            ticket = self.reads[0].ticket
            read = "stop" if ticket is not None and ticket.cancel.is_set() else "advance"
        return Turn(commands, steps, read)

    def _agree(self, turn: Turn | None) -> Turn | None:
        """Rank 0's `turn` on every rank (as it is without tensor parallelism); None on rank 0 once the
        other ranks are out of reach (`broken`)."""
        if self.exchange is None:
            return turn
        try:
            sent = self.exchange.turn(None if turn is None else turn.wire())
        except Exception as err:
            if self.follower:
                raise KvpotError(f"rank 0 of the server stopped sending its turns ({type(err).__name__}: {err}); "
                                 f"rank {self.exchange.rank} stops.") from err
            self._break(err, turn)
            return None
        return turn if turn is not None else Turn.from_wire(sent)

    def _break(self, err: Exception, turn: Turn | None) -> None:
        """Rank 0 lost the other ranks: nothing can run any more; every request ends with this error."""
        self.broken = (f"the server's tensor-parallel ranks stopped answering ({type(err).__name__}: {err}); "
                       "no request can run: restart the server (torchrun).")
        log.error("%s", self.broken)
        if turn is not None:
            self.calls.extendleft(reversed(turn.commands))  # failed by `_abandon` with the rest

    def _run(self, turn: Turn, trace) -> bool:
        """One turn: its commands, its pools' steps, its read's forward; whether it did anything."""
        begun = time.perf_counter()
        for command in turn.commands:
            self._execute(command)
        called = time.perf_counter()
        for key in turn.steps:
            pool = self.pools.get(key)
            if pool is not None:
                self._step(pool)
        stepped = time.perf_counter()
        if turn.read is not None and self.reads:
            self._advance_read(stop=turn.read == "stop")
        for outbox in self.outboxes:
            outbox.flush()
        busy = bool(turn.commands or turn.steps or turn.read)
        if trace is not None and busy:
            trace.turn(begun, len(turn.commands), called, stepped, turn.read is not None, self.pools)
        return busy

    def _execute(self, command: Command) -> None:
        try:
            result = self.handlers[command.name](*command.args, local=command.local)
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting request
            if command.future is not None:
                command.future.set_exception(err)
            elif not isinstance(err, (ApiError, KvpotError)):  # another rank's caller got it; logged here
                log.warning("rank %d: %s failed: %s: %s", self.exchange.rank, command.name, type(err).__name__, err)
            return
        if command.future is not None:
            command.future.set_result(result)

    def _step(self, pool: Pool) -> None:
        scheduler = pool.scheduler
        before = scheduler.report["batched_rows"] + scheduler.report["eager_rows"]
        try:
            scheduler.step()
        except Exception as err:
            if self.follower:
                raise  # out of step with rank 0 from here on: this rank stops, and rank 0 finds it gone
            log.exception("a batched step failed; its requests end with an error")
            scheduler.abort(err)
            return
        rows = scheduler.report["batched_rows"] + scheduler.report["eager_rows"] - before
        if rows:
            self.metrics.batch(rows)

    def _queue_read(self, start: tuple[str, tuple], then: tuple[str, tuple] | None, local=None) -> None:
        ticket, future, then_local = local if local is not None else (None, None, None)
        read = _Read(future=future, ticket=ticket, then=then, then_local=then_local)
        name, args = start
        read.steps = self.handlers[name](*args, should_stop=lambda: read.stopped)
        self.reads.append(read)

    def _advance_read(self, stop: bool) -> None:
        """One forward of the oldest read, or (`stop`: its client went away) its end."""
        read = self.reads[0]
        read.stopped = stop
        try:
            if stop:
                raise Cancelled("the read was stopped.")
            next(read.steps)
            return
        except StopIteration as done:
            self._finish_read(read, done.value)
        except Cancelled:
            _settle(read.future, error=read.ticket.cancelled_error() if read.ticket is not None else None)
        except Exception as err:  # noqa: BLE001 - handed to the awaiting request
            _settle(read.future, error=err)
        self.reads.popleft()

    def _finish_read(self, read: _Read, state) -> None:
        """A read's state to its `then` handler, in the turn the read ends (on every rank alike)."""
        result = None
        if read.then is not None:
            name, args = read.then
            try:
                result = self.handlers[name](state, *args, local=read.then_local)
            except Exception as err:  # noqa: BLE001 - handed to the awaiting request
                _settle(read.future, error=err)
                return
        _settle(read.future, (state, result))

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
                del self.pools[key]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _abandon(self) -> None:
        """The loop ends (the server stops, or the other ranks are gone): whatever still waits gets an
        error rather than hanging."""
        error = ApiError(503, self.broken or "the server is shutting down.",
                         code="tensor_parallel_failed" if self.broken else "shutting_down")
        for command in self.calls:
            if command.future is not None and not command.future.cancel() and not command.future.done():
                command.future.set_exception(error)
        for read in self.reads:
            if read.future is not None and not read.future.done():
                read.future.set_exception(error)
        for pool in self.pools.values():
            pool.scheduler.abort(KvpotError(self.broken) if self.broken else None)
        for outbox in self.outboxes:
            outbox.flush()


def _settle(future: Future | None, result=None, error: BaseException | None = None) -> None:
    """Hand a result (or an error) to rank 0's caller; the other ranks have none."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


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
