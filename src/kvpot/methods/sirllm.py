from __future__ import annotations

from dataclasses import dataclass

from kvpot.errors import KvpotError
from kvpot.methods.base import Method, Step, check_policy, check_positive, protect, top_indices
from kvpot.methods.token_scores import store_append, store_batch, store_forward

SCORE = "sirllm"  # each entry's token entropy, -log p(x_t | what the cache held), decayed per compression


@dataclass
class SirLLM(Method):
    """Streaming Infinite Retentive LLM: keep the tokens the model found most surprising.

    Yao et al., "SirLLM: Streaming Infinite Retentive LLM" (ACL 2024): a token's entropy is
    `e_i = -log P(x_i | x_0..x_{i-1})`, taken from the logits of the forward that encoded it (its
    first token from the previous forward's, as InfiniPot's NuC). When the cache is full, keep the
    first `sinks` tokens (StreamingLLM's start tokens), the `recent` newest, and the highest-entropy
    ("key") tokens for the rest; after each compression every kept entropy is multiplied by `decay`
    (the memory decay), so old key tokens fade (the release: `evict_for_space_token_entropy`, then
    `token_entropy * decay_ratio`). Entropy is a per-token score, so one selection serves every
    head of every layer (as InfiniPot's Sec. 2 notes: "all attention heads share the same entries").

    The setting is InfiniPot's (Kim et al. 2024, Sec. 4.1, Table 1 "L3-SirLLM-4K"), which "applies
    its criterion within the CCD pipeline": a pot of `pot_size` (|M|) entries is filled by chunks
    and compressed to `compress_size` (|C|, default |M|/2) whenever it is full, in prefill and
    decoding alike. The authors' release does the same per dialogue round (`evict_for_space`:
    make room for the round, then decay), so a "round" here is one filling of the pot. Defaults
    follow the release's commands: `sinks=4`, `recent=0` (the rest of the pot goes to key
    tokens), `decay=1` (the grocery-shopping retention task; 0.9 and 0.7 were used for the
    rock-paper-scissors and DailyDialog dialogues). Positions are shifted as in the release
    (StreamingLLM's `pos_shift`; the same rule as InfiniPot's CR-RoPE in a pot); "absolute" keeps
    stream positions.

    Bound: `pot_size` entries per layer and KV head, at every instant of prefill and decoding.
    """

    name = "sirllm"
    paper = "Yao et al. 2024, SirLLM: Streaming Infinite Retentive LLM"
    bound = "pot_size (cache + chunk)"
    needs_token_nll = True
    batch_scores = (SCORE,)  # written by `batch_append` (store_batch) at every new entry
    token_score = SCORE  # and by `after_forward` (store_forward) after each forward
    # the pot compresses when full, wherever forwards end; a token's entropy uses the logits before it either way
    chunk_dependent = False
    evicts_while_decoding = True  # the pot compresses whenever it fills, during decoding too
    merges = False
    grows = False
    copies_document = "when_full"  # at the step its pot fills and it evicts
    feeds_question = True  # a question appends, or fills the pot, as decoded tokens would
    pot_size: int = 2048
    compress_size: int | None = None
    sinks: int = 4
    recent: int = 0
    decay: float = 1.0
    positions: str = "shift"

    def __post_init__(self):
        check_positive(self, "pot_size")
        if self.compress_size is None:
            self.compress_size = self.pot_size // 2
        check_positive(self, "compress_size")
        if self.compress_size >= self.pot_size:
            raise KvpotError(
                f"sirllm: compress_size ({self.compress_size}) must be smaller than pot_size ({self.pot_size})."
            )
        for field in ("sinks", "recent"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise KvpotError(f"sirllm: {field} must be an integer >= 0, got {value!r}.")
        if self.sinks + self.recent > self.compress_size:
            raise KvpotError(
                f"sirllm: sinks + recent ({self.sinks + self.recent}) exceed compress_size ({self.compress_size})."
            )
        if not 0.0 < float(self.decay) <= 1.0:
            raise KvpotError(f"sirllm: decay must be in (0, 1], got {self.decay!r}.")
        check_policy(self, ("shift", "absolute"))

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> SirLLM:
        if budget < 2:
            raise KvpotError(f"sirllm: a pot of {budget} entries cannot be compressed; use a budget >= 2.")
        return cls(pot_size=budget, **overrides)

    def max_entries(self) -> int:
        return self.pot_size

    def prefill_chunk(self) -> int:
        return self.pot_size - self.compress_size

    def next_chunk(self, cache, remaining: int) -> int:
        return min(remaining, self.pot_size - max(cache.lengths()))

    # ------------------------------------------------------------------ decoding
    def decode_plan(self, cache) -> str:
        return "eager" if max(cache.lengths()) + 1 >= self.pot_size else "append"  # the filling step compresses

    def chunk_appends(self, cache, tokens: int) -> bool:
        return max(cache.lengths()) + tokens < self.pot_size  # the pot does not fill: nothing is compressed

    def decode_append(self, cache, step: Step) -> None:
        store_append(cache, SCORE, step)

    def batch_append(self, layers, rows, index, live, step: Step) -> None:
        store_batch(layers, SCORE, rows, index, step)

    # ------------------------------------------------------------------ the pot
    def after_forward(self, cache, step: Step) -> bool:
        store_forward(cache, SCORE, step)
        if max(cache.lengths()) < self.pot_size:
            return False
        self.compress(cache)
        return True

    def compress(self, cache) -> None:
        """Keep sinks + recent + the highest decayed entropies, |C| in all, then decay the kept ones."""
        first = cache.layers[0]
        entropy = first.score(SCORE)[:, :1]  # [b, 1, n]: every head and layer holds the same tokens and scores
        keep = top_indices(protect(entropy, sinks=self.sinks, recent=self.recent), self.compress_size)
        for layer in cache.layers:
            layer.select(keep.to(layer.device))
            if float(self.decay) != 1.0:
                layer.score(SCORE).mul_(float(self.decay))
