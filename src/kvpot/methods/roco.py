from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot import kernels
from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods import replace
from kvpot.methods.base import EvictionMethod, Ranking, Step, check_policy, check_positive

SUM = "roco.sum"  # attention each entry received, summed over the queries that saw it
SQUARES = "roco.squares"  # the same for the attention squared (the second moment)
COUNT = "roco.count"  # queries that saw it (itself included)


@dataclass
class RoCo(EvictionMethod):
    """Robust Cache Omission: evict by mean attention, within a scope of entries whose attention is stable.

    Ren & Zhu, "On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language Model
    Inference" (2024), as its authors' EasyKV implements it (policy `h2o_head_std_avg`, which CItruS ran
    RoCo with): per KV head (the query heads of a group averaged), every entry keeps the sum and the
    sum of squares of the attention it received and the number of queries that saw it.

    - importance (Sec. 3): the mean attention score, sum / count: accumulated attention without
      H2O's bias towards old entries, which have simply been seen by more queries;
    - eviction scope (Sec. 4): only entries whose attention varies little may go; the `sinks` first
      entries, the `recent` newest and the `volatile * budget` entries with the largest standard
      deviation of received attention stay outside the scope (EasyKV: 4, 10 and 10% of the budget).
      The lowest-mean entries of the scope are evicted down to `budget`.

    The input is read in chunks of `chunk_size` (as CItruS ran every baseline, Sec. 5.2), evicting after
    each chunk and each generated token. Means and counts are exact; the second moment is exact in
    decoding (one query per forward), while a chunk's queries count with their mean attention (its
    spread within the chunk is not observed: kvpot observes column sums), so the std is the spread
    across forwards there. Positions "shift" by default, as kvpot runs H2O over long inputs.

    Bound: `budget + chunk_size` entries per layer and KV head (`budget` between forwards).
    """

    name = "roco"
    score_arrays = 3  # the sums, the squares and the counts
    paper = ("Ren & Zhu 2024, On the Efficacy of Eviction Policy for Key-Value Constrained Generative Language Model "
             "Inference (RoCo)")
    bound = "budget + chunk_size"
    chunk_dependent = True  # evicts after each forward; a forward's queries count with their mean attention (the std)
    evicts_while_decoding = True
    merges = False
    grows = False
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    budget: int = 1024
    sinks: int = 4
    recent: int = 10
    volatile: float = 0.1
    chunk_size: int = 2048  # as H2O and TOVA: 512-token chunks are launch-bound on a GPU
    positions: str = "shift"

    def __post_init__(self):
        check_positive(self, "budget", "chunk_size")
        for name in ("sinks", "recent"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise KvpotError(f"roco: {name} must be an integer >= 0, got {value!r}.")
        if not 0.0 <= float(self.volatile) < 1.0:
            raise KvpotError(f"roco: volatile must be in [0, 1), got {self.volatile!r}.")
        check_policy(self, ("shift", "absolute"))
        outside = self.sinks + self.recent + self.volatile_count()
        if outside >= self.budget:
            raise KvpotError(
                f"roco: a budget of {self.budget} cannot hold {self.sinks} sinks, {self.recent} recent and "
                f"{self.volatile_count()} volatile entries plus one chosen by its mean; use a budget above {outside}."
            )

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> RoCo:
        return cls(budget=budget, **overrides)

    def max_entries(self) -> int:
        return self.budget + self.chunk_size

    def volatile_count(self) -> int:
        return round(float(self.volatile) * self.budget)

    def request(self, step: Step) -> AttentionRequest:
        return AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean")

    def decode_request(self, plan: str) -> AttentionRequest:
        return self.request(step=None)  # the statistics grow at every step, evicting or not

    def update_scores(self, layer, step: Step) -> None:
        observed = layer.observation  # [b, kv, n]: attention summed over the forward's queries
        if step.n_new == 1:  # a decoding step: one query saw every entry (fewer kernels in each captured step)
            layer.score(SUM).add_(observed)
            layer.score(SQUARES).add_(observed.square())
            layer.score(COUNT).add_(1.0)
            return
        seen = rows_seen(layer.n, step.n_new, layer.device)
        layer.score(SUM).add_(observed)
        layer.score(SQUARES).add_(observed.square() / seen)  # each query taken at the forward's mean
        layer.score(COUNT).add_(seen)

    def decode_append(self, cache, step: Step) -> None:
        for layer in cache.layers:  # probs are zero past the live entries; a new entry's scores start at 0
            probs = layer.probs.unsqueeze(0)
            layer.scores[SUM].add_(probs)
            layer.scores[SQUARES].add_(probs.square())
            layer.scores[COUNT].add_(1.0)  # counts past the live entries are reset when one is appended

    def batch_append(self, layers, rows, index, live, step: Step) -> None:
        weight = live.view(-1, 1, 1)
        for layer in layers:
            probs = layer.observation_buffer()[: rows.numel()]
            layer.score(SUM).index_add_(0, rows, probs * weight)
            layer.score(SQUARES).index_add_(0, rows, probs.square() * weight)
            layer.score(COUNT).index_add_(0, rows, weight.expand_as(probs).contiguous())

    def keep_count(self, layer, step: Step) -> int:
        return self.budget

    def ranking(self, layer, step: Step) -> Ranking:
        mean, std = statistics(layer)
        scores = in_scope(mean, std, layer.positions[..., : layer.n], self.sinks, self.recent,
                          min(self.volatile_count(), layer.n))
        return Ranking(scores, sinks=self.sinks, recent=self.recent)

    def replace_fused(self, layer, step: Step, storage, rows, renumbers: bool) -> bool:
        """The steady step (`update_scores`, `ranking`, the replacement) in one Triton launch per layer
        (`kvpot.kernels.roco`) where the kernels run and a head's entries fit one tile; else False."""
        observed = layer.observation
        if step.n_new != 1 or observed is None or not kernels.available(storage.keys.device):
            return False
        from kvpot.kernels.roco import fits, roco_step

        stats = [storage.scores.get(name) for name in (SUM, SQUARES, COUNT)]
        if not fits(layer.n) or any(t is None for t in stats) or observed.dtype != torch.float32:
            return False
        roco_step(storage.keys, storage.values, storage.positions, storage.rope_positions, *stats, observed, layer.n,
                  rows, self.sinks, self.recent, min(self.volatile_count(), layer.n), renumbers)
        return True


def in_scope(mean: torch.Tensor, std: torch.Tensor, positions: torch.Tensor, sinks: int, recent: int,
             volatile: int) -> torch.Tensor:
    """The means [b, kv, n] a replacement ranks by: +inf for the `volatile` entries whose attention swings
    most (they are not in the eviction scope; the sinks and recent entries are protected by the ranking)."""
    if not volatile:
        return mean
    outside = protected(positions, sinks, recent)
    return mean.masked_fill(most_volatile(std, positions, outside, volatile), float("inf"))


def protected(positions: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """[b, kv, n] bool: the first `sinks` places (sinks never leave, so never move) and the `recent` newest
    entries by stream position (the newest last): `protect`'s entries in stream order, in any places."""
    outside = positions > positions[..., -1:] - recent
    outside[..., :sinks] = True
    return outside


def most_volatile(std: torch.Tensor, positions: torch.Tensor, outside: torch.Tensor, count: int) -> torch.Tensor:
    """[b, kv, n] bool: the `count` entries of largest std among those not `outside` the scope already, the
    older first among equal ones. The tie-break reads stream positions, not places, so a cache whose entries
    replacement moved picks the same entries as one in stream order: one top-k over int64 keys, the std's
    bits (a non-negative float orders as its bits) above the age."""
    key = (std.view(torch.int32).long() << 32) - positions  # 0 <= positions < 2**32: the age never reaches the bits
    key = key.masked_fill(outside, torch.iinfo(torch.long).min)
    chosen = torch.zeros_like(outside)
    return chosen.scatter_(-1, key.topk(count, dim=-1, sorted=False).indices, True)


def statistics(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation [b, kv, n] of the attention each live entry received."""
    return moments(layer.score(SUM), layer.score(SQUARES), layer.score(COUNT))


def moments(sums: torch.Tensor, squares: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation from the stored sum, sum of squares and count."""
    count = counts.clamp_min(1.0)
    mean = sums / count
    variance = (squares / count - mean.square()).clamp_min(0.0)
    return mean, variance.sqrt()


def steady_reference(keys, values, positions, rope_positions, stats: list[torch.Tensor], observation: torch.Tensor,
                     n: int, rows: torch.Tensor | None = None, sinks: int = 0, recent: int = 0, volatile: int = 0,
                     renumbers: bool = False) -> torch.Tensor:
    """`kernels.roco.roco_step` in PyTorch, on the buffers (`stats`: sums, squares, counts [S, kv, C]):
    `update_scores` of a decoding step, `ranking`, then `replace.replace_reference`. Returns the drops."""
    at = slice(None) if rows is None else rows
    live = [t[at, :, :n] for t in stats]  # views without rows, else copies written back
    observed = observation[..., :n]
    live[0].add_(observed)
    live[1].add_(observed.square())
    live[2].add_(1.0)
    if rows is not None:
        for t, values_ in zip(stats, live):
            t[rows, :, :n] = values_
    mean, std = moments(*live)
    scores = in_scope(mean, std, positions[at, :, :n], sinks, recent, volatile)
    return replace.replace_reference(keys, values, positions, rope_positions, list(stats), n, scores, rows, sinks,
                                     recent, renumbers)


def rows_seen(n: int, new: int, device) -> torch.Tensor:
    """[n] float: how many of a forward's `new` queries saw each of `n` entries (causal: the forward's
    own entry i, of its last `new`, is seen by the queries from i on)."""
    seen = torch.full((n,), float(new), device=device)
    seen[n - new :] = torch.arange(new, 0, -1, device=device, dtype=torch.float32)
    return seen
