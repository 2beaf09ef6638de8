from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpot import kernels
from kvpot.attention import AttentionRequest
from kvpot.errors import KvpotError
from kvpot.methods import replace
from kvpot.methods.base import EvictionMethod, Step, check_policy, check_positive
from kvpot.methods.h2o import accumulate

SCORE = "cam"  # each entry's accumulated attention (Algorithm 1's A-bar)


@dataclass
class CaM(EvictionMethod):
    """Cache Merging: StreamingLLM's start + recent cache, evicted values merged into the kept ones.

    Zhang et al., "CaM: Cache Merging for Memory-efficient LLMs Inference" (ICML 2024), Algorithm 1
    as the authors' release runs it (`kv_cache_cam.py`, `modify_llama_cam.py`): the cache keeps the
    first `start` tokens and the `recent` newest; the token leaving the recent window is evicted,
    its key dropped and its value merged into the `merge_budget` (m) kept tokens right after it,
    `V_j += M * V_i / m`, with the merge mask `M ~ Bernoulli(clamp(A_i / mean(A_targets), 0, 1))`
    drawn from the accumulated attention A each entry has received (summed over every query so
    far, per KV head with the query heads of a group averaged). Keys are never merged.

    The mask is replaced by its expectation: `V_j += p_i * V_i / m` with `p_i` the Bernoulli
    probability, so runs are deterministic (the same tokens batched as alone, and under CUDA graphs)
    and the update is the mean of the paper's sampled one. `merge=False` is StreamingLLM with
    `sinks=start, window=recent`, exactly.

    Reading in chunks (`chunk_size`), a forward evicts the chunk's worth of tokens at once; each
    merges into the m kept tokens after it, the first m of the recent window (the paper evicts one
    token per step, where tokens merged into later-evicted ones pass their share on: `chunk_size=1`
    is that). The seed paper that compares CaM (D2O, Sec. 5.3, Table 2) reads the prompt with a
    full cache and keeps 20% of it; here the prompt streams through the cache, so memory stays
    bounded (a `chunk_size` as long as the prompt is D2O's setting: one forward, then compression
    to `start + recent`). The release's configurations split the budget evenly (`start_ratio =
    recent_ratio`), as `--budget` does; m = 32 is its `merge_budget`. Positions are shifted as in
    its streaming code (`pos_shift`); "absolute" keeps stream positions.

    Bound: `start + recent + chunk_size` entries per layer and KV head (`start + recent` between
    forwards).
    """

    name = "cam"
    paper = "Zhang et al. 2024, CaM: Cache Merging for Memory-efficient LLMs Inference"
    bound = "start + recent + chunk_size"
    # a forward evicts its chunk's worth of tokens at once, each merged into the m entries after it (one at a time,
    # merged shares pass on)
    chunk_dependent = True
    evicts_while_decoding = True
    merges = True  # evicted values are added into the kept entries that follow them (with `merge`, the default)
    grows = False
    copies_document = "at_admission"  # its question is read in a forward of its own, which reads and evicts the cache
    start: int = 512
    recent: int = 512
    merge_budget: int = 32
    merge: bool = True
    chunk_size: int = 2048
    positions: str = "shift"
    shared_selection = True  # start + the most recent: the same entries in every layer and head

    def __post_init__(self):
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise KvpotError(f"cam: start must be an integer >= 0, got {self.start!r}.")
        check_positive(self, "recent", "merge_budget", "chunk_size")
        if not isinstance(self.merge, bool):
            raise KvpotError(f"cam: merge must be true or false, got {self.merge!r}.")
        check_policy(self, ("shift", "absolute"))

    @classmethod
    def from_budget(cls, budget: int, **overrides) -> CaM:
        start = overrides.pop("start", budget // 2)
        if budget <= start:
            raise KvpotError(f"cam: a budget of {budget} cannot hold {start} start tokens plus a recent window; "
                             f"use a budget above {start}.")
        return cls(start=start, recent=overrides.pop("recent", budget - start), **overrides)

    def max_entries(self) -> int:
        return self.start + self.recent + self.chunk_size

    def keep_count(self, layer, step: Step) -> int:
        return self.start + self.recent

    def request(self, step: Step) -> AttentionRequest:
        return AttentionRequest(rows=None, row_reduce="sum", head_reduce="mean")

    def decode_request(self, plan: str) -> AttentionRequest:
        return self.request(step=None)  # A accumulates at every step, evicting or not

    def decode_append(self, cache, step: Step) -> None:
        for layer in cache.layers:
            layer.scores[SCORE].add_(layer.probs.unsqueeze(0))  # zero past the live entries

    def batch_append(self, layers, rows, index, live, step: Step) -> None:
        accumulate(layers, SCORE, rows, live)

    def after_forward(self, cache, step: Step) -> bool:
        keep = self.start + self.recent
        if cache.static and replace.enabled and step.n_new == 1 and all(layer.n == keep + 1 for layer in cache.layers):
            # a steady fixed-shape step: one entry out of every layer, no compaction; side by side on a GPU's streams
            for _, layer in replace.spread(cache.layers):
                if self.replace_fused(layer, step, layer, None, cache.policy.renumbers):
                    replace.took_newest(layer)
                    continue
                layer.score(SCORE).add_(layer.observation)
                self.replace(layer)
            return True
        for layer in cache.layers:
            layer.score(SCORE).add_(layer.observation)
        replace.restore_order(cache)  # what follows reads the entries' order from their places
        evicted = False
        for layer in cache.layers:
            if layer.n <= keep:
                continue
            gone = slice(self.start, layer.n - self.recent)  # entries in original order: the window's leavers
            if self.merge:
                merge_values(layer, gone, self.merge_budget)
            layer.select(start_and_recent(layer, self.start, self.recent))
            evicted = True
        return evicted

    def replace(self, layer) -> None:
        """The eviction of a decoding step's one extra entry by replacement (`kvpot.methods.replace`): the
        oldest entry after the start leaves (StreamingLLM's ring), its value merged first into the m entries
        that follow it in stream order, found by their stored positions; the newest entry takes its slot."""
        if not self.merge:
            replace.take_newest(layer, None, sinks=self.start)
            return
        drop = replace.find_drop(layer, None, sinks=self.start)  # [b, kv, 1]: the same entry in every head
        merge_into_next(layer, drop, min(self.merge_budget, self.recent))
        replace.take_newest(layer, drop=drop)

    def replace_fused(self, layer, step: Step, storage, rows, renumbers: bool) -> bool:
        """The steady step (A's update, `replace` after it) in one Triton launch per layer
        (`kvpot.kernels.cam`) where the kernels run; else False, nothing done."""
        observed = layer.observation
        if (step.n_new != 1 or observed is None or observed.dtype != torch.float32
                or not kernels.available(storage.keys.device) or storage.scores.get(SCORE) is None):
            return False
        from kvpot.kernels.cam import cam_step

        cam_step(storage.keys, storage.values, storage.positions, storage.rope_positions, storage.scores[SCORE],
                 observed, layer.n, rows, self.start, min(self.merge_budget, self.recent), self.merge, renumbers)
        return True


def merge_probability(evicted: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Algorithm 1's mask probability `clamp(A_i / mean(A_targets), 0, 1)`: evicted [b, kv, e] and
    targets [b, kv, m] accumulated attention -> [b, kv, e]. 0/0 gives 0 and x/0 gives 1, as the release's
    NaN and inf guards intend."""
    ratio = evicted / targets.mean(dim=-1, keepdim=True)
    return ratio.nan_to_num(nan=0.0, posinf=1.0).clamp(0.0, 1.0)


def merge_values(layer, gone: slice, budget: int) -> None:
    """Add `p_i * V_i / m` of every entry in `gone` to the m entries after it that stay (the first m of
    the recent window, which starts where `gone` ends)."""
    m = min(budget, layer.n - gone.stop)
    targets = slice(gone.stop, gone.stop + m)
    accumulated = layer.score(SCORE)
    prob = merge_probability(accumulated[..., gone], accumulated[..., targets])  # [b, kv, e]
    values = layer.values
    # one matrix product per head (float32 accumulation on GPUs); the sum of the e evicted values' shares
    share = torch.matmul(prob.unsqueeze(-2).to(values.dtype), values[:, :, gone]).float() / m  # [b, kv, 1, d]
    kept = values[:, :, targets]
    kept.copy_((kept.float() + share).to(values.dtype))


def merge_into_next(layer, drop: torch.Tensor, m: int) -> None:
    """`merge_values` of the one entry `drop` [b, kv, 1] into the m entries after it in stream order, in any
    places: those whose stored positions follow its own (the window's positions are consecutive), in the
    order of their positions, so the mean and the sums are `merge_values`' own."""
    merge_next(layer.values, layer.positions[:, :, : layer.n], layer.score(SCORE), drop, m)


def merge_next(values: torch.Tensor, positions: torch.Tensor, accumulated: torch.Tensor, drop: torch.Tensor,
               m: int) -> None:
    """`merge_into_next` on buffers: values [b, kv, C, d] (written), positions and accumulated [b, kv, n]."""
    positions = positions[:, :1]  # [b, 1, n]: a shared selection, every head the same
    gone = positions.gather(-1, drop[:, :1])  # [b, 1, 1]
    following = gone.unsqueeze(-1) + torch.arange(1, m + 1, device=positions.device).view(1, 1, m, 1)  # [b, 1, m, 1]
    targets = (positions.unsqueeze(-2) == following).to(torch.uint8).argmax(dim=-1)  # [b, 1, m]: their places
    targets = targets.expand(-1, values.shape[1], -1)
    prob = merge_probability(accumulated.gather(-1, drop), accumulated.gather(-1, targets))  # [b, kv, 1]
    d = values.shape[-1]
    share = torch.matmul(prob.unsqueeze(-2).to(values.dtype), values.gather(2, drop.unsqueeze(-1).expand(-1, -1, -1, d)))
    at = targets.unsqueeze(-1).expand(-1, -1, -1, d)
    values.scatter_(2, at, (values.gather(2, at).float() + share.float() / m).to(values.dtype))


def steady_reference(keys, values, positions, rope_positions, accumulated: torch.Tensor, observation: torch.Tensor,
                     n: int, rows: torch.Tensor | None = None, start: int = 0, m: int = 1, merge: bool = True,
                     renumbers: bool = False) -> torch.Tensor:
    """`kernels.cam.cam_step` in PyTorch, on the buffers (accumulated [S, kv, C]): `after_forward`'s steady
    step (A += observation, then `CaM.replace`) for the rows' slots `rows` (None: all). Returns the drops."""
    at = slice(None) if rows is None else rows
    live = accumulated[at, :, :n]  # a view without rows, else a copy written back
    live.add_(observation[..., :n])
    drop = replace.drop_index(None, positions[at, :, :n], sinks=start).expand(-1, keys.shape[1], 1)
    if merge:
        row_values = values[at]
        merge_next(row_values, positions[at, :, :n], live, drop, m)
        if rows is not None:
            values[rows] = row_values
    if rows is not None:
        accumulated[rows, :, :n] = live
    return replace.replace_reference(keys, values, positions, rope_positions, [accumulated], n, rows=rows,
                                     renumbers=renumbers, drop=drop, find=False)


def start_and_recent(layer, start: int, recent: int) -> torch.Tensor:
    """Indices [1, 1, start + recent] of the first `start` and last `recent` of the layer's entries."""
    device = layer.keys.device
    return torch.cat([torch.arange(start, device=device),
                      torch.arange(layer.n - recent, layer.n, device=device)]).view(1, 1, -1)
