"""Which prompt chunks join a step's forward: a pure decision over host counts (no torch, no model).

The batched scheduler (`kvpot.engine.scheduler`) asks each request still reading its prompt for the next
chunk its method cuts (`kvpot.engine.reading.PromptReader`) and whether that chunk can share a forward
(`kvpot.engine.mixed.mixable`); `plan_chunks` then picks, oldest request first, one chunk per request
within the step's token budget. A method whose result depends on where its forwards end
(`Method.chunk_dependent`) reads exactly the forwards it reads alone: its chunks are never cut to fit. One that
does not (`Candidate.cuttable`) has its chunks capped at the whole budget already (`run.max_chunk`), and the
chunk that does not fit what is left is cut to fill it (vLLM's chunked prefill): a step then reads its whole
budget in the mixed forward, where the rest was read in forwards of their own after it (InfiniPot's pot cuts chunks
short of the budget). On an H200's open loop that took ITL p99 from 116 to 68 ms (records/engine-core-h200/packed-2/).

`row_plan` decides what each decoding row's step does, from the method's host-side counts: append in the batched
step, append and evict back to its budget ("steady": in the step or after it, `kvpot.engine.evict`), or step as the
one-sequence engine does ("eager").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpot.defaults import FEED_QUESTIONS_CHOICES, PROMPT_ORDER, PROMPT_ORDERS, PROMPT_PATIENCE
from kvpot.errors import KvpotError


@dataclass(frozen=True)
class Candidate:
    """A request reading its prompt: its slot, the tokens of its next chunk, whether that chunk can share a
    forward. Candidates are given oldest request first."""

    slot: int
    tokens: int
    mixable: bool = True
    cuttable: bool = False  # the chunk may be read in a shorter forward (the method is not chunk_dependent)
    tail: int = 0  # tokens of the tail probe that rides in the chunk's forward (InfiniPot's catalyst at a pot's fill)
    shared: bool = False  # a shared document's reader (`kvpot.engine.documents`): read apart, it would copy it


@dataclass(frozen=True)
class ChunkPlan:
    slots: tuple[int, ...]  # the requests whose next chunk joins the forward, in order
    budget_left: int  # prompt tokens left for forwards of their own this step
    cut_to: int | None = None  # the last slot's chunk is cut to this many tokens (None: read whole)


def plan_chunks(candidates: list[Candidate], budget: int, decoding: int, max_chunks: int | None = None) -> ChunkPlan:
    """The chunks that join a forward beside `decoding` rows, within `budget` prompt tokens.

    - a chunk costs its tokens and its tail probe's: the probe rides in the forward, so a step of a whole budget
      plus a catalyst would pad to the next token bucket (`kvpot.engine.packed.token_bucket`, 25% more tokens at a
      budget of 1,024: on an H200 the mixed steps whose chunks compressed had a gap p99 of 61.8 ms, 55.4 once the
      catalyst was counted, records/engine-core-h200/packed-4/);
    - oldest first, one chunk per request; the first one is taken whatever its size (a step always
      reads), later ones while they fit what is left; the first that does not fit ends the plan, so
      no younger request passes an older one;
    - except a `cuttable` chunk, which is cut to what is left less its tail and ends the plan, the budget then
      spent, where at least `budget // 16` tokens are left (a sliver is not worth a row: each chunk row costs the
      step a method hook); a first chunk too;
    - a chunk that cannot share a forward ends the plan too (it is read in a forward of its own, with
      what is left of the budget, before any younger request's chunk);
    - mixing pays beside decoding rows, or for two chunks or more: otherwise nothing joins, and the
      whole budget is left; but a shared document's reader mixes even alone (its chunk attends the document only
      in a mixed step);
    - at most `max_chunks` chunks (the packed step's rows, `kvpot.engine.packed_cache.ROWS`, less the rows riding):
      a step of more would run eagerly (64 readers' questions at 32 a step: ~400 ms each on an H100 against ~10 for
      a captured one, records/shared-document-h100/). The rest wait for the next step, none read apart: no budget
      is left.
    """
    if budget < 1:
        raise ValueError(f"budget must be positive, got {budget}.")
    chosen, left, cut = [], budget, None
    for candidate in candidates:
        if not candidate.mixable or left <= 0:
            break
        if max_chunks is not None and len(chosen) >= max_chunks:
            left = 0
            break
        cost = candidate.tokens + candidate.tail
        if cost > left:
            room = left - candidate.tail  # cut short of its pot's fill, a chunk may carry no tail: room kept anyway
            if candidate.cuttable and room >= max(1, budget // 16):
                chosen.append(candidate.slot)
                left, cut = 0, room
            elif not chosen:  # a step always reads
                chosen.append(candidate.slot)
                left -= cost
            break
        chosen.append(candidate.slot)
        left -= cost
    if not decoding and len(chosen) < 2 and not any(c.shared for c in candidates if c.slot in chosen):
        return ChunkPlan((), budget)
    return ChunkPlan(tuple(chosen), left, cut)


# plans of a pool of one's rows that the batched step cannot take: the one-sequence step on the slot's cache
# (`BatchDecoder.sequence_step`), with the method's plan after the dash
SEQUENCE_PLANS = {"sequence-append": "append", "sequence-steady": "steady"}


def row_plan(scheduler, cache) -> str:
    """What a decoding row's step does (`Method.decode_plan`), or "eager" (a forward of its own, or a ride in the
    mixed forward) where the batched step cannot take it: not batching, a method's own attention without the decode
    kernels' positions, an observation the batched step does not compute. A pool of one steps such a row as one
    sequence instead (`SEQUENCE_PLANS`, where `scheduler.sequence_steps`), and so every steady row: D2O's and CaM's
    steady steps so took 1.002x `Decoder`'s, where H2O's and RoCo's in the batched step took 1.03x and 1.13x
    (records/engine-core-h100/sequence-steps/; after the batched step D2O's merges and CaM's run uncaptured).
    Called once a step per row: InfiniteHiP's `decode_plan` advances its refresh schedule."""
    own = cache.attention is not None and not cache.policy.kernel_decoding
    if not scheduler.batched or own:
        return sequence_plan(scheduler.method.decode_plan(cache)) if scheduler.sequence_steps else "eager"
    plan = scheduler.method.decode_plan(cache)
    if plan == "steady" and not scheduler.steady_ok or plan == "append" and not scheduler.append_ok:
        return sequence_plan(plan) if scheduler.sequence_steps else "eager"
    if plan == "steady" and scheduler.sequence_steps:  # its eviction captured at its counts, as `Decoder` does
        return sequence_plan(plan)
    return plan


def sequence_plan(plan: str) -> str:
    return plan if plan == "eager" else f"sequence-{plan}"


def reading_order(active: dict, order: str, now: float = 0.0, patience: float = PROMPT_PATIENCE) -> list:
    """The (slot, Active) pairs reading their prompt, in the order this step plans their chunks and reads them apart:
    `arrival`, oldest first; `shortest`, fewest prompt tokens left first, then oldest (shortest remaining first:
    under load a lower median time to first token, the longest prompts waiting longer; `kvpot.defaults`), except
    that prompts whose request took its slot more than `patience` seconds before `now` go first, oldest first."""
    reading = [(slot, a) for slot, a in active.items() if a.request.status == "prefilling" and a.feeding is None]
    if order == "shortest":
        def key(item):  # a prompt reading has its reader (`kvpot.engine.reading.begin_read`)
            waited = now - item[1].started > patience
            return not waited, 0 if waited else item[1].reader.remaining, item[1].started

        return sorted(reading, key=key)
    return sorted(reading, key=lambda item: item[1].started)


def check_options(prefill_tokens: int, max_waiting: int | None, feed_questions: str, decode: str,
                  invariant: bool = False, prompt_order: str = PROMPT_ORDER,
                  prompt_patience: float = PROMPT_PATIENCE) -> str:
    """The scheduler's options, refused in one sentence each; returns how questions are fed (`invariant`,
    batch-invariant decoding: never, as one request alone reads its question in a forward)."""
    if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) or prefill_tokens < 1:
        raise KvpotError(f"prefill_tokens must be a positive integer, got {prefill_tokens!r}.")
    if max_waiting is not None and max_waiting < 0:
        raise KvpotError(f"max_waiting must be >= 0, got {max_waiting!r}.")
    if prompt_order not in PROMPT_ORDERS:
        raise KvpotError(f"prompt_order must be one of {PROMPT_ORDERS}, got {prompt_order!r}.")
    check_patience(prompt_patience, "prompt_patience")
    if feed_questions not in FEED_QUESTIONS_CHOICES:
        raise KvpotError(f"feed_questions must be 'auto', 'always' or 'never', got {feed_questions!r}.")
    if decode == "eager":
        raise KvpotError("batched decoding runs fixed-shape steps: decode must be 'auto', 'graph' or 'static'.")
    if invariant and feed_questions == "always":
        raise KvpotError("feed_questions='always' under batch-invariant decoding: a question fed token by token "
                         "is read in other sums than alone; use 'auto' or 'never'.")
    return "never" if invariant else feed_questions


def check_patience(patience, name: str) -> None:
    """Refuse a prompt patience that is not a number of seconds >= 0 (`inf`: shortest first, never overtaken); `name`
    is what the caller calls it (the library's argument, the server's flag)."""
    if isinstance(patience, bool) or not isinstance(patience, (int, float)) or not patience >= 0:
        raise KvpotError(f"{name} must be a number of seconds >= 0, got {patience!r}.")
