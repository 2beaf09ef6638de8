"""InfiniteHiP's halving search as the authors' hip-attn 1.2.9 runs it (`InfiniteHiP(scan="hip")`), in PyTorch."""

from __future__ import annotations

import math

import torch


class HipSearch:
    """Mixed into `reference._Scorer` when `scan="hip"` (`reference.make_scorer`): the halving search as
    hip-attn 1.2.9's scan kernel runs it, for agreement with the authors' release (docs/methods.md,
    "InfiniteHiP beside hip-attn"). Two differences from Algorithm 3 as the paper states
    it (and `_Scorer` runs it):

    - each *query head* searches on its own path (its block's queries against its KV head's probes), and the
      heads' scores meet only once the search is over (hip-attn's `HIP_HEAD_REDUCE`, a max over heads; per KV head
      with `shared=False`), where the paper takes the max over heads at every split, so all heads share one path;
    - a chunk scores the best probe its path met (the running max of each step's winning probe; -32000 for a
      range too short to split, hip-attn's initial score), where the paper scores the representative key.
    """

    def _head_scores(self, idx: torch.Tensor, side: int) -> torch.Tensor:
        """Scores [h, B, C] of keys idx [h, B, C], each query head against its own keys: max over valid rows."""
        kv, g, b, r, d = self.queries.shape
        heads = torch.arange(kv, device=idx.device).repeat_interleave(g).view(-1, 1, 1)
        k = self.keys[heads, idx.clamp(0, self.keys.shape[1] - 1)]  # [h, B, C, d]
        style = self.plan.prune_rope
        if style == "absolute":
            k = self.rotate(k, idx)
        elif style == "relative":
            k = self.rotate(k, torch.full_like(idx, side))
        else:
            k = self.rotate(k, torch.arange(idx.shape[-1], device=idx.device).expand_as(idx))
        q = self.rotated.expand(kv, g, b, r, d).reshape(kv * g, b, r, d)
        scores = torch.einsum("hbrd,hbcd->hbrc", q, k.to(q.dtype)).float()
        return scores.masked_fill(~self.rows_valid.view(1, b, r, 1), float("-inf")).amax(2)

    def search(self, starts: torch.Tensor, ends: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, g = self.queries.shape[0], self.queries.shape[1]
        s, b, c = starts.shape
        per = kv * g // s  # query heads per selection
        left = starts.repeat_interleave(per, 0) if s > 1 else starts.expand(kv * g, b, c)
        right = ends.repeat_interleave(per, 0) if s > 1 else ends.expand(kv * g, b, c)
        best = torch.full(left.shape, -32000.0, device=left.device)
        for _ in range(max(0, math.ceil(math.log2(chunk)))):
            active = right - left > 1
            center = (left + right) // 2
            score_l = self._head_scores((left + center) // 2, 0)
            score_r = self._head_scores((center + right) // 2, 1)
            go_left = score_l >= score_r
            best = torch.where(active, torch.maximum(best, torch.where(go_left, score_l, score_r)), best)
            right = torch.where(active & go_left, center, right)
            left = torch.where(active & ~go_left, center, left)
        score = best.view(s, per, b, c).amax(1)
        return left.view(s, per, b, c)[:, 0], score.masked_fill(~(starts < ends), float("-inf"))
