"""The server's generation thread as a loop of turns, and the same turns on every rank under tensor parallelism.

One turn (`Turn`), planned before any of it runs:

1. the commands that arrived, in arrival order;
2. one step of every pool that had work when the turn was planned: one batched decode step for all
   its decoding requests, then new requests' prompts read within the step's token budget
   (`--prefill-tokens`);
3. one forward of the oldest text being read (documents are read between decode steps, so the
   users already decoding keep streaming while a long document is read), or its end if its client left;
4. if nothing is left, sleep until something arrives (at most a second).

Commands are names and picklable arguments (`handlers[name](*args, local=...)`), not closures, because
under tensor parallelism (`kvpot serve --tp N`, `kvpot.serve.parallel`) rank 0 sends each turn to the other
ranks (`TurnExchange`) before running it, and they run the same turn: the same commands, steps and forwards
in the same order. What only rank 0 has (a ticket, the callbacks that stream tokens to a client) travels
beside a command as its `local` part and is None elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from kvpot.errors import Cancelled, KvpotError
from kvpot.serve.protocol import ApiError

log = logging.getLogger("kvpot.serve")


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
class Read:
    """A text being read into a state, one forward per turn (`Worker.read`)."""

    steps: Iterator[int] | None = None
    future: Future | None = None
    ticket: object = None  # kvpot.serve.worker.Ticket (rank 0)
    then: tuple | None = None  # (handler name, args): run with the state when the read is done
    then_local: object = None
    stopped: bool = False  # the turn said stop: the engine's `should_stop` sees it (the same on every rank)


class TurnExchange:
    """Rank 0's turns to every rank: `broadcast_object_list` over a gloo group spanning the torchrun (objects
    never go through NCCL); `timeout` bounds the wait for a rank that died or hung."""

    def __init__(self, group, rank: int):
        self.group, self.rank = group, rank

    @classmethod
    def of(cls, engine, timeout: float) -> TurnExchange:
        """The exchange of `engine`'s tensor-parallel ranks (every rank must call this, in the same order): the
        process's gloo group, which the scheduler's step agreement shares (`kvpot.models.parallel.host_group`)."""
        from kvpot.models.parallel import host_group

        return cls(host_group(timeout), engine.parallel.rank)

    def turn(self, sent: dict | None) -> dict:
        """Rank 0's `sent` on every rank (the other ranks pass None); raises when a rank is gone."""
        import torch.distributed as dist

        box = [sent]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def rank_directory(directory: Path | None, parallel) -> Path | None:
    """Where this rank keeps its stored states: `directory` alone, a subfolder of it per rank under tensor
    parallelism (each rank's files hold its own KV heads, under the same names)."""
    if directory is None or parallel is None:
        return directory
    path = Path(directory) / f"tp{parallel.size}-rank{parallel.rank}"
    path.mkdir(parents=True, exist_ok=True)
    return path


class TurnLoop:
    """The generation thread's loop (`kvpot.serve.worker.Worker` holds the queues, pools and handlers)."""

    def follow(self) -> None:
        """A rank other than 0 under tensor parallelism: run rank 0's turns on this thread until it stops.
        Raises when this rank falls out of step (rank 0 gone, a step that broke here alone)."""
        self._loop()

    def _loop(self) -> None:
        trace = None if self.follower else Trace.open()  # rank 0's turns only: the others run the same
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

    def _step(self, pool) -> None:
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
        read = Read(future=future, ticket=ticket, then=then, then_local=then_local)
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
            settle(read.future, error=read.ticket.cancelled_error() if read.ticket is not None else None)
        except Exception as err:  # noqa: BLE001 - handed to the awaiting request
            settle(read.future, error=err)
        self.reads.popleft()

    def _finish_read(self, read: Read, state) -> None:
        """A read's state to its `then` handler, in the turn the read ends (on every rank alike)."""
        result = None
        if read.then is not None:
            name, args = read.then
            try:
                result = self.handlers[name](state, *args, local=read.then_local)
            except Exception as err:  # noqa: BLE001 - handed to the awaiting request
                settle(read.future, error=err)
                return
        settle(read.future, (state, result))

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


def settle(future: Future | None, result=None, error: BaseException | None = None) -> None:
    """Hand a result (or an error) to rank 0's caller; the other ranks have none."""
    if future is None or future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Trace:
    """One JSON line per busy turn of the generation thread (`KVPOT_SERVE_TRACE=FILE`): when it began,
    the calls it ran and each phase's seconds, and each pool's counts; for finding where latency goes."""

    def __init__(self, path: str):
        self.file, self.zero = open(path, "a", buffering=1), time.perf_counter()  # noqa: SIM115 - lives with the thread

    @classmethod
    def open(cls) -> Trace | None:
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
