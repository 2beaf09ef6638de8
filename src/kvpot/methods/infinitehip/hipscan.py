"""InfiniteHiP's halving search as the authors' hip-attn 1.2.9 runs it (`InfiniteHiP(scan="hip")`), in PyTorch."""

from __future__ import annotations

import math

import torch


def hip_columns(plan, n: int) -> list[int]:
    """hip-attn 1.2.9's candidate count of each stage over `n` keys (its MAX_TSRC: the keys passed, or a paged
    cache's capacity): the first stage's chunks from the sinks to n - window, then each stage's kept chunks (its
    `stage_k // chunk`, at most what it had) split into the next stage's. With `scan_extend_backend="streaming"`
    a query block's queries sit at this count + window for the stage, whatever the block's own candidates."""
    chunks = [s.chunk for s in plan.stages]
    count = math.ceil(max(0, n - plan.sink - plan.window) / chunks[0])
    out = [count]
    for i in range(1, len(chunks)):
        count = min(count, plan.stages[i - 1].keep // chunks[i - 1]) * (chunks[i - 1] // chunks[i])
        out.append(count)
    return out


class HipSearch:
    """Mixed into `reference._Scorer` when `scan="hip"` (`reference.make_scorer`): the halving search as
    hip-attn 1.2.9's scan kernel runs it, for agreement with the authors' release (docs/methods.md,
    "InfiniteHiP beside hip-attn"). Two differences from Algorithm 3 as the paper states
    it (and `_Scorer` runs it):

    - each *query head* searches on its own path (its block's queries against its KV head's probes), and the
      heads' scores meet only once the search is over (hip-attn's `HIP_HEAD_REDUCE`, a max over heads; per KV head
      with `shared=False`), where the paper takes the max over heads at every split, so all heads share one path;
    - a chunk scores the best probe its path met (the running max of each step's winning probe; -32000 for a
      range too short to split, hip-attn's initial score), where the paper scores the representative key;
    - in the first `early_layers` layers (chunk-indexed positions, hip-attn's `scan_extend_backend="streaming"`)
      the queries sit at hip-attn's column count of the stage + window (`hip_columns`, the same for every query
      block, capped at the query's own position), where the paper's reading counts each block's valid
      candidates. Each probe sits at its candidate's column on both sides.
    """

    def begin_stage(self, valid: torch.Tensor, stage=None) -> None:
        if self.plan.prune_rope != "chunk" or stage is None:
            super().begin_stage(valid, stage)
            return
        index = next(i for i, s in enumerate(self.plan.stages) if s is stage)
        columns = hip_columns(self.plan, self.keys.shape[1])[index]
        b, r = self.block_pos.shape
        pos = self.block_pos.clamp(max=columns + self.plan.window).view(1, 1, b, r)
        self.rotated = self.rotate(self.queries, pos)

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

    table: tuple[torch.Tensor, torch.Tensor] | None = None  # a RoPE table (cos, sin): search in the Triton kernel

    def with_table(self, table: tuple[torch.Tensor, torch.Tensor] | None) -> HipSearch:
        self.table = table
        return self

    def search(self, starts: torch.Tensor, ends: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, g = self.queries.shape[0], self.queries.shape[1]
        if self.table is not None:  # `kvpot.kernels.hip.hip_stage_scan`: this search, a head's path in one launch
            from kvpot.kernels.hip import hip_stage_scan

            rotated = self.rotated.expand(kv, g, *self.rotated.shape[2:])
            return hip_stage_scan(rotated, self.rows_valid, self.keys, starts, ends, chunk, self.plan.prune_rope,
                                  *self.table)
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
