"""New tokens on their way from the device to their requests, handed over one step late.

A step copies its new tokens towards the host without waiting for them (`stage`); they are handed
over at the start of the next step (`drain`), so the device works on this step's remaining forwards
while the host returns, delivers and launches the next one: one synchronisation per step, none per token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch


class TokenOutbox:
    def __init__(self):
        self.pending: list[tuple] = []  # (slots, requests, tokens, event), delivered next step

    @property
    def empty(self) -> bool:
        return not self.pending

    def stage(self, slots: list[int], requests: list, last_token: torch.Tensor, device: torch.device) -> None:
        """The tokens `last_token[slots]` for `requests`, copied towards the host without a wait."""
        if not slots:
            return
        at = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
        tokens = last_token[at]
        event = None
        if tokens.is_cuda:
            tokens = tokens.to("cpu", non_blocking=True)  # pinned by torch for a non-blocking copy
            event = torch.cuda.Event()
            event.record()
        self.pending.append((slots, requests, tokens, event))

    def take(self) -> list[tuple]:
        """The staged steps, no longer staged: a step launched ahead (`kvpot.engine.ahead`) hands over only these."""
        pending, self.pending = self.pending, []
        return pending

    def staged(self) -> dict[int, int]:
        """Request id -> its tokens staged, not handed over yet."""
        counts: dict[int, int] = {}
        for _, requests, _, _ in self.pending:
            for request in requests:
                counts[request.id] = counts.get(request.id, 0) + 1
        return counts

    def drain(self, pending: list[tuple] | None = None) -> Iterator[tuple[int, object, int, float]]:
        """(slot, request, token, when) of every staged token (or of `pending`, from `take`), oldest step first."""
        for slots, requests, tokens, event in self.take() if pending is None else pending:
            if event is not None:
                event.synchronize()
            now = time.perf_counter()
            for slot, request, token in zip(slots, requests, tokens.tolist()):
                yield slot, request, token, now


def hand_over(scheduler, active, request, token: int, now: float, ended: list) -> None:
    """One delivered token to its request (`Scheduler._deliver`): `on_token`, then an end at an
    end-of-sequence or stop token or at `max_new_tokens` (which frees the slot at once)."""
    request.tokens.append(token)
    request.token_times.append(now)
    if request.first_token_time is None:
        request.first_token_time = now
    if request.on_token is not None:
        try:
            request.on_token(request, token)
        except Exception as err:  # noqa: BLE001 - a consumer's error ends its own request only
            scheduler._fail(request, err, ended)
            return
    if token in active.eos:
        scheduler._end(request, "finished", "stop", ended)
    elif len(request.tokens) >= request.max_new_tokens:
        scheduler._end(request, "finished", "length", ended)
