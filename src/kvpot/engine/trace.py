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

Off by default (`Scheduler.trace` is a `NoTrace`); `kvpot bench throughput` sets a `StepTrace` for its timed
workload and records its `summary()` in each batch row (`steps`).
"""

from __future__ import annotations

from kvpot.engine.mixed import Chunk

# the scheduler's counts a step record keeps, as the step's own deltas
COUNTS = ("batched_rows", "eager_rows", "riding_rows", "fed_tokens", "mixed_forwards", "prefill_forwards", "forwards")


class NoTrace:
    """The scheduler's default: keeps nothing."""

    def begin(self, report: dict, delivered: float, active: dict) -> None:
        pass

    def end(self, report: dict, chunks: list) -> None:
        pass


class StepTrace:
    """Step records: `begin` after the previous step's tokens are delivered, `end` once this step launched."""

    def __init__(self):
        self.steps: list[dict] = []
        self._open: dict | None = None

    def begin(self, report: dict, delivered: float, active: dict) -> None:
        """`active`: the scheduler's requests by slot, whose runs' compression counts the step's are taken from."""
        compressions = {id(a.run): a.run.stats.compressions for a in active.values() if a.run is not None}
        self._open = {"delivered": delivered, "before": {name: report.get(name, 0) for name in COUNTS},
                      "compressions": compressions}

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
        self.steps.append(record)
        self._open = None

    def summary(self, slowest: int = 10) -> dict:
        """Per kind of step (`kind_of`): count and gap p50 / p99 / max in ms; the `slowest` busy steps with what
        they ran. A step's gap is the time from its start (the previous tokens delivered) to the next delivery; the
        last step has none."""
        steps = []
        for record, following in zip(self.steps, self.steps[1:]):
            gap = (following["delivered"] - record["delivered"]) * 1000
            steps.append({**{k: v for k, v in record.items() if k != "delivered"}, "kind": kind_of(record),
                          "gap_ms": round(gap, 2)})
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
    """Count and gap p50 / p99 / max (ms) of `steps`."""
    gaps = sorted(step["gap_ms"] for step in steps)
    return {"steps": len(gaps), "gap_p50_ms": _quantile(gaps, 0.5), "gap_p99_ms": _quantile(gaps, 0.99),
            "gap_max_ms": gaps[-1]}


def _quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile of sorted `values`."""
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]
