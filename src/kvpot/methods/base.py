"""What a method tells the engine, and the base class that owns top-k, gather and write-back.

A method is a small dataclass. The engine calls, for every forward:
`request(step)` (which attention to observe, or None) before it, and `after_forward(cache, step)`
after it. Eviction methods subclass `EvictionMethod` and override `scores` (and `keep_count`):
the base class selects the top entries per layer and KV head and hands them to the cache, which
gathers keys, values, positions and scores in place and lets the position policy renumber them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods import replace

if TYPE_CHECKING:
    from kvpot.cache import PotCache, PotLayer


@dataclass(frozen=True)
class Step:
    """The forward that just ran (or is about to).

    phase: "context", "question" or "decode".
    n_new: tokens it appends.
    prompt_end: the last forward before decoding starts (SnapKV compresses there).
    segment_end: the last forward of its segment (the context, or the question).
    probe: in `after_forward`, `probe(ids, request, cache=None)` runs extra tokens over the cache
        (or over another `PotCache` of the same engine) and returns their per-layer attention over
        its entries, leaving it unchanged (`Engine.probe`).
    token_nll: in `after_forward`, for methods with `needs_token_nll`, `-log p(x_t | cache)` of
        each of the forward's tokens [n_new] (the first from the previous forward's logits).
    tail_observation: in `after_forward`, when the method asked for a tail probe (`tail_probe`),
        its per-layer attention over the entries before it (`[b, kv_heads, n]`); its own entries
        are already rolled back.
    scores_stored: the forward's token scores (`Method.token_score`) are in the cache already: the mixed step
        writes every chunk's at once (`kvpot.engine.mixed.after_chunks`).
    """

    phase: str
    n_new: int
    prompt_end: bool = False
    segment_end: bool = False
    probe: Callable[..., list[torch.Tensor]] | None = None
    token_nll: torch.Tensor | None = None
    tail_observation: list[torch.Tensor] | None = None
    scores_stored: bool = False


@dataclass(frozen=True)
class Setup:
    """What a method may need to know before a run: the model, its tokenizer, the question."""

    config: object  # the model's PretrainedConfig
    tokenizer: object | None
    question_ids: torch.Tensor | None  # [q] long, or None when no question is known yet
    device: torch.device


class Method:
    """Base of every method. Subclasses are dataclasses; fields are the method's parameters."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    bound: ClassVar[str] = "none: the cache grows with the input"  # what max_entries() promises
    positions: str = "absolute"

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> Method:
        """The method holding about `budget` KV entries per layer and KV head (`--budget`)."""
        raise KvpotError(f"method {cls.name!r} takes no budget; drop --budget.")

    def max_entries(self) -> int | None:
        """Most KV entries any layer holds per KV head at any instant, or None if unbounded."""
        return None

    def entries_needed(self, context: int, question: int, new_tokens: int) -> int:
        """Most KV entries per layer and KV head one sequence of these sizes holds at any instant: the
        bound of a bounded method, else everything it reads and writes (what a pool slot must hold)."""
        bound = self.max_entries()
        return bound if bound is not None else context + question + new_tokens

    # ---- capabilities: what the method does, declared by every method class in its own body (not inherited:
    # tests/test_capabilities.py checks that, and checks each declaration against the method's behaviour) ----
    # The cache a prompt leaves (kept entries, logits) depends on where its forwards end. False: reading a
    # segment in other (smaller) forwards than `next_chunk` asks changes nothing but speed and float rounding
    # (no eviction or selection depends on where a forward ends), so the batched scheduler may cap forwards at
    # its per-step budget and users already decoding wait for at most that many prompt tokens between theirs.
    # True is the safe default: the engine then keeps the method's forwards as `next_chunk` cuts them.
    chunk_dependent: ClassVar[bool] = True
    # Decoding removes entries: a step may do more than append its token (evict, or drop the token itself).
    evicts_while_decoding: ClassVar[bool] = True
    # Evicted entries are merged into kept ones, so kept keys or values are no longer the model's own (D2O, CaM).
    merges: ClassVar[bool] = False
    # No fixed bound: the entries held grow with the input (context, question or generated tokens) at some
    # point of a run; `max_entries()` is None exactly then.
    grows: ClassVar[bool] = True
    # When a reader of a shared stored document (`Scheduler(share_documents=True)`, `kvpot.engine.documents`)
    # takes its own copy of the document's entries: "never" (a reader whose question is fed only appends),
    # "when_full" (at the step its pot fills and it compresses: InfiniPot, SirLLM), or "at_admission" (its
    # question is read in a forward of its own, over the cache: every method that does not feed questions).
    # A question read in a forward (longer than the scheduler's `feed_tokens`, or none) copies for every method.
    copies_document: ClassVar[str] = "at_admission"

    def chunk_appends(self, cache: PotCache, tokens: int) -> bool:
        """Whether reading `tokens` more tokens into `cache` as one chunk only appends them: no tail probe or
        observation, nothing compressed or evicted after the forward. A reader of a shared document may then read
        its question as a chunk of the mixed step without copying the document (the chunk attends it in its
        region, `kvpot.engine.documents`). From host-side counts only; methods that never change a reader's
        entries say so with `copies_document = "never"`."""
        return self.copies_document == "never"

    needs_token_nll: ClassVar[bool] = False  # engine fills Step.token_nll (InfiniPot's NuC)
    # The score buffer `after_forward` writes each forward's token -log p into (`token_scores.store_forward`), if
    # any; a mixed step writes its chunks' there at once, one write a layer (`Step.scores_stored`)
    token_score: ClassVar[str | None] = None
    # Reading a question one token per decoding step leaves the same cache as reading it in forwards
    # (nothing the method does depends on the phase, on where a forward ends, or on `prompt_end`): the
    # batched scheduler then feeds a question asked of a stored state through the decoding steps it
    # runs anyway, instead of one eager forward per request that every decoding user waits for.
    feeds_question: ClassVar[bool] = False
    # Score arrays that `batch_append` writes at every row's new entry (InfiniPot's NuC, SirLLM's entropy): a
    # batched step's append leaves them to it instead of zeroing them first (one scatter a layer less).
    batch_scores: ClassVar[tuple[str, ...]] = ()
    # Float32 score arrays the method keeps per entry at most (H2O's sums, InfiniPot's NuC): a batched pool
    # counts them in each slot's bytes before it sizes itself from free memory.
    score_arrays: ClassVar[int] = 2

    def prefill_chunk(self) -> int:
        """Tokens per prefill forward; activations are bounded by it."""
        return int(getattr(self, "chunk_size", 2048))

    def min_last_chunk(self) -> int:
        """The last forward of a prompt carries at least this many tokens (observation windows)."""
        return 1

    def next_chunk(self, cache: PotCache, remaining: int) -> int:
        """Tokens for the next prefill forward, given `remaining` tokens of the segment."""
        chunk = max(self.prefill_chunk(), self.min_last_chunk())
        if remaining <= chunk:
            return remaining
        return min(chunk, remaining - self.min_last_chunk())

    def begin(self, cache: PotCache, setup: Setup) -> None:
        """Prepare a run (e.g. tokenize a catalyst prompt into `cache.method_state`)."""

    def prepare(self, context_ids: torch.Tensor, question_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewrite the inputs before anything runs (Truncate cuts the context's middle)."""
        return context_ids, question_ids

    def before_forward(self, cache: PotCache, step: Step) -> None:
        """Called before every forward of the engine (probes excluded), with what it will encode."""

    def request(self, step: Step) -> AttentionRequest | None:
        """The attention observation the forward of `step` must record, if any."""
        return None

    def tail_probe(self, cache: PotCache, step: Step) -> tuple[torch.Tensor, AttentionRequest] | None:
        """Probe tokens to run *in the same forward*, after the step's tokens, or None.

        The same as calling `step.probe(ids, request)` in `after_forward` (the tokens follow the
        step's tokens and see them), without a second pass over the weights: the engine appends
        the ids, records their attention (`request.rows` must select the last len(ids) rows),
        rolls their entries back, and hands the observation to `after_forward` as
        `step.tail_observation`. InfiniPot's catalyst uses it.
        """
        return None

    def after_forward(self, cache: PotCache, step: Step) -> bool:
        """Update scores and evict after a forward; True if anything was evicted."""
        return False

    # ---- fixed-shape decoding (kvpot.engine.decoding) ----
    def decode_plan(self, cache: PotCache) -> str:
        """What the next decoding step does, decided from host-side counts only: "append" (it
        appends one entry and changes nothing else's shape: one captured step serves every
        length), "steady" (it appends and evicts back to the same counts: `after_forward` is
        captured at them), or "eager" (it reshapes the cache: runs uncaptured). Methods that say
        nothing decode eagerly."""
        return "eager"

    def decode_key(self, cache: PotCache) -> tuple:
        """What, besides the plan, tells this step's captured graph from others: asked after
        `decode_plan`, from host state only. InfiniteHiP: the pruning stages the step recomputes."""
        return ()

    def decode_request(self, plan: str) -> AttentionRequest | None:
        """The observation a fixed-shape step records: by default what the eager step asks for,
        in steady steps (an append step's observation is unused unless `decode_append` reads it)."""
        return self.request(DECODE_STEP) if plan == "steady" else None

    def decode_append(self, cache: PotCache, step: Step) -> None:
        """The per-token work of an "append" step, in fixed shapes: whole buffers, the new entry at
        each layer's device-side `slot`, the observation over the whole capacity in `layer.probs`
        (zero past the live entries). H2O accumulates; InfiniPot stores NuC."""

    def batch_append(self, layers: list, rows: torch.Tensor, index: list[torch.Tensor], live: torch.Tensor,
                     step: Step) -> None:
        """`decode_append` for a batch of pool slots (`kvpot.engine.batch`), in fixed shapes: `layers` the
        pool's `PoolLayer`s (buffers `[slots + 1, kv_heads, capacity]`), `rows` [B] each row's slot,
        `index[l]` [B] where layer l wrote each row's token, `live` [B] 1.0 where the append is the
        row's whole step (0.0: padding, or a row at its budget whose `after_forward` follows and folds
        the observation itself), `step.token_nll` [B]; the observation in `layer.probs[:B]`."""

    def report(self, cache: PotCache) -> dict | None:
        """What the method measured over a generation, for `Stats.method` (InfiniteHiP: the GPU
        cache's hit rate when offloading); None when it has nothing to say."""
        return None

    # ---- helpers shared by the CLI and `kvpot methods` ----
    @classmethod
    def parameters(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.init]

    def config(self) -> dict:
        """The resolved parameters (saved next to every result)."""
        return {"method": self.name, **dataclasses.asdict(self)}


DECODE_STEP = Step("decode", 1, segment_end=True)


def check_positive(method: Method, *names: str) -> None:
    for name in names:
        value = getattr(method, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise KvpotError(f"{method.name}: {name} must be a positive integer, got {value!r}.")


def check_policy(method: Method, allowed: tuple[str, ...]) -> None:
    if method.positions not in allowed:
        raise KvpotError(f"{method.name}: positions must be one of {allowed}, got {method.positions!r}.")


class EvictionMethod(Method):
    """Keep the `keep_count` highest-scoring entries of each layer and KV head after a forward.

    `scores` returns `[b, kv_heads, n]` (per-head selection) or `[b, 1, n]` (one selection shared
    by the layer's heads); entries that must stay get `+inf` (see `protect`). A method whose rule is
    a `Ranking` (per-entry values plus protected oldest/newest entries) gives `ranking` instead:
    `scores` follows from it, and a steady decoding step then drops its one entry by replacement
    (`kvpot.methods.replace`: the new entry takes the dropped one's slot, nothing is compacted).
    """

    def keep_count(self, layer: PotLayer, step: Step) -> int:
        raise NotImplementedError

    def should_evict(self, layer: PotLayer, step: Step) -> bool:
        return layer.n > self.keep_count(layer, step)

    def update_scores(self, layer: PotLayer, step: Step) -> None:
        """Fold this forward's observation into the layer's stored scores (H2O accumulates)."""

    def ranking(self, layer: PotLayer, step: Step) -> Ranking | None:
        """The selection as a `Ranking`, or None where `scores` says it otherwise. Its values must
        belong to the entries (stored scores, this forward's observation), not to their places."""
        return None

    def scores(self, layer: PotLayer, step: Step) -> torch.Tensor:
        ranking = self.ranking(layer, step)
        if ranking is None:
            raise NotImplementedError
        return ranking.by_index(layer)

    def decode_plan(self, cache: PotCache) -> str:
        keeps = [self.keep_count(layer, DECODE_STEP) for layer in cache.layers]
        if all(layer.n + 1 <= keep for layer, keep in zip(cache.layers, keeps)):
            return "append"
        if all(layer.n == keep for layer, keep in zip(cache.layers, keeps)):
            return "steady"
        return "eager"

    # The scores depend on the entry count only (StreamingLLM's sinks + recency), so one selection
    # serves every layer holding the same count.
    shared_selection: ClassVar[bool] = False

    def after_forward(self, cache: PotCache, step: Step) -> bool:
        if cache.static and self.replaces(cache, step):  # a steady fixed-shape step: one entry out, one in
            return self._replace(cache, step)
        replace.restore_order(cache)  # what follows reads the entries' order from their places
        evicting: dict[tuple, list] = {}
        for layer in cache.layers:
            self.update_scores(layer, step)
            if self.should_evict(layer, step):
                keep = self.keep_count(layer, step)
                evicting.setdefault((layer.n, keep, layer.device), []).append(layer)
        # Layers with the same counts are selected together: one top-k over [layers, b, heads, n]
        # instead of one per layer (the chunk loop is launch-bound on a GPU, not compute-bound).
        for (_, keep, _), layers in evicting.items():
            if self.shared_selection:
                chosen = [top_indices(self.scores(layers[0], step), keep)] * len(layers)
            elif len(layers) == 1:
                chosen = [top_indices(self.scores(layers[0], step), keep)]
            else:
                chosen = top_indices(torch.stack([self.scores(layer, step) for layer in layers]), keep).unbind(0)
            for layer, keep_indices in zip(layers, chosen):  # [b, kv_heads | 1, keep]
                layer.select(keep_indices)
        return bool(evicting)

    def replaces(self, cache: PotCache, step: Step) -> bool:
        """Whether this step's eviction drops exactly one entry of every layer by a `Ranking`, so the new
        entry can take the dropped one's slot (`kvpot.methods.replace`)."""
        return replace.enabled and replaces_by_ranking(self) and step.n_new == 1 and all(
            layer.n == self.keep_count(layer, step) + 1 for layer in cache.layers)

    def replace_fused(self, layer, step: Step, storage, rows: torch.Tensor | None, renumbers: bool) -> bool:
        """A steady step's `update_scores`, `ranking` and replacement of `layer` (a `PotLayer`, or the batched
        engine's view of pool slots: its `n` and `observation`) done at once on `storage`'s buffers (`keys`,
        `values`, `positions`, `rope_positions`, `scores`; the layer itself, or the pool's layer with `rows`
        its slots), as one kernel (RoCo's). False: nothing done, the generic path runs."""
        return False

    def _replace(self, cache: PotCache, step: Step) -> bool:
        for _, layer in replace.spread(cache.layers):  # side by side on a GPU's streams
            if self.replace_fused(layer, step, layer, None, cache.policy.renumbers):
                replace.took_newest(layer)
                continue
            self.update_scores(layer, step)
            ranking = self.ranking(layer, step)
            replace.take_newest(layer, ranking.scores, ranking.sinks, ranking.recent)
        return True


def replaces_by_ranking(method: Method) -> bool:
    """Whether `method` evicts by `EvictionMethod`'s rule over a `Ranking` (its `scores` and eviction are
    the base class's), which a one-entry eviction can apply by replacement."""
    kind = type(method)
    return (isinstance(method, EvictionMethod) and kind.ranking is not EvictionMethod.ranking
            and kind.scores is EvictionMethod.scores and kind.after_forward is EvictionMethod.after_forward
            and kind.should_evict is EvictionMethod.should_evict)


@dataclass(frozen=True)
class Ranking:
    """What an eviction ranks a layer's entries by: `scores` `[b, kv_heads | 1, n]` (None: their age,
    the oldest lowest), the first `sinks` and the last `recent` entries (in stream order) always kept."""

    scores: torch.Tensor | None
    sinks: int = 0
    recent: int = 0

    def by_index(self, layer: PotLayer) -> torch.Tensor:
        """The scores `top_indices` selects from, the entries in stream order in the buffers."""
        scores = recency(layer) if self.scores is None else self.scores
        return protect(scores, sinks=self.sinks, recent=self.recent)


def top_indices(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Ascending indices of the `keep` highest of `scores` [..., n] along the last dimension.

    Dropping one entry of n (every decoding step of a method at its budget) takes the arg-min
    instead of a top-k of n - 1, which on a GPU costs a radix select and a sort per layer and step.
    """
    n = scores.shape[-1]
    if keep != n - 1:
        return scores.topk(keep, dim=-1).indices.sort(dim=-1).values
    drop = scores.argmin(dim=-1, keepdim=True)
    index = torch.arange(keep, device=scores.device)
    return index + (index >= drop).long()


def recency(layer: PotLayer) -> torch.Tensor:
    """[1, 1, n] scores that rank later entries higher (entries are kept in original order)."""
    return torch.arange(layer.n, device=layer.device, dtype=torch.float32).view(1, 1, -1)


def protect(scores: torch.Tensor, sinks: int = 0, recent: int = 0) -> torch.Tensor:
    """Give the first `sinks` and last `recent` entries +inf so top-k always keeps them."""
    scores = scores.clone()
    n = scores.shape[-1]
    if sinks:
        scores[..., : min(sinks, n)] = float("inf")
    if recent:
        scores[..., max(0, n - recent) :] = float("inf")
    return scores
