"""One sequence through the core: `Engine.generate_ids` as a request in a scheduler of one slot (`runner="core"`).

Issue 43 asks for one decode machine: `generate_ids` run by the same core that serves many users, as a pool of one
slot. `Engine(runner="core")` does that: the prompt is read into the slot in the method's chunks, and every token is
a step of `BatchDecoder` (a bucket of one; captured on a GPU), or, where the batched step cannot take the row (a
method's own attention, InfLLM's and InfiniteHiP's; a steady row's eviction), the one-sequence step on the slot's cache,
captured as `Decoder` captures it (`kvpot.engine.alone`, `kvpot.engine.sequence`); a row whose method reshapes its cache
steps in the engine's forward. The pool has no scratch row (`kvpot.engine.pool`), so it holds what the one-sequence
runner's cache holds. `runner="auto"` (the default, `kvpot.defaults.RUNNER`) takes the core wherever it can
(`core_decodes`), else `Decoder` (`kvpot.engine.decoding`), which `runner="sequence"` names.
`decode="eager"` and a model split over several devices keep the eager path either way.

For a bounded method the scheduler is kept on the engine (`Engine.core`) and serves the next calls of the same
capacity: its pool and its captured steps are made once, where `Decoder` allocates and captures at every call. A
cache that grows with the input gets a scheduler sized for the call, dropped after it (a pool kept at the last
context's size would hold that memory between calls). A stored state is copied into the slot, unless the call may
spend it (`keep_state=False`) and its cache grows with the input: its buffers, grown to the slot's capacity, then are
the slot's (`SlotPool(adopt=...)`), as `Decoder` decodes in them, so the state is not held twice.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from kvpot.engine.requests import Request
from kvpot.engine.results import Result
from kvpot.engine.sampling import _as_ids
from kvpot.errors import Cancelled, KvpotError

RUNNERS = ("auto", "core", "sequence")
# a call's steps by how they ran (`Result.stats.decode`): in the batched step (a bucket of one), as one sequence
# (`kvpot.engine.alone`), in the engine's ordinary forward (a distillation, an eviction over a chunk)
ROWS = ("batched_rows", "sequence_rows", "eager_rows")


def check_runner(runner: str, decode: str) -> str:
    """`runner` if it names one, and can run with `decode` (a clear error if not)."""
    if runner not in RUNNERS:
        raise KvpotError(f"runner must be one of {RUNNERS}, got {runner!r}.")
    if runner == "core" and decode == "eager":
        raise KvpotError("runner='core' decodes in the batched engine's fixed-shape steps; decode='eager' is the "
                         "ordinary forward a token: give decode='auto', 'graph' or 'static' with it.")
    return runner


def core_decodes(engine) -> bool:
    """Whether `engine.generate_ids` runs through the core: `runner="core"` on one device (a model split over several
    decodes eagerly, `Engine._decode`), or `runner="auto"` (the default, `kvpot.defaults.RUNNER`) where the core takes
    it: fixed-shape steps (a GPU's graphs; `decode="static"`), one device, one process, and a cache on the device (an
    offloading method's entries live in host memory, which a pool's slot does not hold: `Decoder` decodes it). A
    batch-invariant pool of one steps its rows as a batch of that engine steps them (`alone.sequence_steps`)."""
    if len(engine.devices) > 1 or engine.runner == "sequence":
        return False
    if engine.runner == "core":
        return True
    from kvpot.engine.decoding import resolve_mode

    return resolve_mode(engine.decode, engine.device) != "eager" and engine.parallel is None and \
        not getattr(engine.method, "offload", False)


def generate_in_core(engine, input_ids, question_ids, state, max_new_tokens: int, on_token, progress: bool,
                     should_stop, time_steps: bool, keep_state: bool = True, **sampling) -> Result:
    """`Engine.generate_ids` (its arguments, checked there) through a `Scheduler` of one slot."""
    from kvpot.engine.offline import group_capacity
    from kvpot.engine.scheduler import Scheduler

    if state is not None:
        engine.check_state(state)
        if state.cache.host_storage:
            raise KvpotError("a state offloaded to host memory (infinitehip offload=True) decodes with "
                             "runner='sequence'.")
    deliver = (lambda request, token: on_token(token)) if on_token is not None else None
    request = Request(input_ids, question_ids, state=state, max_new_tokens=max_new_tokens, on_token=deliver,
                      **sampling)
    question = len(_as_ids(question_ids, torch.device("cpu"), "question_ids"))
    capacity = group_capacity(engine, [request])
    lent = adopted_capacity(engine, state, capacity) if state is not None and not keep_state else None
    if lent is not None:
        scheduler = Scheduler(engine, slots=1, capacity=lent, question_room=question, decode=engine.decode,
                              mix=False, feed_questions="never", adopt=state.cache)
    else:
        scheduler = one_slot_scheduler(engine, capacity, question)
    scheduler.submit(request)
    before = {key: scheduler.report[key] for key in ROWS}
    total = question + (0 if input_ids is None else len(_as_ids(input_ids, torch.device("cpu"), "input_ids")))
    try:
        with tqdm(total=total, unit="tok", desc="prefill", disable=not progress or not total, leave=False) as bar:
            while not request.done:
                if should_stop is not None and should_stop():
                    scheduler.abort()
                    raise Cancelled("stopped: should_stop() said so.")
                scheduler.step()
                left = tokens_left(scheduler)
                if left is not None:
                    bar.update(total - left - bar.n)
    except BaseException:
        engine.core = None  # a scheduler left mid-step is not kept
        raise
    finally:
        if state is not None and not keep_state:
            state.cache = None  # spent, as `Engine._resume(keep=False)` spends it
    if request.status == "failed":
        raise request.exception if request.exception is not None else KvpotError(request.error)
    result = request.result(engine.tokenizer)
    decode = {**(result.stats.decode or {}), "runner": "core"}
    decode.update({key: scheduler.report[key] - before[key] for key in ROWS})  # how its steps ran
    if time_steps:  # the gaps between token deliveries: what the caller waited for each step (host clock)
        times = request.token_times
        decode["step_ms"] = [1000 * (b - a) for a, b in zip(times, times[1:])]
    result.stats.decode = decode
    return result


def adopted_capacity(engine, state, capacity: int) -> int | None:
    """The slot capacity at which a pool of one slot takes spent `state`'s buffers as its own (`SlotPool(adopt=...)`),
    or None where it copies them: for a cache that grows with the input (a bounded one's copy is the method's bound,
    and its kept scheduler has a pool already), in the pool's dtype and on its device, on one process. Its layers grow
    to `capacity` here; the slot takes their whole buffers (its views then contiguous, as allocated), so they must be
    of one size."""
    dtype, device = engine.head.weight.dtype, engine.device
    layers = state.cache.layers
    if engine.method.max_entries() is not None or engine.parallel is not None or any(
            layer.keys.dtype != dtype or layer.keys.device != device for layer in layers):
        return None
    for layer in layers:
        layer.reserve(capacity)
    sizes = {layer.capacity for layer in layers}
    return sizes.pop() if len(sizes) == 1 else None


def one_slot_scheduler(engine, capacity: int | None, question: int):
    """The engine's kept scheduler of one slot where it fits (a bounded method's, of this capacity), else a new one
    (kept where the method is bounded)."""
    from kvpot.engine.slot_sizes import slot_capacity
    from kvpot.engine.scheduler import Scheduler

    bounded = engine.method.max_entries() is not None
    key = (id(engine.method), slot_capacity(engine.method, capacity, question))
    if bounded and engine.core is not None and engine.core[0] == key and engine.core[1].idle:
        return engine.core[1]
    engine.core = None  # (a kept pool of another size goes before the new one is allocated)
    scheduler = Scheduler(engine, slots=1, capacity=capacity, question_room=question, decode=engine.decode,
                          mix=False, feed_questions="never", launch_ahead="auto")
    if bounded:
        engine.core = (key, scheduler)
    return scheduler


def tokens_left(scheduler) -> int | None:
    """Prompt tokens the one request has still to read (None before it has a slot and once it is read)."""
    for active in scheduler.active.values():
        if active.reader is not None:
            return active.reader.remaining
    return None
