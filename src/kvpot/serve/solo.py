"""One request at a time, behind the scheduler's surface: the server's pool for a model split over
several GPUs (`--device-map`), whose layers run in turn and which the batched engine refuses.

`step` runs the oldest waiting request from its prompt to its last token with `Engine.generate_ids`
(the engine polls the request's cancel flag before every forward and after every token), so the
requests behind it wait in arrival order, as they did before the server batched.
"""

from __future__ import annotations

import time
from collections import deque

from kvpot.engine.admission import Admission
from kvpot.errors import Cancelled, KvpotError


class _OneSlot:
    slots = 1

    def __init__(self):
        self.free = [0]


class SoloScheduler:
    """`kvpot.engine.Scheduler`'s surface (submit, step, idle, pool) over `Engine.generate_ids`."""

    def __init__(self, engine, max_waiting: int | None = None):
        self.engine, self.method = engine, engine.method
        self.pool = _OneSlot()
        self.admission = Admission(1, max_waiting)  # as `Scheduler.admission`: one slot
        self.places: dict = {}  # request id -> its place, given back when it ends
        self.capacity = engine.method.max_entries() or 0
        self.waiting: deque = deque()
        self.active: dict = {}
        self.report = {"batched_rows": 0, "eager_rows": 0}

    def slot_bytes(self) -> int:
        return 0  # a split model's cache lives on several devices and is made per request

    @property
    def idle(self) -> bool:
        return not self.waiting

    @property
    def decoding(self) -> int:
        return len(self.active)

    @property
    def prefilling(self) -> int:
        return 0

    def submit(self, request, place=None, admitted: bool = False):
        """`Scheduler.submit`: a place taken here unless the caller holds one (`place`) or admitted it elsewhere."""
        if request.state is not None:
            self.engine.check_state(request.state)
        if place is None and not admitted:
            place = self.admission.take()
        if place is not None:
            self.places[request.id] = place
        request.submitted = time.perf_counter()
        self.waiting.append(request)
        return request

    def step(self) -> list:
        request = self.waiting.popleft()
        if request.cancel_requested:
            return [self._end(request, "cancelled", "cancelled")]
        request.status, request.slot = "prefilling", 0
        self.pool.free, self.active = [], {0: request}

        def on_token(token: int) -> None:
            request.status = "decoding"
            now = time.perf_counter()
            request.tokens.append(token)
            request.token_times.append(now)
            request.first_token_time = request.first_token_time or now
            if request.on_token is not None:
                request.on_token(request, token)

        try:
            result = self.engine.generate_ids(
                request.context_ids, request.question_ids, request.max_new_tokens, state=request.state,
                on_token=on_token, temperature=request.temperature, top_p=request.top_p, seed=request.seed,
                ignore_eos=request.ignore_eos, should_stop=lambda: request.cancel_requested)
        except Cancelled:
            return [self._end(request, "cancelled", "cancelled")]
        except Exception as err:  # noqa: BLE001 - one request's failure is its own
            request.error = str(err) if isinstance(err, KvpotError) else f"{type(err).__name__}: {err}"
            return [self._end(request, "failed", "error")]
        request.stats = result.stats
        full = len(request.tokens) >= request.max_new_tokens
        return [self._end(request, "finished", "length" if full else "stop")]

    def abort(self, error: Exception | None = None) -> list:
        """End every waiting request now (`Scheduler.abort`): failed with `error`, or cancelled."""
        ended: list = []
        while self.waiting:
            request = self.waiting.popleft()
            if error is None:
                self._end(request, "cancelled", "cancelled", ended)
            else:
                request.error = str(error)
                self._end(request, "failed", "error", ended)
        return ended

    def _end(self, request, status: str, reason: str, ended: list | None = None):
        request.status, request.finish_reason = status, reason
        request.finished_time = time.perf_counter()
        self.pool.free, self.active = [0], {}
        place = self.places.pop(request.id, None)
        if place is not None:
            place.release()
        if request.on_finish is not None:
            request.on_finish(request)
        if ended is not None:
            ended.append(request)
        return request
