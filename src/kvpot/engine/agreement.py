"""The batched scheduler under tensor parallelism: every rank runs the same plan, step after step.

Each rank runs its own `Scheduler` over its own slots (its KV heads), and every step's forwards hold
collectives: if two ranks admitted different requests, or decoded different rows, they would wait for each
other forever or mix two users' activations. Two designs were possible: rank 0 plans each step and ships the
plan (admissions, rows per plan, chunks, evictions), or every rank plans from the same inputs. kvpot does the
second, with rank 0 owning the inputs:

- a step's plan is a pure function of the scheduler's state: the queue's order, which slots are free, each
  slot's cache lengths (equal on every rank: selections that span heads gather every rank's scores,
  `kvpot.models.parallel.all_heads`), the tokens (rank 0's, broadcast after every pick) and the options. Nothing in
  it reads a random number that a rank draws alone, nor a rank's own clock: the one time it reads, for the prompt
  order's patience (`kvpot.engine.plan.reading_order`: when a request took its slot, and now), is rank 0's, sent
  with the step (`StepInputs.clock`; two ranks reading their own could order a step's prompts differently as one
  crosses its patience);
- what comes from outside is the only thing that can differ: requests submitted (a server receives them on
  rank 0 only) and cancellations (set by another thread at any time). So at the start of every step rank 0
  broadcasts them, one small pickled object (`StepInputs`), and every rank applies the same ones at the
  same step boundary: a cancellation flagged on rank 0 while a step runs counts from the next step on every
  rank, never on rank 0 alone.

Shipping the plan instead would send the same facts plus the structure the scheduler derives from them, and
would need a second code path that executes a received plan. Requests a rank submitted itself (offline
`generate_batch`, where every rank builds the same list) are matched to rank 0's by order and checked by
their token ids; a rank without them (a server's other ranks, in `follow`) builds them from what
rank 0 sent. A request that answers from a stored `state` cannot be sent (each rank holds its own heads of
it): every rank must submit it itself.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from kvpot.engine.requests import Request
from kvpot.errors import KvpotError

# the fields of a request another rank needs to run it exactly as rank 0 does (callbacks stay on rank 0)
FIELDS = ("max_new_tokens", "temperature", "top_p", "seed", "ignore_eos", "stop_token_ids")


@dataclass
class StepInputs:
    """What rank 0 tells every rank before a step: new requests (in queue order) and cancellations."""

    new: list[tuple[int, str, dict | None]] = field(default_factory=list)  # (number, digest, payload)
    cancel: list[int] = field(default_factory=list)  # numbers of requests to cancel at this boundary
    stop: bool = False  # rank 0's server is stopping: followers leave `follow`
    clock: float = 0.0  # rank 0's time.perf_counter() at this step: the step's clock on every rank


def digest(request: Request) -> str:
    """The request's inputs as a short hash: ranks that submitted requests themselves must agree on them."""
    h = hashlib.sha256()
    for ids in (request.context_ids, request.question_ids):
        values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        h.update(repr(None if values is None else list(values)).encode())
    h.update(repr([getattr(request, name) for name in FIELDS]).encode())
    h.update(b"state" if request.state is not None else b"-")
    return h.hexdigest()[:16]


def payload(request: Request) -> dict | None:
    """What another rank needs to build `request`; None for a request on a stored state (not sendable)."""
    if request.state is not None:
        return None
    ids = {name: (v.tolist() if isinstance(v, torch.Tensor) else (None if v is None else list(v)))
           for name, v in (("context_ids", request.context_ids), ("question_ids", request.question_ids))}
    return {**ids, **{name: getattr(request, name) for name in FIELDS}}


class Alone:
    """A scheduler without tensor parallelism: nothing to agree on, a cancellation counts when it is flagged."""

    clock = 0.0  # the step's time (`time.perf_counter()` at its start): what the step's plan reads as now

    def agree(self, scheduler, stop: bool = False) -> bool:
        self.clock = time.perf_counter()
        return True

    def cancels(self, request: Request) -> bool:
        return request.cancel_requested


class StepAgreement:
    """One rank's side of the per-step exchange (`Scheduler.step` calls `agree` first)."""

    @classmethod
    def of(cls, engine) -> StepAgreement | Alone:
        return cls(engine.parallel) if engine.parallel is not None else Alone()

    def __init__(self, parallel):
        self.parallel = parallel
        # rank 0 sends what other ranks need to build its new requests; off where every rank submits each
        # request itself (a tensor-parallel server: kvpot.serve.parallel), which the digests then check
        self.payloads = True
        self.agreed = False  # `follow` agreed on the coming step already (to see rank 0's stop first)
        self.count = 0  # requests announced so far (their numbers, in order)
        self.numbers: dict[int, int] = {}  # id(request) -> its number, for the live ones
        self.requests: dict[int, Request] = {}  # number -> request
        self.cancelled: set[int] = set()  # id(request) of those cancelled at an agreed boundary
        self.clock = 0.0  # the step's time, rank 0's (`StepInputs.clock`)

    def cancels(self, request: Request) -> bool:
        """Whether `request` is cancelled as of the current step (on every rank alike)."""
        return id(request) in self.cancelled

    def agree(self, scheduler, stop: bool = False) -> bool:
        """Exchange this step's inputs; False when rank 0 said stop (a follower leaves its loop)."""
        if self.agreed:
            self.agreed = False
            return True
        self._forget_done()
        mine = StepInputs(stop=stop, clock=time.perf_counter()) if self.parallel.rank == 0 else None
        if mine is not None:
            mine.new = [self._announce(r) for r in scheduler.waiting if id(r) not in self.numbers]
            mine.cancel = sorted(n for n, r in self.requests.items() if r.cancel_requested and not r.done)
        inputs = self.parallel.broadcast_object(mine)
        if inputs.stop:
            return False
        self.clock = inputs.clock
        if self.parallel.rank != 0:
            self._receive(scheduler, inputs.new)
        self.cancelled.update(id(self.requests[n]) for n in inputs.cancel if n in self.requests)
        return True

    def _announce(self, request: Request) -> tuple[int, str, dict | None]:
        number = self._track(request)
        return number, digest(request), payload(request) if self.payloads else None

    def _track(self, request: Request) -> int:
        number, self.count = self.count, self.count + 1
        self.numbers[id(request)], self.requests[number] = number, request
        return number

    def _receive(self, scheduler, new: list[tuple[int, str, dict | None]]) -> None:
        """Match rank 0's new requests to ours by order (checking their digests), or build the missing ones."""
        own = [r for r in scheduler.waiting if id(r) not in self.numbers]
        for index, (number, expected, sent) in enumerate(new):
            if index < len(own):
                if digest(own[index]) != expected:
                    raise KvpotError(f"rank {self.parallel.rank} submitted a request that differs from rank 0's "
                                     f"request {number}: under tensor parallelism every rank submits the same "
                                     "requests in the same order (or only rank 0 does).")
                self._track(own[index])
                continue
            if sent is None:
                raise KvpotError(f"rank {self.parallel.rank} lacks rank 0's request {number}: a request on a stored "
                                 "state (each rank holds its own heads of it), or any request where rank 0 sends no "
                                 "payloads, must be submitted on every rank itself.")
            request = Request(**sent)
            request.submitted = 0.0
            scheduler.waiting.append(request)
            self._track(request)
        if len(own) > len(new):
            raise KvpotError(f"rank {self.parallel.rank} submitted {len(own) - len(new)} request(s) rank 0 did "
                             "not: under tensor parallelism rank 0's requests decide.")

    def _forget_done(self) -> None:
        for number in [n for n, r in self.requests.items() if r.done]:
            request = self.requests.pop(number)
            self.numbers.pop(id(request), None)
            self.cancelled.discard(id(request))


def follow(scheduler) -> None:
    """A rank other than 0: run rank 0's steps (its requests arrive with them) until rank 0 calls `release`.
    Rank 0's server drives `Scheduler.step`; this is the other ranks' loop."""
    agreement = scheduler.agreement
    if not isinstance(agreement, StepAgreement) or agreement.parallel.rank == 0:
        raise KvpotError("follow is for the ranks other than 0 of a tensor-parallel engine's scheduler.")
    while agreement.agree(scheduler):
        agreement.agreed = True  # the step below must not exchange again
        scheduler.step()


def release(scheduler) -> None:
    """Rank 0: tell the other ranks' `follow` loops to return (a server stopping)."""
    agreement = scheduler.agreement
    if isinstance(agreement, StepAgreement) and agreement.parallel.rank == 0:
        agreement.agree(scheduler, stop=True)
