from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.errors import KvpotError
from kvpot.methods.base import Step
from kvpot.methods.d2o.budget import _round_preserving_sum
from kvpot.methods.snapkv import SnapKV

BUDGETS = "pyramidkv.budgets"  # the per-layer budgets of the last compression (for reports and tests)


@dataclass
class PyramidKV(SnapKV):
    """SnapKV's selection under per-layer budgets that shrink with depth (a pyramid).

    Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
    (2024), Sec. 3: attention is spread widely in the lower layers and concentrated on few tokens in
    the higher ones, so the lower layers keep more. The budgets form an arithmetic sequence, the top
    layer's share being `1/beta` of the average (beta = 20), in the budget formula of the authors'
    KVCache-Factory that kvpress' PyramidKVPress uses: with `M = budget` (the average per layer) and
    `W = window`, min = (M - W) / beta, max = 2 (M - W) - min; when max exceeds the prompt less the
    window, max = prompt - W and min = 2 (M - W) - max; layer i keeps W + max - i (max - min) / (L - 1),
    so the budgets sum to `L * budget` (kvpot rounds keeping the sum exact). Where that is no pyramid
    (max < min, or min < W: a small budget), every layer keeps `budget`, SnapKV's uniform allocation,
    as the reference code falls back.

    Each layer then keeps SnapKV's selection (Sec. 3.3: the last `window` tokens vote by attention,
    pooled; per KV head), at the end of each prompt: prefill is memory-unconstrained, as in the paper.

    Bound: none during prefill (the prompt length); then the layer's budget + generated tokens,
    `budget` on average over layers and about `(2 - 1/beta) * (budget - window) + window` in layer 0.
    """

    name = "pyramidkv"
    paper = "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
    bound = "none in prefill (prompt length); the layer's budget (budget on average, more in lower layers) + generated"
    chunk_dependent = True  # as SnapKV: the prompt's last forward holds the observation window
    evicts_while_decoding = False  # as SnapKV: compressed at the end of a prompt only
    merges = False
    grows = True  # as SnapKV
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    beta: int = 20

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.beta, int) or isinstance(self.beta, bool) or self.beta < 1:
            raise KvpotError(f"pyramidkv: beta must be an integer >= 1, got {self.beta!r}.")

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> PyramidKV:
        return cls(budget=budget, **overrides)

    def after_forward(self, cache, step: Step) -> bool:
        if step.prompt_end:  # decided from the prompt as it stands (a question on a state: its budgets again)
            prompt = max(cache.lengths())
            cache.method_state[BUDGETS] = pyramid_budgets(len(cache.layers), self.budget, self.window, self.beta,
                                                          prompt)
        return super().after_forward(cache, step)

    def should_evict(self, layer, step: Step) -> bool:
        return step.prompt_end and layer.n > self.keep_count(layer, step)

    def keep_count(self, layer, step: Step) -> int:
        return min(layer.n, layer.cache.method_state[BUDGETS][layer.layer_idx])


def pyramid_budgets(layers: int, budget: int, window: int, beta: int, prompt: int) -> list[int]:
    """Entries each layer keeps (bottom layer first): an arithmetic sequence summing to `layers * budget`."""
    spread = budget - window  # the selected entries of an average layer (the window is kept everywhere)
    low = spread / beta
    high = 2 * spread - low
    if high >= prompt - window:  # the bottom layer cannot keep more than the prompt: a flatter pyramid
        high = prompt - window
        low = 2 * spread - high
    if layers == 1 or not (prompt >= high >= low >= window):
        return [budget] * layers  # no pyramid fits (the reference code's SnapKV fallback)
    step = (high - low) / (layers - 1)
    shares = torch.tensor([window + high - i * step for i in range(layers)], dtype=torch.float64)
    return _round_preserving_sum(shares, layers * budget)
