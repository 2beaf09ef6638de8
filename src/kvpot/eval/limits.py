"""Stopping `kvpot eval` on time, and surviving being stopped: `--time-limit`, SIGTERM, partial files.

A GPU machine that lets one command run ten minutes ends a process that runs longer, and what it has
not written is lost. So a run is given a time limit: before each step (a group of samples, one kvpress
answer) it asks whether the longest step so far still fits before the deadline, with `reserve` seconds
left over for what follows (converting kvpress answers, writing the summary and plots); if not, it
stops starting steps and finishes normally. A SIGTERM (`timeout`, a scheduler) raises `Interrupted`
into the same finishing path; rows being written when it arrives are written first (`Terminate.held`).

Only the standard library: the kvpress worker (kvpress' own interpreter) imports this module too.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

FINISH_SECONDS = 10.0  # kept free at the end of a limited run: kvpress rows, summary, tables, plots


def _now() -> float:
    return time.monotonic()


class Interrupted(BaseException):
    """SIGTERM arrived; a BaseException so no `except Exception` on the way swallows it."""


class Deadline:
    """`seconds` from now (None: no limit); `allows()` says whether one more step fits."""

    def __init__(self, seconds: float | None, reserve: float = 0.0):
        self.end = None if seconds is None else _now() + seconds
        self.reserve = reserve
        self.longest = 0.0  # seconds of the longest step so far: the estimate of the next one
        self.reached = False

    def remaining(self) -> float | None:
        return None if self.end is None else self.end - _now()

    def allows(self) -> bool:
        if self.end is None:
            return True
        if self.remaining() <= self.longest + self.reserve:
            self.reached = True
        return not self.reached

    @contextmanager
    def step(self):
        began = _now()
        yield
        self.longest = max(self.longest, _now() - began)


class Terminate:
    """While `installed()`, the first SIGTERM raises `Interrupted` (deferred to the end of a `held()`
    block); later ones are ignored, since the process is already finishing."""

    def __init__(self):
        self.received = False
        self._held = 0
        self._pending = False

    @contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers belong to the main thread; elsewhere SIGTERM keeps its default
            return
        previous = signal.signal(signal.SIGTERM, self._handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _handle(self, signum, frame) -> None:
        if self.received:
            return
        self.received = True
        if self._held:
            self._pending = True
            return
        raise Interrupted()

    @contextmanager
    def held(self):
        """A block SIGTERM does not cut (writing a group's rows: a half-written line would spoil the file)."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self._pending:
            self._pending = False
            raise Interrupted()


def read_jsonl(path: Path, repair: bool = False) -> list[dict]:
    """The JSON lines of `path` ([] if absent). A killed writer may leave a last line cut short: it is
    dropped, and with `repair` cut from the file, so lines appended later start on a line of their own."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    rows, good = [], 0  # good: bytes up to the end of the last whole line
    for line in data.splitlines(keepends=True):
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            row = False
        if row is False or not line.endswith(b"\n"):
            break  # only the last line can be cut short; what follows a broken line is not trusted
        if row is not None:
            rows.append(row)
        good += len(line)
    if repair and good < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(good)
    return rows
