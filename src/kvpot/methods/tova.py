from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.attention import AttentionRequest
from kvpot.methods import replace
from kvpot.methods.base import EvictionMethod, Ranking, Step, check_policy, check_positive
from kvpot.models.parallel import all_heads


@dataclass
class TOVA(EvictionMethod):
    """Token Omission Via Attention: keep the entries the newest token attends to most.

    Oren et al., "Transformers are Multi-State RNNs" (2024), Sec. 3.3: when the cache exceeds its
    budget, drop the entry with the lowest attention from the current (last) query, averaged over
    the layer's heads, so one selection is shared by all heads of a layer (ranked by the heads' sum,
    `head_total`: the mean's order without its division, added in one fixed order on every path). Run over chunks (as in
    InfiniPot's comparison), the chunk's last token is the query; during generation each new token
    evicts one entry.

    Bound: `budget + chunk_size` entries per layer and KV head.
    """

    name = "tova"
    paper = "Oren et al. 2024, Transformers are Multi-State RNNs (TOVA)"
    bound = "budget + chunk_size"
    chunk_dependent = True  # each forward's last query ranks the entries
    evicts_while_decoding = True
    merges = False
    grows = False
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    budget: int = 1024
    chunk_size: int = 2048  # measured: 512-token chunks are launch-bound on a GPU (records/prefill-h100)
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
        # [b, 1, n]: all heads of the layer, every rank's under tensor parallelism (one selection for all)
        return Ranking(head_total(all_heads(layer.parallel, layer.observation)))

    def replace_fused(self, layer, step: Step, storage, rows, renumbers: bool) -> bool:
        """A steady step in one launch: the heads' sum and the drop found in the kernel, the newest entry
        written into the dropped one's slot (`replace.fold_replace`). Not under tensor parallelism: the kernel
        sums the heads it holds, and the sum must span every rank's (`ranking`)."""
        if layer.parallel is not None:
            return False
        return replace.fold_replace(layer, step, storage, rows, renumbers, "heads")


def head_total(observation: torch.Tensor) -> torch.Tensor:
    """[b, kv, n] -> [b, 1, n]: the sum over the KV heads, added in head order (`kernels.replace`'s HEADS adds
    them so; a reduction kernel's order is its own, and float sums depend on the order: the kept set would
    differ between paths at near-ties). The mean's ranking: dividing by the head count keeps the order."""
    total = observation[:, :1]
    for head in range(1, observation.shape[1]):
        total = total + observation[:, head : head + 1]
    return total
