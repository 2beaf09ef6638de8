"""The rows a scheduler's batched step does not take: each steps alone, before the step's forward.

- A row whose method reshapes its cache at this token (InfiniPot's distillation, CItruS' chunk eviction) or that the
  batched step cannot take in a larger pool ("eager", `kvpot.engine.plan.row_plan`): the one-sequence engine's forward
  on its slot (`BatchDecoder.eager_step`), or, where prompts mix, a one-token chunk riding in the mixed forward.
- In a pool of one (`Engine(runner="core")`), a row the batched step cannot take (a method's own attention, InfLLM's
  and InfiniteHiP's; an observation or per-token work without a batched form) and every steady row (its eviction at
  its counts: StreamingLLM, H2O, TOVA, RoCo, D2O's merges, CaM): the one-sequence fixed-shape step on its slot's cache,
  captured as `Decoder` captures it (`BatchDecoder.sequence_step`, `kvpot.engine.sequence`; plans `SEQUENCE_PLANS`).
"""

from __future__ import annotations

from kvpot.engine.mixed import Chunk, mixable
from kvpot.engine.plan import SEQUENCE_PLANS, row_plan


def sequence_steps(scheduler) -> bool:
    """Whether the scheduler steps its rows that the batched step cannot take as one sequence: a pool of one (no
    scratch row), where a RoPE table can be sized ahead (dynamic frequencies without stored rotations step eagerly,
    as `Decoder` steps them). Not batch-invariant: a batch of that engine steps such rows eagerly (own attention)
    or in the batched step (steady rows), and one request alone must run the same forwards to get its tokens."""
    engine = scheduler.engine
    return scheduler.pool.scratch is None and not engine.batch_invariant and \
        not (engine.rope.dynamic and not scheduler.pool.policy.stores_rotated)


def decode_alone(scheduler, ended: list) -> tuple[list, list[int], list]:
    """The decoding rows (fed questions included): those whose method reshapes the cache at this token step alone,
    or where mixing is on ride in the mixed forward as a one-token chunk (alone: 85-272 ms on an H200,
    engine-core-h200/packed-4/), and a pool of one's rows the batched step cannot take step as one sequence; returns
    the others (the batch), the slots stepped, the riders (slot, active, chunk)."""
    decoding = [(slot, a) for slot, a in sorted(scheduler.active.items())
                if a.request.status == "decoding" or a.feeding is not None]
    plans = scheduler._prepare_rows(decoding, {slot: row_plan(scheduler, a.run.cache) for slot, a in decoding})
    decoding, stepped = step_sequences(scheduler, decoding, ended)
    rides, report, decoder = [], scheduler.report, scheduler.decoder
    for slot, active in decoding:
        if plans[slot] == "eager" and scheduler.mix and scheduler.rides and mixable(scheduler.method, active.run):
            rides.append((slot, active, Chunk(active.run, *decoder.ride(slot, active.run))))
        elif plans[slot] == "eager":
            try:
                decoder.eager_step(slot, active.run)
                report["eager_rows"] += 1
                report["forwards"] += 1
                stepped.append(slot)
            except Exception as err:  # noqa: BLE001 - this row's own forward: it fails alone
                scheduler._fail(active.request, err, ended)
    return [(slot, active) for slot, active in decoding if plans[slot] != "eager"], stepped, rides


def step_sequences(scheduler, rows: list, ended: list) -> tuple[list, list[int]]:
    """Each of `rows` (slot, active) whose plan is a one-sequence step (`SEQUENCE_PLANS`) steps so; returns the other
    rows and the slots stepped. The host's mirror of the run: its next position, a steady step's compression."""
    others, stepped = [], []
    for slot, active in rows:
        plan = SEQUENCE_PLANS.get(active.plan)
        if plan is None:
            others.append((slot, active))
            continue
        try:
            scheduler.decoder.sequence_step(slot, active.run, plan)
        except Exception as err:  # noqa: BLE001 - this row's own forward: it fails alone
            scheduler._fail(active.request, err, ended)
            continue
        active.run.next_position += 1
        active.run.stats.compressions += plan == "steady"
        scheduler.report["sequence_rows"] += 1
        scheduler.report["forwards"] += 1
        stepped.append(slot)
    return others, stepped
