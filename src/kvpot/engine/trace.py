"""What each batched step did and the gap its users saw (`Scheduler.trace`), to find the slow steps.

Issue 43's ITL p99 while prompts are read was 14x its p50 (records/engine-core-h100/varlen/). The scheduler's
counts say how many mixed forwards and prompt forwards a run had, not which steps were slow or why. A trace
keeps, for every step, what it ran: decoding rows, a mixed forward and its prompt tokens, prompt forwards of their
own, rows stepped alone, and the gap the users saw after it.

The gap: a step's tokens reach their requests at the start of the next step (`TokenOutbox`), once the device has
run it. So the gap between two deliveries is what the users decoding waited for that step, host work and device
work together, and it is charged to the step that ran between them. It is wall time on the host: the trace adds
no synchronisation of its own. A step launched ahead of the hand-over (`kvpot.engine.ahead`) opens its record when it is
planned, before the previous step's tokens are delivered: in a run of such steps the gap is still one step's period.

On a CUDA device (`StepTrace.for_device`) each step also gets its device time: an event recorded on the stream where
the step begins and one where its launches end (`DeviceMarks`), read once the run is over. The stream reaches the
first after the work launched before it, so a step's device time runs from the end of the previous step's work to the
end of its own: its work, and any wait inside it for the host's launches; the gap less it is what the device sat idle
between steps. A step launched ahead begins before the previous step's tokens are handed over, so its device time is
still its own.

Off by default (`Scheduler.trace` is a `NoTrace`); `kvpot bench throughput` sets a `StepTrace` for its timed
workload and records its `summary()` in each batch row (`steps`).
"""

from __future__ import annotations

import torch

from kvpot.engine.mixed import Chunk

# the scheduler's counts a step record keeps, as the step's own deltas
COUNTS = ("batched_rows", "eager_rows", "riding_rows", "fed_tokens", "mixed_forwards", "prefill_forwards", "forwards")


class NoTrace:
    """The scheduler's default: keeps nothing."""

    def begin(self, report: dict, delivered: float, active: dict) -> None:
        pass

    def end(self, report: dict, chunks: list) -> None:
        pass


class DeviceMarks:
    """Marks on the current CUDA stream (timing events): where a step begins, where its launches end."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: torch.cuda.Event, stop: torch.cuda.Event) -> float:
        stop.synchronize()  # read after the run: the events are long done, nothing waits
        return start.elapsed_time(stop)


class StepTrace:
    """Step records: `begin` after the previous step's tokens are delivered, `end` once this step launched. With
    `marks` (`DeviceMarks`, or a stand-in with `mark()` and `elapsed_ms(start, stop)`), each step's device time too."""

    def __init__(self, marks=None):
        self.steps: list[dict] = []
        self._open: dict | None = None
        self.marks = marks

    @classmethod
    def for_device(cls, device: torch.device) -> StepTrace:
        """A trace with device times on a CUDA device, without elsewhere."""
        return cls(DeviceMarks() if torch.device(device).type == "cuda" else None)

    def begin(self, report: dict, delivered: float, active: dict) -> None:
        """`active`: the scheduler's requests by slot, whose runs' compression counts the step's are taken from."""
        compressions = {id(a.run): a.run.stats.compressions for a in active.values() if a.run is not None}
        self._open = {"delivered": delivered, "before": {name: report.get(name, 0) for name in COUNTS},
                      "compressions": compressions, "mark": None if self.marks is None else self.marks.mark()}

    def end(self, report: dict, chunks: list[tuple[int, object, Chunk]]) -> None:
        if self._open is None:
            return
        before = self._open.pop("before")
        record = {name: report.get(name, 0) - before[name] for name in COUNTS}
        record["mixed_tokens"] = sum(int(chunk.ids.numel()) for _, _, chunk in chunks)
        # the compressions the mixed chunks' methods ran after this step's forward (InfiniPot's at a pot's fill): their
        # work follows the forward's, so they lengthen the step; a run admitted in this step counts from 0
        seen = self._open.pop("compressions")
        record["compressions"] = sum(chunk.run.stats.compressions - seen.get(id(chunk.run), 0)
                                     for _, _, chunk in chunks)
        # `prefill_forwards` counts prompt chunks read, mixed or not; the forwards of their own are what is left of
        # the step's forwards after its rows stepped alone and its one batched forward (mixed or decoding alone)
        batched = 1 if record["mixed_forwards"] or record["batched_rows"] else 0
        record["apart_forwards"] = record["forwards"] - record["eager_rows"] - batched
        record["delivered"] = self._open["delivered"]
        if self.marks is not None:
            record["marks"] = (self._open["mark"], self.marks.mark())
        self.steps.append(record)
        self._open = None

    def summary(self, slowest: int = 10) -> dict:
        """Per kind of step (`kind_of`): count and gap p50 / p99 / max in ms; the `slowest` busy steps with what
        they ran. A step's gap is the time from its start (the previous tokens delivered) to the next delivery; the
        last step has none."""
        steps = []
        for record, following in zip(self.steps, self.steps[1:]):
            gap = (following["delivered"] - record["delivered"]) * 1000
            step = {**{k: v for k, v in record.items() if k not in ("delivered", "marks")}, "kind": kind_of(record),
                    "gap_ms": round(gap, 2)}
            if "marks" in record:
                step["device_ms"] = round(self.marks.elapsed_ms(*record["marks"]), 2)
            steps.append(step)
        kinds = {}
        for kind in sorted({step["kind"] for step in steps}):
            kinds[kind] = _gaps([step for step in steps if step["kind"] == kind])
            compressing = [step for step in steps if step["kind"] == kind and step.get("compressions")]
            if compressing and kind != "idle":  # the same kind's steps whose chunks compressed, apart
                kinds[kind]["compressing"] = _gaps(compressing)
        # an idle step's gap is the wait for the next arrival (open-loop load), not work: never among the slowest
        busy = [i for i, step in enumerate(steps) if step["kind"] != "idle"]
        order = sorted(busy, key=lambda i: -steps[i]["gap_ms"])[:slowest]
        return {"steps": len(steps), "kinds": kinds, "slowest": [{"step": i, **steps[i]} for i in sorted(order)]}


def kind_of(record: dict) -> str:
    """`decode` (decoding rows alone, one forward), `mixed` (prompt chunks in the decoding rows' forward),
    `apart` (prompt forwards of their own, `apart_forwards`), `mixed+apart` (both); `+eager` where rows stepped
    alone too; `idle`."""
    parts = [name for name, taken in (("mixed", record["mixed_forwards"]), ("apart", record["apart_forwards"]))
             if taken]
    if not parts and record["batched_rows"]:
        parts = ["decode"]
    if record["eager_rows"]:
        parts.append("eager")
    return "+".join(parts) or "idle"


def _gaps(steps: list[dict]) -> dict:
    """Count and gap p50 / p99 / max (ms) of `steps`; their device time's p50 / p99 where the trace took it."""
    gaps = sorted(step["gap_ms"] for step in steps)
    figures = {"steps": len(gaps), "gap_p50_ms": _quantile(gaps, 0.5), "gap_p99_ms": _quantile(gaps, 0.99),
               "gap_max_ms": gaps[-1]}
    device = sorted(step["device_ms"] for step in steps if "device_ms" in step)
    if device:
        figures["device_p50_ms"], figures["device_p99_ms"] = _quantile(device, 0.5), _quantile(device, 0.99)
    return figures


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted `values`."""
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]
