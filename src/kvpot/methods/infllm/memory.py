"""InfLLM's context memory (Xiao et al. 2024, Sec. 3.2): representative scores, units, lookup.

kvpot's reading:

- The representative score of token m is r_m = sum of q_t . k_m over the queries whose local window
  holds m (t = m .. m + window - 1, m itself included, as the release's sliding window has it; the
  paper writes m+1 .. m+window), at the true distance t - m (RoPE), summed over the query heads of
  m's KV group. Scores are kept per KV head in the layer's score buffer `SCORE`, so they are saved,
  copied and pooled with the entries; a forward adds its queries' share.
- Since every term is a dot product with rotations that only depend on positions, the share of a
  forward's q queries is (sum of the rotated queries that see m) . rotated k_m: one prefix sum over
  the queries and one dot per key, never a [queries, keys] matrix.
- A unit is `block` consecutive tokens after the initial ones; it enters the memory once its last
  token has left the window of every query to come, i.e. once its scores are final. Its summary is
  the mean of its `reps` highest-scoring keys (un-rotated), per KV head.
- A lookup scores unit b by sum_i sum_j q_i . k_j (Sec. 3.2: the chunk's queries i, the unit's
  representatives j), which is (sum_i q_i) . (sum_j k_j): the chunk's summed queries, rotated at the
  shared distant position, against the summaries, summed over KV heads (one selection per layer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SCORE = "infllm.repr"  # the layer score buffer holding representative scores [b, kv, n]

# rotate(x [..., n, d], positions [n]) -> x rotated at `positions` (a `Turner`, whose `span(x, start)` rotates
# at start .. start + n - 1)
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def unit_count(window_start: int, initial: int, block: int) -> int:
    """Units complete before a window that starts at `window_start` (their scores are final)."""
    return max(0, window_start - initial) // block


def add_scores(score: torch.Tensor, keys: torch.Tensor, query: torch.Tensor, start: int, window: int,
               rotate: Rotate) -> None:
    """Add a forward's share to the representative scores.

    score [kv, n] float32 (the layer's live scores, updated in place); keys [kv, n - start, d] the
    un-rotated keys from `start` = max(0, first query - window + 1), the first that a query of this
    forward sees; query [h, q, d] un-rotated, the forward's queries at n - q .. n - 1.
    """
    kv, count, d = keys.shape
    h, q, _ = query.shape
    first = score.shape[1] - q  # position of the forward's first query
    # the group's heads share a rotation, so they are summed before it (rotation is linear)
    summed = query.float().view(kv, h // kv, q, d).sum(1)  # [kv, q, d]
    turned = rotate.span(summed, first - start)  # positions relative to `start`
    prefix = torch.zeros(kv, q + 1, d, dtype=torch.float32, device=keys.device)
    prefix[:, 1:] = turned.cumsum(1)
    # key start + i is seen by the queries t in [start + i, start + i + window - 1]: prefix rows clamped to 0 .. q
    seen = ramp(prefix, start + window - first, count) - ramp(prefix, start - first, count)  # [kv, count, d]
    score[:, start:] += (rotate.span(keys.float(), 0) * seen).sum(-1)


def ramp(prefix: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """prefix[:, clamp(i + offset, 0, q)] for i in 0 .. count - 1 (prefix [kv, q + 1, d]): the first row
    repeated, a slice, the last row repeated, so no index tensor and no gather."""
    q = prefix.shape[1] - 1
    low = min(max(-offset, 0), count)  # rows i + offset < 0 take row 0
    high = min(max(q - offset, low), count)  # rows i + offset >= q take row q
    pieces = [prefix[:, :1].expand(-1, low, -1), prefix[:, low + offset : high + offset],
              prefix[:, q:].expand(-1, count - high, -1)]
    return torch.cat([p for p in pieces if p.shape[1]], dim=1)


class Memory:
    """One layer's units: their summaries [capacity + 1, kv, d] float32, unit-major (a step scores them all
    in one matrix-vector product), a bias [capacity + 1] (0 for a summarised unit, -inf otherwise: the
    last row never holds one) and how many are summarised (`formed`)."""

    def __init__(self):
        self.summaries: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.formed = 0

    def clone(self) -> Memory:
        twin = Memory()
        if self.summaries is not None:
            twin.summaries, twin.bias = self.summaries.clone(), self.bias.clone()
        twin.formed = self.formed
        return twin

    @property
    def capacity(self) -> int:
        return 0 if self.summaries is None else self.summaries.shape[0] - 1

    def reserve(self, units: int, kv: int, d: int, device: torch.device) -> None:
        """Room for `units` summaries (doubling: eager decoding adds one every `block` tokens)."""
        if units <= self.capacity:
            return
        size = max(units, 2 * self.capacity, 16)
        summaries = torch.zeros(size + 1, kv, d, dtype=torch.float32, device=device)
        bias = torch.full((size + 1,), float("-inf"), dtype=torch.float32, device=device)
        if self.summaries is not None:
            summaries[: self.formed] = self.summaries[: self.formed]
            bias[: self.formed] = self.bias[: self.formed]
        self.summaries, self.bias = summaries, bias

    def form(self, upto: int, score: torch.Tensor, read_block: Callable[[int, int], torch.Tensor], initial: int,
             block: int, reps: int) -> None:
        """Summarise units `formed .. upto - 1`: read_block(start, stop) gives keys [kv, stop - start, d]."""
        if upto <= self.formed:
            return
        start, stop = initial + self.formed * block, initial + upto * block
        keys = read_block(start, stop)  # [kv, units * block, d]
        kv, _, d = keys.shape
        self.reserve(upto, kv, d, keys.device)
        units = upto - self.formed
        chosen = score[:, start:stop].view(kv, units, block).topk(reps, dim=-1).indices  # [kv, units, reps]
        picked = keys.view(kv, units, block, d).gather(2, chosen.unsqueeze(-1).expand(-1, -1, -1, d))
        self.summaries[self.formed : upto] = picked.float().mean(2).transpose(0, 1)
        self.bias[self.formed : upto] = 0.0
        self.formed = upto


def relevance(summed: torch.Tensor, summaries: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Each lookup's score for every unit: summed [c, kv, d] float32 (a lookup's queries, rotated at
    the distant position, summed over its rows and each group's heads), summaries [m, kv, d];
    units [c] long, the units complete for each lookup (later ones get -inf). Returns [c, m]."""
    scores = torch.einsum("ckd,mkd->cm", summed, summaries)
    later = torch.arange(summaries.shape[0], device=summed.device) >= units.view(-1, 1)
    return scores.masked_fill(later, float("-inf"))
