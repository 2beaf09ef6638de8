from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods.base import Method, Setup, Step, check_policy, check_positive, top_indices
from kvpot.models.parallel import all_heads

INSTRUCTION = "citrus.instruction"  # tokenized instruction, in cache.method_state
INSTRUCTION_CACHE = "citrus.instruction_cache"  # C^I of the individual-cache variant
FINALIZED = "citrus.finalized"  # the after-document eviction by the instruction has happened
ACCUMULATED = "citrus.accumulated"  # per-entry score for score="h2o"


@dataclass
class CItruS(Method):
    """Chunked Instruction-aware State Eviction (Bai et al., EMNLP 2024).

    **Chunked State Eviction** (Sec. 4.1, eqs. 1-3): the document is read in chunks of
    `chunk_size` (l_s). Each chunk s is encoded on the cache C; then C's entries (those cached
    before s) are evicted down to `keep` (k) by their importance to s,
    `Imp(s, c) = 1/|s| sum_{t in s} softmax_{c' in C}(q_t k_c' / sqrt(d))_c` — the softmax runs
    over C only, as in eq. 1's denominator — and all of s stays. The selection is layer-wise by
    default (the importance averaged over the layer's heads, one set of tokens per layer: the
    paper found head-wise selection worse); `selection="head"` selects per KV head.
    After the last chunk the cache is evicted once more to `keep` with the instruction as the
    chunk (through the engine's probe, whose own entries are rolled back), then the instruction
    is encoded on it and the answer generated (Sec. 4.3). With `cache="none"` a document can be
    prefilled alone and questioned later: that eviction then uses the question's own forward.

    **Instruction-aware eviction** (Sec. 4.2): `cache="shared"` evicts C by the instruction's
    importance `Imp(I, c)` instead of the chunk's; `cache="individual"` keeps C as in standard CSE
    and a second cache C^I, evicted by `Imp(I, c)` (eqs. 4-5) before each chunk's entries are
    added to it, from which the answer is generated; `cache="none"` is Standard CSE. The
    instruction is the question given to `generate`; shared and individual need it while the
    document is read. `instruction` is a fixed text used when no question is given (language
    modelling, the paper's Fig. 7, where there is no task): "generic" takes the model's generic
    prompt, as InfiniPot's catalyst does; a question, when given, always wins. `score="h2o"` ranks
    by the importance accumulated over every eviction an entry survived instead of the current one
    (the paper's "H2O + Shared Cache" row).

    Positions shift (Sec. 5.3): entries are numbered 0..n-1 in the cache, new tokens follow.

    Generation: the paper encodes the instruction and generates from the k-entry cache; kvpot
    keeps doing chunked eviction past that, so that whenever the cache exceeds
    `keep + chunk_size` its older entries go back to `keep` by the importance of the forward that
    just ran (one generated token: TOVA's rule, which the paper calls CSE with l_s = 1).

    Bound (entries per layer and KV head, counting everything at any instant): C holds at most
    `keep + chunk_size` between chunks — the paper's "cache size l_s + k" (footnote 2) — and the
    chunk being encoded sits on top of it, so the peak is `keep + 2*chunk_size` (plus the
    instruction's length while it is probed, for shared); the individual variant adds C^I, up to
    `keep + chunk_size` more.
    """

    name = "citrus"
    paper = "Bai et al. 2024, CItruS: Chunked Instruction-aware State Eviction"
    bound = "keep + 2*chunk_size (+ instruction while probed); individual: + keep + chunk_size"
    chunk_dependent = True  # each forward is a chunk s of Chunked State Eviction: C is evicted by its importance to s
    evicts_while_decoding = True  # back to `keep` older entries once past keep + chunk_size
    merges = False
    grows = False
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    chunk_size: int = 256
    keep: int = 768
    cache: str = "shared"
    score: str = "chunk"
    selection: str = "layer"
    instruction: str | None = None
    positions: str = "shift"

    def __post_init__(self):
        check_positive(self, "chunk_size", "keep")
        for field, allowed in (("cache", ("shared", "individual", "none")), ("score", ("chunk", "h2o")),
                               ("selection", ("layer", "head"))):
            if getattr(self, field) not in allowed:
                raise KvpotError(f"citrus: {field} must be one of {allowed}, got {getattr(self, field)!r}.")
        check_policy(self, ("shift", "absolute"))

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> CItruS:
        """Split a budget as the paper's k=768, l_s=256 split 1,024: three quarters kept."""
        if budget < 4:
            raise KvpotError(f"citrus: a budget of {budget} cannot hold kept entries and a chunk; use >= 4.")
        chunk = overrides.pop("chunk_size", max(1, budget // 4))
        return cls(keep=overrides.pop("keep", budget - chunk), chunk_size=chunk, **overrides)

    def max_entries(self) -> int:
        peak = self.keep + 2 * self.chunk_size
        return peak + (self.keep + self.chunk_size if self.cache == "individual" else 0)

    def prefill_chunk(self) -> int:
        return self.chunk_size

    def entries_needed(self, context: int, question: int, new_tokens: int) -> int:
        # the instruction's probe sits on top of the cache while it is read (shared and individual)
        return self.max_entries() + (question if self.cache != "none" else 0)

    def begin(self, cache, setup: Setup) -> None:
        instruction = setup.question_ids
        if instruction is not None and instruction.numel() == 0:
            instruction = None
        if instruction is None and self.instruction is not None:
            instruction = self._fixed_instruction(setup)
        if instruction is None and self.cache != "none" and INSTRUCTION not in cache.method_state:
            raise KvpotError(
                f"citrus: cache={self.cache!r} needs the instruction (the question) while the document is read; "
                "pass it with the context (generate(context, question)) or use cache='none'."
            )
        if instruction is not None:
            cache.method_state[INSTRUCTION] = instruction
        fresh = max(cache.lengths()) == 0  # nothing read yet (not a prefilled state)
        if self.cache == "individual" and fresh and INSTRUCTION_CACHE not in cache.method_state:
            cache.method_state[INSTRUCTION_CACHE] = cache.twin()

    def _fixed_instruction(self, setup: Setup) -> torch.Tensor:
        """`instruction` as token ids: "generic" is the model's generic prompt (as InfiniPot's catalyst)."""
        from kvpot.methods.infinipot import text_prompt_ids

        return text_prompt_ids(self.instruction, setup, "citrus: a text instruction needs a tokenizer.")

    # ------------------------------------------------------------------ observations
    def request(self, step: Step) -> AttentionRequest | None:
        if self.cache == "shared" and step.phase == "context":
            return None  # C is evicted by the instruction's probe, not by the chunk
        return AttentionRequest(rows=None, row_reduce="mean", head_reduce="mean", over="cached")

    def tail_probe(self, cache, step: Step):
        """Shared cache: the instruction rides in the chunk's forward when C will be evicted, so
        Imp(I, c) costs no second pass over the weights. Normalising over the entries cached before
        the forward (`over="cached"`) gives exactly the separate probe's eqs. 4-5."""
        instruction = step_cache_state(cache).get(INSTRUCTION)
        old = cache.layers[0].n
        if self.cache != "shared" or step.phase != "context" or instruction is None or old <= self.keep:
            return None
        m = instruction.numel()
        return instruction, AttentionRequest(rows=(-m, None), row_reduce="mean", head_reduce="mean", over="cached",
                                             keys=old)

    def _instruction_importance(self, step: Step, cache, old: int) -> list[torch.Tensor]:
        """Imp(I, c) for the first `old` entries of `cache`, per layer (eqs. 4-5)."""
        instruction = step_cache_state(cache)[INSTRUCTION]
        request = AttentionRequest(rows=None, row_reduce="mean", head_reduce="mean", over="cached", keys=old)
        return [obs[..., :old] for obs in step.probe(instruction, request, cache=cache)]

    # ------------------------------------------------------------------ eviction
    def after_forward(self, cache, step: Step) -> bool:
        if step.phase == "question" and not cache.method_state.get(FINALIZED):
            return self._evict_by_question(cache, step)
        if step.phase != "context":
            return self._evict_when_full(cache, step)
        old = cache.layers[0].n - step.n_new  # entries cached before this chunk
        evicted = False
        if old > self.keep:
            if self.cache == "shared":
                scores = step.tail_observation or self._instruction_importance(step, cache, old)
            else:
                scores = [layer.observation[..., :old] for layer in cache.layers]
            self._keep_top(cache, scores, old, self.keep)
            evicted = True
        if self.cache == "individual":
            evicted |= self._update_instruction_cache(cache, step)
        if step.segment_end and INSTRUCTION in step_cache_state(cache):
            evicted |= self._final_eviction(cache, step)
        return evicted

    def _update_instruction_cache(self, cache, step: Step) -> bool:
        """C^I: evict by the instruction (eqs. 4-5), then add the chunk's entries (Sec. 4.2)."""
        side = cache.method_state[INSTRUCTION_CACHE]
        old = side.layers[0].n
        evicted = old > self.keep
        if evicted:
            self._keep_top(side, self._instruction_importance(step, side, old), old, self.keep)
        for main, layer in zip(cache.layers, side.layers):
            layer.append_entries(main, main.n - step.n_new)
        return evicted

    def _evict_by_question(self, cache, step: Step) -> bool:
        """A document prefilled without its instruction (`prefill` then `generate(question=...)`):
        the question's own forward gives Imp(I, c) over the document, so the after-document
        eviction (Sec. 4.1) happens as the question is read, without a probe."""
        cache.method_state[FINALIZED] = True
        old = cache.layers[0].n - step.n_new
        if old <= self.keep:
            return False
        self._keep_top(cache, [layer.observation[..., :old] for layer in cache.layers], old, self.keep)
        return True

    def _final_eviction(self, cache, step: Step) -> bool:
        """After the document: evict to `keep` with the instruction as the chunk (Sec. 4.1, 4.3)."""
        cache.method_state[FINALIZED] = True
        target = cache.method_state.get(INSTRUCTION_CACHE, cache)
        n = target.layers[0].n
        evicted = n > self.keep
        if evicted:
            self._keep_top(target, self._instruction_importance(step, target, n), n, self.keep)
        if target is not cache:
            cache.adopt(target)  # the answer is generated from C^I
            del cache.method_state[INSTRUCTION_CACHE]
        return evicted

    def decode_plan(self, cache) -> str:
        if INSTRUCTION_CACHE in cache.method_state:
            return "eager"  # C^I has not been adopted yet
        n = cache.layers[0].n
        return "eager" if n + 1 > self.keep + self.chunk_size and n > self.keep else "append"

    def _evict_when_full(self, cache, step: Step) -> bool:
        """Question and generation: back to `keep` older entries once past keep + chunk_size."""
        old = cache.layers[0].n - step.n_new
        if cache.layers[0].n <= self.keep + self.chunk_size or old <= self.keep:
            return False
        scores = [layer.observation[..., :old] for layer in cache.layers]
        self._keep_top(cache, scores, old, self.keep)
        return True

    def _keep_top(self, cache, scores: list[torch.Tensor], old: int, keep: int) -> None:
        """Keep the `keep` best of each layer's first `old` entries (eq. 2-3) and every later one."""
        for layer, score in zip(cache.layers, scores):
            if self.score == "h2o":
                accumulated = layer.score(ACCUMULATED)
                accumulated[..., :old] += score
                score = accumulated[..., :old]
            if self.selection == "layer":  # one selection for the layer's heads (every rank's, with TP)
                score = all_heads(layer.parallel, score).mean(dim=1, keepdim=True)
            chosen = top_indices(score, keep)  # [b, 1 | kv, keep]
            newer = torch.arange(old, layer.n, device=chosen.device).expand(*chosen.shape[:2], -1)
            layer.select(torch.cat([chosen, newer], dim=-1))


def step_cache_state(cache) -> dict:
    """The method state lives on the main cache; a linked C^I defers to it."""
    if INSTRUCTION in cache.method_state or cache.linked is None:
        return cache.method_state
    return cache.linked.method_state
