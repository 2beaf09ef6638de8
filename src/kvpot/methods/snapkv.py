from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods.base import EvictionMethod, Step, check_policy, check_positive, protect


@dataclass
class SnapKV(EvictionMethod):
    """Compress the prompt once, by the attention of its last `window` tokens.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (NeurIPS 2024),
    Sec. 4: the observation window (the prompt's last `window` tokens) votes for prefix entries by
    its attention, summed over the window's queries; the votes are pooled over neighbouring
    positions (`pool`, `kernel`) to keep clusters; per KV head (the query heads of a group
    averaged) the top `budget - window` prefix entries plus the window are kept. Prefill is
    memory-unconstrained, as in the paper: the whole prompt is cached before compression, then
    decoding appends without eviction. The compression happens at the end of each prompt the
    engine is given (after the question for `generate(context, question)`; after the context for
    `prefill(context)`, and again after a question asked on that state).

    Bound: none during prefill (the prompt length); `budget` + generated tokens after it.
    """

    name = "snapkv"
    paper = "Li et al. 2024, SnapKV: LLM Knows What You are Looking for Before Generation"
    bound = "none in prefill (prompt length); budget + generated tokens afterwards"
    # the observation window is the prompt's last forward's queries: `min_last_chunk` keeps it `window` long; a shorter
    # last forward observes fewer (earlier cuts change nothing)
    chunk_dependent = True
    evicts_while_decoding = False  # compressed once at the end of a prompt; decoding appends
    merges = False
    grows = True  # the prompt is cached whole before its compression, and decoding appends
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    budget: int = 1024
    window: int = 32
    kernel: int = 7
    pool: str = "max"
    chunk_size: int = 4096
    positions: str = "absolute"

    def __post_init__(self):
        check_positive(self, "budget", "window", "kernel", "chunk_size")
        check_policy(self, ("absolute",))
        if self.pool not in ("max", "avg"):
            raise KvpotError(f"snapkv: pool must be 'max' or 'avg', got {self.pool!r}.")
        if self.kernel % 2 == 0:
            raise KvpotError(f"snapkv: kernel must be odd so pooling stays centred, got {self.kernel}.")
        if self.budget <= self.window:
            raise KvpotError(
                f"snapkv: a budget of {self.budget} cannot hold the {self.window}-token observation window "
                "plus selected entries; use a budget above the window or a smaller window."
            )

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> SnapKV:
        return cls(budget=budget, **overrides)

    def decode_plan(self, cache) -> str:
        return "append"  # compressed once at the prompt's end; decoding only appends

    def min_last_chunk(self) -> int:
        return self.window

    def request(self, step: Step) -> AttentionRequest | None:
        if not step.prompt_end:
            return None
        return AttentionRequest(rows=(-self.window, None), row_reduce="sum", head_reduce="mean")

    def should_evict(self, layer, step: Step) -> bool:
        return step.prompt_end and layer.n > self.budget

    def keep_count(self, layer, step: Step) -> int:
        return self.budget

    def scores(self, layer, step: Step):
        votes = layer.observation  # [b, kv_heads, n]
        pool = F.max_pool1d if self.pool == "max" else F.avg_pool1d
        pad = self.kernel // 2
        b, heads, n = votes.shape
        pooled = pool(votes.reshape(b * heads, 1, n), self.kernel, stride=1, padding=pad)
        return protect(pooled.view(b, heads, n), recent=min(self.window, step.n_new))
