"""The fixed-shape step of one sequence over its own `PotCache`, and the host's mirror of what a replay of it did.

Two runners take it: `Decoder` (`kvpot.engine.decoding`, `runner="sequence"`) over a run's cache, and, for a pool
of one slot, `BatchDecoder.sequence_step` (`kvpot.engine.batch`, `runner="core"`) over the slot's cache where the
batched step cannot take the row: a method's own attention (InfLLM's block lookup, InfiniteHiP's pruning stages and
their `decode_key` forms), an observation or per-token work without a batched form, and every steady row (its
eviction captured at its counts). The body reads and writes only static buffers and device-side
counts (`PotLayer.length`, `slot`, `query_position`), so `StepGraphs` captures it once per key (`step_key`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from kvpot.compat import cache_kwargs
from kvpot.methods.base import Step


def prepare_static(cache, capacity: int, max_position: int, observes: bool) -> None:
    """Every layer of `cache` at `capacity` entries, with its device-side counts set from the host's, an observation
    buffer where the method observes, and the RoPE table sized for the whole decode (no step, and no capture, grows
    it)."""
    for layer in cache.layers:
        layer.reserve(capacity)
        layer.enter_static()
        if observes and (getattr(layer, "probs", None) is None or layer.probs.shape[-1] != layer.capacity):
            storage = getattr(layer, "storage", None)  # a pool's slot observes into the pool's buffer (no new memory)
            layer.probs = storage.observation_buffer()[layer.row] if storage is not None else torch.zeros(
                layer.kv_heads, layer.capacity, dtype=torch.float32, device=layer.device)
    layer0 = cache.layers[0]
    # on the layer's device (offloaded buffers are on the host)
    like = torch.empty(0, layer0.head_dim, dtype=layer0.dtype, device=layer0.device)
    cache.rope.table(max(capacity, max_position) + 1, like)


def observes(method) -> bool:
    """Whether a step of `method` may record an observation (`Method.decode_request`)."""
    return any(method.decode_request(plan) is not None for plan in ("append", "steady"))


def sequence_body(engine, cache, plan: str, token: torch.Tensor, position: torch.Tensor, logits: torch.Tensor,
                  zero: torch.Tensor, max_position: int, pick: Callable[[torch.Tensor], None]) -> None:
    """One fixed-shape step (the body of a captured graph): `token` [1] read at stream position `position` [1], its
    method's work ("append", or "steady": its eviction at these counts), `logits` [vocab] (the last step's, which
    scored `token`) replaced by the step's, `pick(logits)` writes the next token, `position` advanced. Its parts are
    profiler scopes (`kvpot.bench.breakdown`); a scope is host-side only: a captured graph replays none of it."""
    method = engine.method
    cache.static = True
    try:
        cache.begin_forward(position, max_position, method.decode_request(plan))
        with engine.single_row():
            with record_function("kvpot.step.decoder"):
                hidden = engine.step_decoder()(input_ids=token.view(1, 1), position_ids=zero, use_cache=True,
                                               kvpot_cache=cache, **cache_kwargs(engine.decoder, cache)).last_hidden_state[0]
            with record_function("kvpot.step.head"):
                fresh = engine.head(hidden[-1]).float()
        with record_function("kvpot.step.method"):
            nll = F.cross_entropy(logits.view(1, -1), token.view(1)) if method.needs_token_nll else None
            step = Step("decode", 1, segment_end=True, token_nll=None if nll is None else nll.view(1))
            if plan == "append":
                method.decode_append(cache, step)
            else:
                appended = cache.lengths()
                method.after_forward(cache, step)
                settle_lengths(cache.layers, appended)
    finally:
        cache.static = False
        cache.begin_forward(None, -1, None)
    with record_function("kvpot.step.sample"):
        logits.copy_(fresh)
        pick(fresh)
        position.add_(1)


def settle_lengths(layers, appended: list[int]) -> None:
    """The device-side counts after a steady step's eviction (`appended`: the host counts before it): where
    every layer dropped exactly one entry, one `_foreach_sub_` for all layers (one launch, not one per layer:
    the device count, incremented by the append, goes back by one); else each set from its host count."""
    if all(layer.n == n - 1 for layer, n in zip(layers, appended)):
        torch._foreach_sub_([layer.length for layer in layers], 1)
        return
    for layer in layers:
        layer.length.fill_(layer.n)


# ------------------------------------------------------------------ the host's side of a captured step
def step_key(method, cache, plan: str) -> tuple:
    """A step's graph key: an append step serves every length; a steady step is captured at its counts; a method
    may capture one step in several forms (InfiniteHiP: which pruning stages it recomputes)."""
    key = (plan,) if plan == "append" else (plan, tuple(cache.lengths()))
    return key + tuple(method.decode_key(cache))


def host_counts(cache) -> list[tuple[int, int, int]]:
    return [(layer.n, layer.n_new, layer.max_rope) for layer in cache.layers]


def set_host_counts(cache, counts) -> None:
    for layer, (n, n_new, max_rope) in zip(cache.layers, counts):
        layer.set_counts(n, max_rope, n_new)


def counting_capture(cache) -> Callable[[Callable[[], None]], list]:
    """`StepGraphs.run`'s `around`: capture, and keep the counts the step ends at (a steady step's effect); capture
    only recorded the step, so the counts go back to what they were."""
    def around(capture: Callable[[], None]) -> list:
        before = host_counts(cache)
        capture()
        effect = host_counts(cache)
        set_host_counts(cache, before)
        return effect

    return around


def mirror_replay(cache, plan: str, effect) -> None:
    """The host mirror of what a replay did to the counts."""
    if plan == "append":
        for layer in cache.layers:
            layer.mirror_append(1)
            cache.note_entries(layer.n)
    else:  # steady: back to the counts it was captured at
        set_host_counts(cache, effect)
