from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods.base import EvictionMethod, Step, check_policy, check_positive, protect
from kvpot.methods.roco import rows_seen

LOW = "scissorhands.low"  # queries of the history window that gave the entry a low attention score


@dataclass
class Scissorhands(EvictionMethod):
    """Keep the pivotal entries: those rarely unimportant over a history window (persistence of importance).

    Liu et al., "Scissorhands: Exploiting the Persistence of Importance Hypothesis for LLM KV Cache
    Compression at Test Time" (NeurIPS 2023), Algorithms 1-2, per KV head (the query heads of a group
    averaged): the cache fills up to `budget` entries; when it is full it drops the `drop` entries
    (default 40% of the budget) that the last `history` queries (w = 400) most often gave an attention
    score below the uniform share 1/n (the counter of Algorithm 2), sparing the `recent` (r = 10)
    newest entries, then fills again. Ties in the counter go to the newer entry.

    Decoding follows the algorithm query by query: the compression Algorithm 1 runs before appending a
    token to a full cache happens at the end of the forward that filled it, with the same counters, so
    a query never sees more than `budget` entries. Counters restart at each compression, so the window
    is the last `history` queries since the previous one, hence `history <= drop`. The input is read in
    chunks of `chunk_size` (CItruS' setup for every baseline, Sec. 5.2), a forward's last `history`
    queries forming its window; a chunk's queries count with their mean attention (kvpot observes
    column sums, not each query's scores), exactly so with `chunk_size=1`. Positions "shift" by
    default, as kvpot runs H2O over long inputs.

    Bound: `budget + chunk_size - 1` entries per layer and KV head (`budget` while decoding).
    """

    name = "scissorhands"
    paper = "Liu et al. 2023, Scissorhands: Exploiting the Persistence of Importance Hypothesis (NeurIPS)"
    bound = "budget + chunk_size - 1 (budget while decoding)"
    # a forward's last `history` queries count with their mean attention; it compresses when a forward fills the cache
    chunk_dependent = True
    evicts_while_decoding = True
    merges = False
    grows = False
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    budget: int = 1024
    drop: int | None = None  # None: 40% of the budget, the paper's setting
    history: int = 400
    recent: int = 10
    chunk_size: int = 2048  # as H2O and TOVA: 512-token chunks are launch-bound on a GPU
    positions: str = "shift"

    def __post_init__(self):
        check_positive(self, "budget", "history", "chunk_size")
        if self.drop is not None:
            check_positive(self, "drop")
        if not isinstance(self.recent, int) or isinstance(self.recent, bool) or self.recent < 0:
            raise KvpotError(f"scissorhands: recent must be an integer >= 0, got {self.recent!r}.")
        check_policy(self, ("shift", "absolute"))
        drop = self.drop_count()
        if not 1 <= drop < self.budget or self.recent > self.budget - drop:
            raise KvpotError(
                f"scissorhands: a budget of {self.budget} cannot drop {drop} entries and still keep the "
                f"{self.recent} recent ones; use a drop from 1 to {self.budget - max(self.recent, 1)} or a larger budget."
            )
        if self.history > drop:
            raise KvpotError(
                f"scissorhands: the history window ({self.history}) must not exceed the drop amount ({drop}): "
                "counters restart at each compression, so the window only reaches back to the previous one."
            )

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> Scissorhands:
        if "history" not in overrides:  # a smaller budget drops fewer entries at a time: shorten the window
            drop = overrides.get("drop") or max(1, round(0.4 * budget))
            overrides["history"] = min(cls.history, drop)
        return cls(budget=budget, **overrides)

    def drop_count(self) -> int:
        return self.drop if self.drop is not None else max(1, round(0.4 * self.budget))

    def max_entries(self) -> int:
        return self.budget + self.chunk_size - 1

    def request(self, step: Step) -> AttentionRequest:
        return AttentionRequest(rows=(-self.history, None), row_reduce="sum", head_reduce="mean")

    def decode_request(self, plan: str) -> AttentionRequest:
        return AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean")  # one query: its window

    def update_scores(self, layer, step: Step) -> None:
        n, new = layer.n, step.n_new
        if n <= self.budget - self.history:
            return  # the forward's queries are older than the window of the next compression
        window = min(self.history, new)
        seen = rows_seen(n, new, layer.device).clamp_max(window)  # of the forward's last `window` queries
        mean = layer.observation / seen
        layer.score(LOW).add_(torch.where(mean < 1.0 / n, seen, 0.0))

    def decode_append(self, cache, step: Step) -> None:
        for layer in cache.layers:  # `length`: the live entries, the step's token included (device-side)
            n = layer.length.float()
            live = torch.arange(layer.capacity, device=layer.device) < layer.length
            low = (layer.probs < 1.0 / n) & live & (n > self.budget - self.history)
            layer.scores[LOW].add_(low.unsqueeze(0).float())

    def batch_append(self, layers, rows, index, live, step: Step) -> None:
        for layer, written in zip(layers, index):
            n = (written + 1).float().view(-1, 1, 1)  # [B]: each row's entries, its new one included
            probs = layer.observation_buffer()[: rows.numel()]
            alive = torch.arange(probs.shape[-1], device=probs.device).view(1, 1, -1) < n
            counted = (n > self.budget - self.history) & (live.view(-1, 1, 1) > 0)
            layer.score(LOW).index_add_(0, rows, ((probs < 1.0 / n) & alive & counted).float())

    def should_evict(self, layer, step: Step) -> bool:
        return layer.n >= self.budget  # full: Algorithm 1 compresses before the next token is appended

    def keep_count(self, layer, step: Step) -> int:
        return min(layer.n, self.budget) - self.drop_count()

    def scores(self, layer, step: Step) -> torch.Tensor:
        n = layer.n
        # fewer low scores rank higher; an equal count ranks the newer entry higher (exact in float32)
        order = torch.arange(n, device=layer.device, dtype=torch.float32)
        return protect(order - layer.score(LOW) * (n + 1), recent=self.recent)

    def after_forward(self, cache, step: Step) -> bool:
        evicted = super().after_forward(cache, step)
        if evicted:  # every layer holds the same count, so all compressed: the next window starts empty
            for layer in cache.layers:
                layer.score(LOW).zero_()
        return evicted

    def decode_plan(self, cache) -> str:
        n = max(cache.lengths())
        if n + 1 < self.budget:
            return "append"
        if n + 1 == self.budget and self.drop_count() == 1:
            return "steady"  # fills and drops one: back to the same count
        return "eager"  # the step that fills the cache compresses it (a shape change)
