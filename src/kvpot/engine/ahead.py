"""A decode-only step launched before the previous step's tokens are handed over (`Scheduler(launch_ahead=...)`).

A step's new tokens reach their requests at the start of the next step (`kvpot.engine.delivery`), and handing them
over waits for the device to finish that step. A step planned and launched after the hand-over leaves the device
idle while the host plans and launches it: on an H100 the copy path's compiled 64-reader step is 16.6 ms of device
work and 17.27 ms a step (records/engine-core-h100/decode-tuning/, call 7). Launched first, a step is queued behind
the one running, and the host hands over the previous step's tokens while the device works.

Only a step whose whole plan is known before the hand-over goes ahead (`ahead_rows`):
- every request holding a slot is decoding or being fed its question: none reads a prompt, none is cancelled, and
  none waits for a slot while one is free (admission and prompts keep the ordinary order);
- every row's step appends in the batched forward, or evicts back to its budget after it ("append", "steady"). A row
  whose method reshapes its cache at this token (InfiniPot's distillation) makes the step wait, so no reshaping runs
  for a request that has just ended.

A row that ends by length at the hand-over is known ahead (its tokens staged) and left out. A row that ends at an
end-of-sequence or stop token is not: it was stepped once more. That step's token is dropped, the row's slot (freed)
held its entry, and the request's stats count the step (one more entry; a steady row's eviction), as
`Engine.generate`'s captured loop, which reads its tokens back every 8 steps, steps up to 7 past its end.
"""

from __future__ import annotations

import torch

from kvpot.defaults import LAUNCH_AHEADS
from kvpot.engine.plan import row_plan
from kvpot.errors import KvpotError


def resolve_launch_ahead(value: bool | str, device: torch.device, parallel: bool) -> bool:
    """`Scheduler(launch_ahead=...)`: True/"on", False/"off", or "auto" (on a CUDA device, where the host and the
    device run apart). Not under tensor parallelism: its ranks run rank 0's plan of each step in lockstep, and a step
    decided before the hand-over on each rank's own counts has not been tested there, so "on" is refused."""
    if not isinstance(value, bool) and value not in LAUNCH_AHEADS:
        raise KvpotError(f"launch_ahead must be one of {LAUNCH_AHEADS} or a bool, got {value!r}.")
    if value == "auto":
        return device.type == "cuda" and not parallel
    if value in (True, "on") and parallel:
        raise KvpotError("launch_ahead='on' under tensor parallelism: its ranks step in lockstep with rank 0's plan; "
                         "use 'auto' or 'off'.")
    return value in (True, "on")


def ahead_rows(scheduler) -> tuple[list, dict[int, str]] | None:
    """This step's decoding rows (slot, active) and their plans, where the step can launch before the previous
    step's tokens are handed over; None where it cannot (the step then runs as usual)."""
    if scheduler.outbox.empty or scheduler.waiting and scheduler.pool.free:
        return None
    staged, rows = scheduler.outbox.staged(), []
    for slot, active in sorted(scheduler.active.items()):
        request = active.request
        fed = active.feeding is not None
        if scheduler.agreement.cancels(request) or request.status != "decoding" and not fed:
            return None
        if not fed and len(request.tokens) + staged.get(request.id, 0) >= request.max_new_tokens:
            continue  # it ends by length at the hand-over
        rows.append((slot, active))
    plans = {slot: row_plan(scheduler, active.run.cache) for slot, active in rows}
    if not rows or "eager" in plans.values():
        return None
    return rows, plans
