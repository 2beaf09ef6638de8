from __future__ import annotations

from dataclasses import dataclass

from kvpot.attention import AttentionRequest
from kvpot.methods.base import EvictionMethod, Ranking, Step, check_policy, check_positive


@dataclass
class TOVA(EvictionMethod):
    """Token Omission Via Attention: keep the entries the newest token attends to most.

    Oren et al., "Transformers are Multi-State RNNs" (2024), Sec. 3.3: when the cache exceeds its
    budget, drop the entry with the lowest attention from the current (last) query, averaged over
    the layer's heads, so one selection is shared by all heads of a layer. Run over chunks (as in
    InfiniPot's comparison), the chunk's last token is the query; during generation each new token
    evicts one entry.

    Bound: `budget + chunk_size` entries per layer and KV head.
    """

    name = "tova"
    paper = "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA)"
    bound = "budget + chunk_size"
    budget: int = 1024
    chunk_size: int = 2048  # measured: 512-token chunks are launch-bound on a GPU (benchmarks/prefill-h100)
    positions: str = "shift"

    def __post_init__(self):
        check_positive(self, "budget", "chunk_size")
        check_policy(self, ("shift", "absolute"))

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> TOVA:
        return cls(budget=budget, **overrides)

    def max_entries(self) -> int:
        return self.budget + self.chunk_size

    def request(self, step: Step) -> AttentionRequest:
        return AttentionRequest(rows=(-1, None), row_reduce="sum", head_reduce="mean")

    def keep_count(self, layer, step: Step) -> int:
        return self.budget

    def ranking(self, layer, step: Step) -> Ranking:
        return Ranking(layer.observation.mean(dim=1, keepdim=True))  # [b, 1, n]: all heads of the layer
