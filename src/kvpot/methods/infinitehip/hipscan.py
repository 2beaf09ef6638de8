"""InfiniteHiP's halving search as the authors' hip-attn 1.2.9 runs it (`InfiniteHiP(scan="hip")`), in PyTorch."""

from __future__ import annotations

import math

import torch


def hip_columns(plan, n):
    """hip-attn 1.2.9's candidate count of each stage over `n` keys (its MAX_TSRC: the keys passed, or a paged
    cache's capacity): the first stage's chunks from the sinks to n - window, then each stage's kept chunks (its
    `stage_k // chunk`, at most what it had) split into the next stage's. With `scan_extend_backend="streaming"`
    a query block's queries sit at this count + window for the stage, whatever the block's own candidates.
    `n` an int (a list of ints back) or a long tensor on the device (a fixed-shape step: tensors back)."""
    chunks = [s.chunk for s in plan.stages]
    if isinstance(n, torch.Tensor):
        count = ((n - plan.sink - plan.window).clamp(min=0) + chunks[0] - 1) // chunks[0]
    else:
        count = math.ceil(max(0, n - plan.sink - plan.window) / chunks[0])
    out = [count]
    for i in range(1, len(chunks)):
        kept = plan.stages[i - 1].keep // chunks[i - 1]
        count = (count.clamp(max=kept) if isinstance(count, torch.Tensor) else min(count, kept)) \
            * (chunks[i - 1] // chunks[i])
        out.append(count)
    return out


class HipSearch:
    """Mixed into `reference._Scorer` when `scan="hip"` (`reference.make_scorer`): the halving search as
    hip-attn 1.2.9's scan kernel runs it, for agreement with the authors' release (docs/methods.md,
    "InfiniteHiP beside hip-attn"). Where it departs from Algorithm 3 as the paper states it (and `_Scorer`
    runs it):

    - each *query head* searches on its own path (its block's queries against its KV head's probes), and the
      heads' scores meet only once the search is over (hip-attn's `HIP_HEAD_REDUCE`, a max over heads; per KV head
      with `shared=False`), where the paper takes the max over heads at every split, so all heads share one path;
    - a chunk scores the best probe its path met (the running max of each step's winning probe, from -32000,
      hip-attn's initial score), where the paper scores the representative key; a tie goes right;
    - a range is searched whole while its left end is before the block's window (`reach`), even where it runs
      into the window;
    - in the first `early_layers` layers (chunk-indexed positions, hip-attn's `scan_extend_backend="streaming"`)
      the queries sit at hip-attn's column count of the stage + window (`hip_columns`, the same for every query
      block, capped at the query's own position), where the paper's reading counts each block's valid
      candidates. Each probe sits at its candidate's column on both sides, and with one query block the
      columns follow the order the previous stage's top-k left them in (`topk_order`).
    """

    def begin_stage(self, valid: torch.Tensor, stage=None) -> None:
        self.stage_index = next((i for i, s in enumerate(self.plan.stages) if s is stage), 0)
        self.columns = hip_columns(self.plan, self.live_keys())[self.stage_index]  # hip-attn's list length
        if self.plan.prune_rope != "chunk" or stage is None:
            super().begin_stage(valid, stage)
            return
        self.rotated = self.rotate(self.queries, self.stage_positions())

    def stage_positions(self) -> torch.Tensor:
        """[1, 1, B, R]: the queries' positions in a first layer's stage (hip-attn's column count + window, at
        most their own)."""
        b, r = self.block_pos.shape
        return self.block_pos.clamp(max=self.columns + self.plan.window).view(1, 1, b, r)

    def reach(self, starts: torch.Tensor, chunk: int) -> torch.Tensor:
        """Where hip-attn's search of each range may go: whole chunks (the first stage's cut at n - window, its
        MAX_TSRC - sliding_window_size), where kvpot's ranges end at the block's window. A range stays in play
        while its left end is before the window (hip-attn: `idx_tsrc_left <= pos_tdst_min`), so a range that
        runs into the window is searched into it; the keys there are attended as the window's anyway."""
        reach = starts + chunk
        if self.stage_index == 0:
            live = self.live_keys()
            reach = reach.clamp(max=(live - self.plan.window).clamp(min=0) if isinstance(live, torch.Tensor)
                                else max(live - self.plan.window, 0))
        return reach

    def live_keys(self):
        """hip-attn's MAX_TSRC here: the keys searched (an int), or a fixed-shape step's live count (a tensor),
        so that a captured step searches as the eager one over the live keys."""
        return self.keys.shape[1] if self.live is None else self.live

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

    def kept(self, score: torch.Tensor, count: int, starts: torch.Tensor, last: bool) -> torch.Tensor | None:
        """As the paper's search keeps (`_Scorer.kept`, place order), except with one query block: then a stage
        before the last passes its best on in `topk_order`, and the last stage's are put in position order
        (hip-attn sorts its final selection)."""
        if not self.one_block:
            return super().kept(score, count, starts, last)
        order = topk_order(score, count, self.columns)
        return order.gather(-1, starts.gather(-1, order).sort(dim=-1).indices) if last else order

    def search(self, starts: torch.Tensor, ends: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, g = self.queries.shape[0], self.queries.shape[1]
        if self.table is not None:  # `kvpot.kernels.hip.hip_stage_scan`: this search, a head's path in one launch
            from kvpot.kernels.hip import hip_stage_scan

            rotated = self.rotated.expand(kv, g, *self.rotated.shape[2:])
            return hip_stage_scan(rotated, self.rows_valid, self.keys, starts, ends, chunk, self.plan.prune_rope,
                                  *self.table, reach=self.reach(starts, chunk))
        s, b, c = starts.shape
        per = kv * g // s  # query heads per selection
        spread = (lambda x: x.repeat_interleave(per, 0)) if s > 1 else (lambda x: x.expand(kv * g, b, c))
        left, right, stop = spread(starts), spread(self.reach(starts, chunk)), spread(ends)
        best = torch.full(left.shape, -32000.0, device=left.device)
        for _ in range(max(0, math.ceil(math.log2(chunk)))):
            active = (left < right) & (left < stop)
            center = (left + right) // 2
            score_l = self._head_scores((left + center) // 2, 0)
            score_r = self._head_scores((center + right) // 2, 1)
            go_left = score_l > score_r  # hip-attn goes right on a tie
            best = torch.where(active, torch.maximum(best, torch.where(go_left, score_l, score_r)), best)
            right = torch.where(active & go_left, center, right)
            left = torch.where(active & ~go_left, center, left)
        score = best.view(s, per, b, c).amax(1)
        return left.view(s, per, b, c)[:, 0], score.masked_fill(~(starts < ends), float("-inf"))


def topk_order(score: torch.Tensor, count: int, live=None) -> torch.Tensor:
    """The indices of the best `count` of score [..., C] in the order CUDA's `torch.topk(sorted=False)` gives
    them: those above the k-th best in place order, then those equal to it, in place order (ties to the
    earlier place). hip-attn 1.2.9 keeps that order from one stage to the next when a call has one query block
    (decoding, a short chunk: `stage_prologue` sorts only when BDST > 1), and its first layers' probes sit at
    their places (`scan_extend_backend="streaming"`), so the order moves their positions. `live` (an int or a
    [1] long tensor, default C): the length of hip-attn's list, its k being min(count, live); past C its entries
    are out of play (a fixed-shape step's padding, or hip-attn's candidates past a block's window), so a k-th
    there ties with nothing and every pick stays in place. Picks below the k-th (padding) come last."""
    c = score.shape[-1]
    if live is None:
        live = c
    want = live.clamp(max=count) if isinstance(live, torch.Tensor) else torch.tensor(min(count, live))
    count = min(count, c)
    ranked = score.sort(dim=-1, descending=True, stable=True)
    picked = ranked.indices[..., :count]
    floor = torch.cat([ranked.values, ranked.values.new_full((*score.shape[:-1], 1), float("-inf"))], dim=-1)
    at = (want.to(score.device) - 1).clamp(0, c).reshape(*([1] * score.dim())).expand(*score.shape[:-1], 1)
    kth = floor.gather(-1, at)
    value = score.gather(-1, picked)
    group = (value == kth).long() + 2 * (value < kth).long()  # above, tied, below
    return picked.gather(-1, (picked + group * c).sort(dim=-1).indices)
