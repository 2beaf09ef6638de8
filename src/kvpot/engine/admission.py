"""Admission: whether one more request may join a scheduler, decided in one place (issue 43).

A scheduler of `slots` slots and `max_waiting` places in its queue holds at most `slots + max_waiting`
requests at once, waiting or running. A request takes a `Place` before it is queued and gives it back
when it ends. The place is taken by whoever admits first: `Scheduler.submit` itself (a library caller,
`run_all`), or the server's HTTP thread (`kvpot.serve.worker.Worker.admit`) long before the request is
built and submitted on the generation thread, so that a client hears 429 at once rather than after its
prompt was read. Either way the count is this one object's, shared by both threads: hence the lock.

No torch here: the server's HTTP side and the tests use it as plain counting.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvpot.errors import KvpotError


class QueueFull(KvpotError):
    """Every slot is taken and the waiting queue is full: retry later."""


@dataclass(frozen=True)
class AdmissionView:
    """The counts at one moment (metrics, messages): places taken, and of them those beyond the slots."""

    slots: int
    max_waiting: int | None
    taken: int

    @property
    def waiting(self) -> int:
        return max(0, self.taken - self.slots)

    @property
    def running(self) -> int:
        return min(self.taken, self.slots)


class Place:
    """One request's room in an `Admission`; `release` gives it back (once: later calls do nothing, so
    whichever of its holders lets go first frees it)."""

    def __init__(self, admission: Admission):
        self.admission, self.released = admission, False

    def release(self) -> None:
        self.admission.release(self)


class Admission:
    """`slots + max_waiting` places (`max_waiting` None: no limit), taken and released from any thread."""

    def __init__(self, slots: int, max_waiting: int | None = None):
        self.slots, self.max_waiting = slots, max_waiting
        self.taken = 0
        self.lock = threading.Lock()

    @property
    def places(self) -> int | None:
        return None if self.max_waiting is None else self.slots + self.max_waiting

    def has_room(self) -> bool:
        """Whether `take` would give a place now (a caller that would rather wait than catch `QueueFull`)."""
        with self.lock:
            return self.places is None or self.taken < self.places

    def take(self) -> Place:
        """A place, or `QueueFull` saying how full it is."""
        with self.lock:
            if self.places is not None and self.taken >= self.places:
                waiting = self.taken - self.slots
                raise QueueFull(f"all {self.slots} slots are busy and {waiting} requests wait "
                                f"(max_waiting {self.max_waiting}); retry later.")
            self.taken += 1
            return Place(self)

    def view(self) -> AdmissionView:
        with self.lock:
            return AdmissionView(self.slots, self.max_waiting, self.taken)

    def release(self, place: Place) -> None:
        """Give `place` back (a second time does nothing)."""
        with self.lock:
            if not place.released:
                place.released = True
                self.taken -= 1
