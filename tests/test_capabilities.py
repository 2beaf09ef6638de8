"""Every method's declared capabilities (`Method.chunk_dependent`, `evicts_while_decoding`, `merges`, `grows`)
against what it does on a tiny model.

The methods are enumerated from the registry the spec parser builds methods from (`kvpot.methods.METHODS`,
through `make_method`), so a method added there is checked here too, and fails until it has tiny
parameters below and declares every capability in its own class body.

Each check can fail both ways: a capability declared True must show, one declared False must not.
- chunk_dependent: the prompt read as `next_chunk` cuts it, and again with every forward capped at 5
  tokens (the scheduler's cap), leaves the same kept entries and logits (within float rounding) exactly
  when the method declares it chunk-independent;
- evicts_while_decoding: some decoding step does more than append its token (an entry leaves, or the
  token itself does) exactly when declared;
- merges: some kept value row is none of the value rows the model wrote (a merged one) exactly when declared;
- grows: declared True, the method has no bound and holds more entries for a longer input (twice the
  context and the generated tokens); declared False, it has a bound and never exceeds it (`entries_needed`:
  the bound plus what a run adds on top, CItruS' instruction while it is probed).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.cache import PotLayer
from kvpot.methods import METHODS, make_method

CAPABILITIES = ("chunk_dependent", "evicts_while_decoding", "merges", "grows")
CONTEXT, QUESTION, NEW, CUT = 96, 6, 24, 5

# Small enough that every method evicts (or prunes) many times within CONTEXT + QUESTION + NEW tokens.
TINY = {
    "full": dict(chunk_size=8),
    "truncate": dict(budget=32, chunk_size=8),
    "streaming": dict(sinks=2, window=14, chunk_size=8),
    "h2o": dict(heavy=8, recent=8, chunk_size=8),
    "tova": dict(budget=16, chunk_size=8),
    "snapkv": dict(budget=16, window=4, kernel=3, chunk_size=8),
    "pyramidkv": dict(budget=16, window=4, kernel=3, chunk_size=8),
    "infinipot": dict(pot_size=24, compress_size=12, catalyst="question"),
    "citrus": dict(keep=12, chunk_size=6),
    "d2o": dict(budget=16, chunk_size=8),
    "infinitehip": dict(chunks=(8, 4), keep=(16, 8), early_keep=8, early_layers=1, sink=4, window=8, query_block=4,
                        refresh=(2, 1), chunk_size=16, kernels="torch"),
    "sirllm": dict(pot_size=24, compress_size=12, sinks=2),
    "cam": dict(start=4, recent=12, merge_budget=4, chunk_size=8),
    "scissorhands": dict(budget=16, drop=6, history=6, recent=2, chunk_size=8),
    "roco": dict(budget=16, sinks=2, recent=2, chunk_size=8),
    "selfextend": dict(group_size=4, window=8, chunk_size=16),
    "infllm": dict(initial=4, window=16, block_size=4, representatives=2, topk=2, lookup=8, chunk_size=16,
                   kernels="torch"),
}


@pytest.fixture(scope="module")
def model():
    return build("llama3")


def tiny(name: str):
    if name not in TINY:
        pytest.fail(f"method {name!r} has no tiny parameters in tests/test_capabilities.py: add them to TINY")
    return make_method(name, **TINY[name])


def inputs(context: int):
    generator = torch.Generator().manual_seed(context)
    return (torch.randint(3, VOCAB, (context,), generator=generator),
            torch.randint(3, VOCAB, (QUESTION,), generator=generator))


def kept(cache) -> list[list[frozenset]]:
    """Per layer and KV head, the stream positions of the entries the cache holds."""
    return [[frozenset(layer.positions[0, head, : layer.n].tolist()) for head in range(layer.kv_heads)]
            if layer.is_initialized else [] for layer in cache.layers]


def only_appended(before: list[list[frozenset]], after: list[list[frozenset]]) -> bool:
    return all(len(a) == len(b) + 1 and b <= a
               for layer_before, layer_after in zip(before, after) if layer_before
               for b, a in zip(layer_before, layer_after))


class Trace:
    """One run of `method` on `model` (eager decoding): what its forwards did to the cache."""

    def __init__(self, model, method, context: int, new: int, cut: int | None = None):
        self.written: dict[int, list[torch.Tensor]] = defaultdict(list)  # layer -> value rows [kv, q, dv]
        self.decode_evictions = 0
        self.foreign_rows = 0
        if cut is not None:
            own = method.next_chunk
            method.next_chunk = lambda cache, remaining: min(own(cache, remaining), cut)
        engine = kvpot.Engine(model, method=method, decode="eager")
        forward = engine._forward

        def traced(run, ids, step):
            before = kept(run.cache)
            out = forward(run, ids, step)
            if step.phase == "decode" and not only_appended(before, kept(run.cache)):
                self.decode_evictions += 1
            self.foreign_rows += self.foreign(run.cache)
            return out

        engine._forward = traced
        update = PotLayer.update
        written = self.written

        def recording(layer, key_states, value_states, *args, **kwargs):
            out = update(layer, key_states, value_states, *args, **kwargs)
            written[layer.layer_idx].append(layer.values[0, :, layer.n - layer.n_new : layer.n].clone())
            return out

        context_ids, question_ids = inputs(context)
        PotLayer.update = recording
        try:
            state = engine.prefill_ids(context_ids, question_ids)
            self.kept, self.logits = kept(state.cache), state.last_logits.clone()
            self.peak = state.stats.max_kv_entries
            if new:
                result = engine.generate_ids(state=state, max_new_tokens=new, ignore_eos=True)
                self.peak = max(self.peak, result.stats.max_kv_entries)
        finally:
            PotLayer.update = update

    def foreign(self, cache) -> int:
        """Kept value rows that are none of the rows the model wrote for that layer and head."""
        count = 0
        for layer in cache.layers:
            if not layer.is_initialized or not layer.n:
                continue
            values = layer.values[0, :, : layer.n]  # [kv, n, dv]
            written = torch.cat(self.written[layer.layer_idx], dim=1)  # [kv, rows, dv]
            found = (values.unsqueeze(2) == written.unsqueeze(1)).all(dim=-1).any(dim=-1)  # [kv, n]
            count += int((~found).sum())
        return count


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_declares_its_capabilities_itself(name):
    cls = METHODS[name]
    for capability in CAPABILITIES:
        assert isinstance(vars(cls).get(capability), bool), (
            f"{cls.__name__} must declare `{capability}` (True or False) in its own class body")
    assert cls.grows == (tiny(name).max_entries() is None), f"{name}: grows must mean max_entries() is None"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METHODS))
def test_declared_capabilities_match_behaviour(model, name):
    cls = METHODS[name]
    base = Trace(model, tiny(name), CONTEXT, NEW)
    cut = Trace(model, tiny(name), CONTEXT, 0, cut=CUT)
    longer = Trace(model, tiny(name), 2 * CONTEXT, 2 * NEW)

    same_cache = base.kept == cut.kept and torch.allclose(base.logits, cut.logits, atol=1e-4, rtol=1e-4)
    assert same_cache == (not cls.chunk_dependent), (
        f"{name}: chunk_dependent={cls.chunk_dependent}, but forwards of at most {CUT} tokens left "
        f"{'the same' if same_cache else 'another'} cache (max logit difference "
        f"{(base.logits - cut.logits).abs().max():.2e})")

    evicts = base.decode_evictions + longer.decode_evictions > 0
    assert evicts == cls.evicts_while_decoding, (
        f"{name}: evicts_while_decoding={cls.evicts_while_decoding}, but "
        f"{base.decode_evictions + longer.decode_evictions} decoding steps removed entries")

    merged = base.foreign_rows + longer.foreign_rows + cut.foreign_rows
    assert (merged > 0) == cls.merges, f"{name}: merges={cls.merges}, but {merged} kept value rows were merged ones"

    method = tiny(name)
    if cls.grows:
        assert method.max_entries() is None and longer.peak > base.peak, (
            f"{name}: grows, yet bound {method.max_entries()}, {base.peak} entries at most, then {longer.peak} "
            "for a longer input")
    else:
        # the bound at every instant, with what a run adds on top of it (CItruS: its instruction while probed)
        assert method.max_entries() is not None
        for run, context, new in ((base, CONTEXT, NEW), (cut, CONTEXT, 0), (longer, 2 * CONTEXT, 2 * NEW)):
            bound = method.entries_needed(context, QUESTION, new)
            assert run.peak <= bound, f"{name}: bounded by {bound}, yet held {run.peak} entries"
