from __future__ import annotations

from dataclasses import dataclass

from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods import replace
from kvpot.methods.base import EvictionMethod, Ranking, Step, check_policy, check_positive

SCORE = "h2o"


@dataclass
class H2O(EvictionMethod):
    """Heavy hitters (largest accumulated attention) plus a window of recent entries.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
    Models" (NeurIPS 2023), Sec. 3-4: an entry's score is the attention it has received, summed
    over every query so far; keep the `recent` newest entries and the `heavy` highest-scoring
    others. Per KV head, the query heads of a group averaged. The input is read in chunks of
    `chunk_size`, evicting after each chunk and each generated token. Positions "shift" by default
    (as CItruS and InfiniPot ran it over long inputs); "absolute" is H2O's original.

    Bound: `heavy + recent + chunk_size` entries per layer and KV head.
    """

    name = "h2o"
    paper = "Zhang et al. 2023, H2O: Heavy-Hitter Oracle"
    bound = "heavy + recent + chunk_size"
    chunk_dependent = True  # evicts after each forward, by the attention accumulated up to it
    evicts_while_decoding = True
    merges = False
    grows = False
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    heavy: int = 512
    recent: int = 512
    chunk_size: int = 2048  # measured: 512-token chunks are launch-bound on a GPU (records/prefill-h100)
    positions: str = "shift"

    def __post_init__(self):
        check_positive(self, "heavy", "recent", "chunk_size")
        check_policy(self, ("shift", "absolute"))

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> H2O:
        if budget < 2:
            raise KvpotError(f"h2o: a budget of {budget} cannot hold heavy hitters and a recent window; use >= 2.")
        heavy = overrides.pop("heavy", budget // 2)
        return cls(heavy=heavy, recent=overrides.pop("recent", budget - heavy), **overrides)

    def max_entries(self) -> int:
        return self.heavy + self.recent + self.chunk_size

    def request(self, step: Step) -> AttentionRequest:
        return AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean")

    def update_scores(self, layer, step: Step) -> None:
        layer.score(SCORE).add_(layer.observation)

    def decode_request(self, plan: str) -> AttentionRequest:
        return self.request(step=None)  # scores accumulate at every step, evicting or not

    def decode_append(self, cache, step: Step) -> None:
        for layer in cache.layers:
            layer.scores[SCORE].add_(layer.probs.unsqueeze(0))  # zero past the live entries

    def batch_append(self, layers, rows, index, live, step: Step) -> None:
        accumulate(layers, SCORE, rows, live)

    def keep_count(self, layer, step: Step) -> int:
        return self.heavy + self.recent

    def ranking(self, layer, step: Step) -> Ranking:
        return Ranking(layer.score(SCORE), recent=self.recent)

    def replace_fused(self, layer, step: Step, storage, rows, renumbers: bool) -> bool:
        """A steady step in one launch: the observation added into the stored scores, the lowest sum outside
        the recent window dropped, the newest entry written into its slot (`replace.fold_replace`)."""
        return replace.fold_replace(layer, step, storage, rows, renumbers, "add", SCORE, recent=self.recent)


def accumulate(layers, name: str, rows, live) -> None:
    """Add each live row's observation to its slot's score `name` (a batched step's H2O/D2O update)."""
    for layer in layers:
        probs = layer.observation_buffer()[: rows.numel()]
        layer.score(name).index_add_(0, rows, probs * live.view(-1, 1, 1))
