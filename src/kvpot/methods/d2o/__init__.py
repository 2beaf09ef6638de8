from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot.attention import AttentionRequest
from kvpot.methods.d2o.budget import inverse_variance_budgets
from kvpot.errors import KvpotError
from kvpot.methods import replace
from kvpot.methods.d2o.merge import kernel_merges, merge_one, nearest_kept, nearest_other, weighted_merge
from kvpot.methods.base import DECODE_STEP, Method, Ranking, Step, check_policy, check_positive, top_indices
from kvpot.methods.h2o import accumulate
from kvpot.models.parallel import all_heads

SCORE = "d2o"  # accumulated attention per entry (eq. 6)
BUDGETS = "d2o.budgets"  # per-layer S_l, fixed at the end of the prompt
TAU = "d2o.tau"  # per-layer EMA thresholds [b, kv_heads] (eq. 10)
COUNTS = "d2o.counts"  # per-layer [b, kv_heads] int32 zeros: the one-launch step's count of finished splits
VARIANCE = "d2o.variance"  # the per-layer F_v the budgets came from (for Fig. 4-style plots)


@dataclass
class D2O(Method):
    """Dynamic Discriminative Operations (Wan et al., D2O, ICLR 2025 submission).

    The prompt is encoded with a full cache (chunked, memory-unconstrained as in the paper), while
    each entry accumulates the attention it receives (eq. 6's first case: column sums of the
    prompt's attention, per KV head with the query heads of a group averaged). At the end of the
    prompt:

    - **Layer budgets** (Sec. 4.1, eqs. 4-5): `F_v^l` is the variance over key positions of those
      column sums. The paper is silent on heads and scale; kvpot takes each KV head's variance,
      min-max normalises all (layer, head) variances of the model to [0, 1] together (column
      sums grow with the prompt, and raw variances of a long prompt would make the softmax one-hot),
      and averages per layer. `S_l = softmax(-F_v)_l * L * ratio * S` with `S` the prompt length
      (or `budget` entries per layer on average), clamped to `[sinks + 4, S]` by water-filling so
      the budgets still sum to the total. `layer_budget=False` gives every layer `ratio * S`.
    - **Token eviction** (Sec. 4.2.1, eqs. 6-8): per KV head, keep the first `sinks` entries, the
      `M` most recent and the top `N` by accumulated attention, `N:M = heavy_to_recent:1`.
    - **Dynamic merging** (Sec. 4.2.2, eqs. 9-12): each evicted key is matched to its most
      cosine-similar kept key (keys only; values share the match and the weights); it is merged
      when that similarity reaches the threshold tau (eq. 10: tau_0 = the mean of the evicted
      entries' best similarities at the prompt's compression; afterwards
      `tau_t = beta * max(U_t) + (1 - beta) * tau_{t-1}` at each eviction, per layer and KV head),
      with eq. 12's weights: `k_c <- (e k_c + sum_i exp(u_i) k_i) / (e + sum_i exp(u_i))`.
      Below the threshold the entry is dropped. `merge=False` is plain eviction.
    - **Decoding**: every generated token adds its attention to the scores, is appended, and one
      entry is evicted (and maybe merged), so each layer stays at exactly `S_l`.

    `merge=False, layer_budget=False` is H2O with attention sinks; `ratio=1` (no `budget`) keeps
    every entry, the uncompressed reference. Positions are absolute (the paper's setting: prompts
    inside the model's window).

    Bound: the prompt length during prefill; then `S_l` entries in layer l (on average
    `ratio * prompt` or `budget`) for the rest of the run.
    """

    name = "d2o"
    paper = "Wan et al., D2O: Dynamic Discriminative Operations for Efficient Generative Inference of LLMs"
    bound = "prompt length in prefill; S_l per layer afterwards (ratio * prompt, or budget, on average)"
    ratio: float = 0.2
    budget: int | None = None
    sinks: int = 4
    heavy_to_recent: float = 3.0
    beta: float = 0.7
    merge: bool = True
    layer_budget: bool = True
    chunk_size: int = 2048
    positions: str = "absolute"
    chunk_dependent = False  # the prompt's column sums add up over forwards; eviction waits for its end
    evicts_while_decoding = True  # each generated token evicts one entry, holding every layer at S_l
    merges = True  # an evicted entry is merged into its most similar kept one (with `merge`, the default)
    grows = True  # the prompt is cached whole before its compression
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache

    def __post_init__(self):
        if not 0.0 < float(self.ratio) <= 1.0:
            raise KvpotError(f"d2o: ratio must be in (0, 1], got {self.ratio!r}.")
        if self.budget is not None:
            check_positive(self, "budget")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise KvpotError(f"d2o: sinks must be an integer >= 0, got {self.sinks!r}.")
        if float(self.heavy_to_recent) <= 0:
            raise KvpotError(f"d2o: heavy_to_recent must be positive, got {self.heavy_to_recent!r}.")
        if not 0.0 <= float(self.beta) <= 1.0:
            raise KvpotError(f"d2o: beta must be in [0, 1], got {self.beta!r}.")
        check_positive(self, "chunk_size")
        check_policy(self, ("absolute",))
        if self.budget is not None and self.budget < self.sinks + 4:
            raise KvpotError(
                f"d2o: a budget of {self.budget} cannot hold the {self.sinks} sinks plus heavy and recent "
                f"entries; use a budget of at least {self.sinks + 4}."
            )

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> D2O:
        return cls(budget=budget, **overrides)

    def request(self, step: Step) -> AttentionRequest:
        return AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean")

    # ------------------------------------------------------------------ fixed-shape decoding
    def decode_plan(self, cache) -> str:
        budgets = cache.method_state.get(BUDGETS)
        if budgets is None or (self.budget is None and float(self.ratio) == 1.0):
            return "eager"
        if all(layer.n + 1 <= size for layer, size in zip(cache.layers, budgets)):
            return "append"
        if all(layer.n == size for layer, size in zip(cache.layers, budgets)):
            return "steady"
        return "eager"

    def decode_request(self, plan: str) -> AttentionRequest:
        return self.request(step=None)  # accumulated at every step

    def decode_append(self, cache, step: Step) -> None:
        for layer in cache.layers:
            layer.scores[SCORE].add_(layer.probs.unsqueeze(0))

    def batch_append(self, layers, rows, index, live, step: Step) -> None:
        accumulate(layers, SCORE, rows, live)

    # ------------------------------------------------------------------ budgets
    def layer_budgets(self, cache) -> list[int]:
        """S_l for every layer from the accumulated prompt attention (eqs. 4-5)."""
        prompt = cache.layers[0].n
        layers = len(cache.layers)
        per_layer = self.budget if self.budget is not None else float(self.ratio) * prompt
        low, high = min(prompt, self.sinks + 4), prompt
        variance = self.layer_variance(cache)
        cache.method_state[VARIANCE] = variance
        if not self.layer_budget:
            variance = torch.zeros_like(variance)
        return inverse_variance_budgets(variance, per_layer * layers, low, high)

    def layer_variance(self, cache) -> torch.Tensor:
        """F_v per layer: KV-head variances of the column sums, min-max normalised model-wide, averaged."""
        # a model split over GPUs holds each layer's scores on its own device: gather the [kv] variances
        device = cache.layers[0].device
        per_head = torch.stack([layer.score(SCORE)[0].var(dim=-1).to(device) for layer in cache.layers])  # [L, kv]
        per_head = all_heads(cache.parallel, per_head)  # tensor parallelism: every rank's heads, in model order
        span = (per_head.max() - per_head.min()).clamp_min(1e-12)
        return ((per_head - per_head.min()) / span).mean(dim=-1).cpu()  # [L]

    # ------------------------------------------------------------------ eviction
    def after_forward(self, cache, step: Step) -> bool:
        budgets = cache.method_state.get(BUDGETS)  # set only where something is compressed (not ratio 1)
        if (budgets is not None and cache.static and replace.enabled and step.n_new == 1
                and all(layer.n == size + 1 for layer, size in zip(cache.layers, budgets))):
            # a steady fixed-shape step: one entry out of every layer, the layers side by side on a GPU's streams
            for index, _ in replace.spread(cache.layers):
                # the step's attention added there (eq. 6), maybe in its kernel
                self.replace(cache, index, budgets[index])
            return True
        for layer in cache.layers:
            layer.score(SCORE).add_(layer.observation)
        if self.budget is None and float(self.ratio) == 1.0:
            return False  # ratio 1: nothing is compressed
        if budgets is None:
            if not step.prompt_end:
                return False
            budgets = cache.method_state[BUDGETS] = self.layer_budgets(cache)
        replace.restore_order(cache)  # what follows reads the entries' order from their places
        evicted = False
        for index, (layer, size) in enumerate(zip(cache.layers, budgets)):
            if layer.n > size:
                self.evict(cache, index, size)
                evicted = True
        return evicted

    def ranking(self, layer, size: int) -> Ranking:
        """Eqs. 7-8: the first `sinks`, the M most recent, then the top N by accumulated attention."""
        sinks = min(self.sinks, size)
        rest = size - sinks
        recent = max(1, round(rest / (1.0 + float(self.heavy_to_recent)))) if rest else 0
        return Ranking(layer.score(SCORE), sinks=sinks, recent=recent)

    def keep_indices(self, layer, size: int) -> torch.Tensor:
        """The kept entries, per KV head -> [b, kv, size] ascending."""
        return top_indices(self.ranking(layer, size).by_index(layer), size)

    def replace(self, cache, index: int, size: int) -> None:
        """`evict` of the one entry a decoding step adds (`kvpot.methods.replace`), the step's attention
        added to the scores first (eq. 6): the entry leaves, merged into its nearest other entry (eqs.
        9-12), and the new entry takes its slot. One launch where the kernels run (`fused`); else PyTorch."""
        layer = cache.layers[index]
        if self.fused(cache, index, size):
            replace.took_newest(layer)
            return
        layer.score(SCORE).add_(layer.observation)
        n, ranking = layer.n, self.ranking(layer, size)
        if not self.merge:
            replace.take_newest(layer, ranking.scores, ranking.sinks, ranking.recent)
            return
        drop = replace.find_drop(layer, ranking.scores, ranking.sinks, ranking.recent)
        keys, values = layer.keys[:, :, :n], layer.values[:, :, :n]
        similarity, target = nearest_other(keys, drop, layer.positions[:, :, :n])
        merge = similarity >= self._threshold(cache, index, similarity)
        merge_one(keys, values, drop, target, similarity, merge)
        replace.take_newest(layer, drop=drop)

    def fused(self, cache, index: int, size: int) -> bool:
        """The steady step of layer `index` as one kernel where the kernels run and its scores are the only
        ones stored: `kernels.replace.d2o_step` (eq. 6's update, eqs. 7-8's drop, 9-12's merge, the move), or
        without merging, `replace_newest` ranking by the scores with the observation added. False: not run."""
        layer = cache.layers[index]
        observed = layer.observation
        if observed is None or observed.dtype != torch.float32 or list(layer.scores) != [SCORE]:
            return False
        ranking = self.ranking(layer, size)  # its sinks and recent (the kernel adds the observation to the scores)
        renumbers = cache.policy.renumbers
        if not self.merge:
            return replace.fold_replace(layer, DECODE_STEP, layer, None, renumbers, "add", SCORE, ranking.sinks,
                                        ranking.recent)
        if not kernel_merges(layer.keys):
            return False
        from kvpot.kernels.replace import d2o_step

        first, tau = self._tau(cache, index, layer)
        count = cache.method_state.setdefault(COUNTS, {})
        if index not in count:  # zeros the kernel leaves at zero (made before a graph captures the step)
            count[index] = torch.zeros(layer.batch, layer.kv_heads, dtype=torch.int32, device=layer.device)
        d2o_step(layer.keys, layer.values, layer.positions, layer.rope_positions, layer.scores[SCORE], observed,
                 layer.n, tau, float(self.beta), first, count[index], sinks=ranking.sinks, recent=ranking.recent,
                 renumber=renumbers)
        return True

    def _tau(self, cache, index: int, layer) -> tuple[bool, torch.Tensor]:
        """Layer `index`'s eq. 10 threshold [b, kv] for a merge kernel, and whether this is its first eviction
        (a fresh tensor then, which the kernel sets to the similarity)."""
        taus = cache.method_state.setdefault(TAU, {})
        first = index not in taus
        if first:
            taus[index] = torch.zeros(layer.batch, layer.kv_heads, dtype=torch.float32, device=layer.device)
        return first, taus[index]

    def evict(self, cache, index: int, size: int) -> None:
        layer = cache.layers[index]
        keep = self.keep_indices(layer, size)
        if not self.merge:
            layer.select(keep)
            return
        dropped = _complement(keep, layer.n)  # [b, kv, n - size] ascending
        keys, values = layer.keys[:, :, : layer.n], layer.values[:, :, : layer.n]
        kept_k, kept_v = _take(keys, keep), _take(values, keep)
        gone_k, gone_v = _take(keys, dropped), _take(values, dropped)
        similarity, target = nearest_kept(gone_k, kept_k)  # [b, kv, e]
        merge = similarity >= self._threshold(cache, index, similarity)
        merged_k, merged_v = weighted_merge(kept_k, kept_v, gone_k, gone_v, similarity, target, merge)
        layer.select(keep)
        layer.keys[:, :, :size] = merged_k
        layer.values[:, :, :size] = merged_v

    def _threshold(self, cache, index: int, similarity: torch.Tensor) -> torch.Tensor:
        """Eq. 10 for layer `index`: tau_0 at the first eviction, then the EMA; [b, kv, 1]."""
        taus = cache.method_state.setdefault(TAU, {})
        if index not in taus:
            tau = similarity.mean(dim=-1)  # mean of the evicted entries' best similarities
        else:
            beta = float(self.beta)
            tau = beta * similarity.amax(dim=-1) + (1 - beta) * taus[index]
        if index in taus:
            taus[index].copy_(tau)  # in place: a captured decoding step reads and writes this tensor
        else:
            taus[index] = tau
        return taus[index].unsqueeze(-1)


def _take(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer [b, kv, n, d] gathered at index [b, kv, m] -> [b, kv, m, d]."""
    return torch.gather(buffer, 2, index.unsqueeze(-1).expand(-1, -1, -1, buffer.shape[-1]))


def _complement(keep: torch.Tensor, n: int) -> torch.Tensor:
    """Ascending indices of the entries of each head that `keep` [b, kv, k] leaves out."""
    if keep.shape[-1] == n - 1:  # one left out (every decoding step): 0 + ... + (n-1) less the kept
        return n * (n - 1) // 2 - keep.sum(dim=-1, keepdim=True)
    gone = torch.ones(*keep.shape[:2], n, dtype=torch.bool, device=keep.device)
    gone.scatter_(-1, keep, False)
    order = gone.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    return order[..., : n - keep.shape[-1]].sort(dim=-1).values
