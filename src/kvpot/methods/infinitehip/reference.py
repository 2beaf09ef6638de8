"""InfiniteHiP's hierarchical pruning and block-sparse attention, in plain PyTorch.

This is the reference implementation (Lee et al. 2025, "InfiniteHiP", Sec. 4 and Algorithms 2-3
of the paper; defaults from the authors' public release). It runs on CPU and GPU, never
materialises `[queries, keys]` for the whole context, and is what GPU kernels must match.

For each block of `query_block` consecutive queries:

1. **Always attended**: the first `sink` keys and a window of the most recent `window` keys
   (from `w0 = max(sink, t0 + 1 - window)` to the query, `t0` the block's first position).
2. **Stage 1** splits the middle `[sink, w0)` into chunks of `stages[0].chunk` keys. Each chunk
   gets a representative key by the halving search (Algorithm 3): split the chunk's range in two,
   score the middle key of each half against the block's queries (max over queries and over the
   query heads of each KV group, then over KV heads when the selection is shared), keep the better
   half, repeat down to one key. The chunk's score is that key's score. The top
   `keep // chunk` chunks survive.
3. **Later stages** split the survivors into smaller chunks and repeat.
4. **Final attention**: exact softmax attention over sinks + the last stage's tokens + the window.

Positions (Sec. 4 "Dynamic RoPE", Appendix D): keys arrive un-rotated. While pruning, the first
`early_layers` layers use chunk-indexed positions (a key takes its chunk's index in the stage's
candidate list, the queries `chunks + window`), the others relative positions (the left half's key
at 0, the right half's at 1, the queries at `window + 1`, as the release does). The final attention
uses streaming positions: sinks first, the selected keys consecutively after them, then the window
at its true spacing, the queries last, so no distance exceeds sink + selected + window + block.
`rope="absolute"` uses true positions everywhere (then keeping every chunk equals dense attention).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvpot.errors import KvpotError
from kvpot.methods.infinitehip.cached import all_cached, cached_decode
from kvpot.methods.infinitehip.hipscan import HipSearch

# Bound on the float elements of one scoring block ([kv, group, blocks, rows, chunks]) and of one
# gathered key set ([blocks, kv, keys, d]); blocks of queries are processed in groups below it.
MAX_ELEMENTS = 1 << 26

# rotate(x [..., n, d], positions [..., n]) -> x rotated at `positions` (leading dims broadcast)
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def no_rotation(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """For tests and position-free scoring: positions are ignored."""
    return x


@dataclass(frozen=True)
class Stage:
    """One pruning stage: candidate chunks of `chunk` keys, `keep` tokens passed on."""

    chunk: int
    keep: int

    @property
    def chunks_kept(self) -> int:
        return max(1, self.keep // self.chunk)


@dataclass(frozen=True)
class LayerPlan:
    """Everything one layer's sparse attention needs, resolved (no defaults left)."""

    stages: tuple[Stage, ...]
    sink: int
    window: int
    query_block: int
    prune_rope: str  # "chunk" | "relative" | "absolute"
    final_rope: str  # "streaming" | "absolute"
    shared: bool  # one selection for all KV heads (max over heads) or one per KV head
    scan: str = "paper"  # "paper": Algorithm 3 as written; "hip": hip-attn 1.2.9's scan (`hipscan.HipSearch`)

    def __post_init__(self):
        chunks = [s.chunk for s in self.stages]
        if any(a % b for a, b in zip(chunks, chunks[1:])):
            raise KvpotError(f"infinitehip: each stage's chunk must divide the previous one's, got {chunks}.")


@dataclass
class Selection:
    """A stage's output for a group of query blocks: surviving key ranges `[start, end)`.

    starts, ends: [s, blocks, chunks] long (s = 1 when shared, else kv_heads); empty ranges
    (start >= end) are padding. window_start: [blocks] long, the first key of each block's window;
    window_starts: the same on the host, so sizes derived from it never wait for the device.
    """

    starts: torch.Tensor
    ends: torch.Tensor
    window_start: torch.Tensor
    window_starts: tuple[int, ...] = ()
    memo: dict = field(default_factory=dict)  # what kernels derive from this selection, reused while cached

    def tokens(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token indices [s, blocks, chunks * chunk] and their validity."""
        offsets = torch.arange(chunk, device=self.starts.device)
        idx = (self.starts.unsqueeze(-1) + offsets).flatten(-2)  # [s, B, C*chunk]
        valid = idx < self.ends.unsqueeze(-1).expand(*self.ends.shape, chunk).flatten(-2)
        return idx, valid


@dataclass
class MaskCache:
    """Per-layer stage outputs kept between decoding steps (Sec. 4 "Sparse Attention Mask Caching")."""

    stages: list[Selection | None] = field(default_factory=list)
    recomputed: list[list[int]] = field(default_factory=list)  # per step, the stages recomputed

    def clone(self) -> MaskCache:
        return MaskCache(list(self.stages), [list(r) for r in self.recomputed])


def refresh_due(step: int, refresh: tuple[int, ...]) -> list[bool]:
    """Which stages decoding step `step` (0 = first) recomputes: stage i every `refresh[i]` steps."""
    return [step % every == 0 for every in refresh]


# ---------------------------------------------------------------------------- pruning


def halving_search(score: Callable[[torch.Tensor, int], torch.Tensor], left: torch.Tensor, right: torch.Tensor,
                   size: int) -> torch.Tensor:
    """Algorithm 3: the representative key of every range `[left, right)` (all [s, B, C] long).

    `score(idx, side)` scores keys `idx` [s, B, C] (side 0 = left half, 1 = right half) and returns
    [s, B, C]. Ranges hold at most `size` keys, so ceil(log2(size)) halvings reach one key
    (a fixed count: no host synchronisation). Empty ranges return `left` unchanged.
    """
    for _ in range(max(0, math.ceil(math.log2(size)))):
        active = right - left > 1
        center = (left + right) // 2
        left_key = (left + center) // 2  # middle of the left half [left, center)
        right_key = (center + right) // 2  # middle of the right half [center, right)
        go_left = score(left_key, 0) >= score(right_key, 1)
        right = torch.where(active & go_left, center, right)
        left = torch.where(active & ~go_left, center, left)
    return left


def _gather_keys(keys: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """keys [kv, n, d], idx [s, B, C] (s = 1 or kv) -> [kv, B, C, d]."""
    idx = idx.clamp(0, keys.shape[1] - 1)
    if idx.shape[0] == 1:
        return keys[:, idx[0]]
    heads = torch.arange(keys.shape[0], device=keys.device).view(-1, 1, 1)
    return keys[heads, idx]


class _Scorer:
    """Scores keys against a group of query blocks in one pruning style."""

    def __init__(self, queries: torch.Tensor, rows_valid: torch.Tensor, keys: torch.Tensor, plan: LayerPlan,
                 block_pos: torch.Tensor, rotate: Rotate, table: tuple[torch.Tensor, torch.Tensor] | None = None,
                 one_block: bool = False, live: torch.Tensor | None = None):
        # queries [kv, g, B, R, d] un-rotated; rows_valid [B, R]; block_pos [B, R] true positions; table: a RoPE
        # table (cos, sin) when the search runs in a Triton kernel; one_block (the call has one query block) and
        # live (a fixed-shape step's live key count, [1] long, its keys a whole buffer): read by scan="hip"
        self.queries, self.rows_valid, self.keys = queries, rows_valid, keys
        self.plan, self.block_pos, self.rotate, self.table = plan, block_pos, rotate, table
        self.one_block, self.live = one_block, live
        self.rotated: torch.Tensor | None = None

    def begin_stage(self, valid: torch.Tensor, stage: Stage | None = None) -> None:
        """Rotate the queries for a stage (`stage`, one of the plan's) whose candidates are `valid` [s, B, C]."""
        kv, g, b, r, d = self.queries.shape
        style = self.plan.prune_rope
        if style == "absolute":
            pos = self.block_pos.view(1, b, r)
        elif style == "relative":
            pos = torch.full((1, b, r), self.plan.window + 1, device=self.queries.device)
        else:  # chunk-indexed: queries after the stage's chunks and the window
            pos = (valid.sum(-1, keepdim=True) + self.plan.window).expand(-1, -1, r)  # [s, B, R]
        # [kv, g, B, R, d] rotated at [s, 1, B, R] (s broadcasts over kv)
        self.rotated = self.rotate(self.queries, pos.unsqueeze(1))

    def kept(self, score: torch.Tensor, count: int, starts: torch.Tensor, last: bool) -> torch.Tensor | None:
        """The candidates a stage keeps (None: all, as they are): the best `count`, ties to the earlier one (a
        stable sort), in place order: the same picks in the same places whatever empty ranges follow the list
        (a fixed-shape step pads it)."""
        if score.shape[-1] <= count:
            return None
        return score.sort(dim=-1, descending=True, stable=True).indices[..., :count].sort(dim=-1).values

    def search(self, starts: torch.Tensor, ends: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each range's representative [s, B, C] and its score (-inf for empty ranges)."""
        rep = halving_search(self, starts, ends, chunk)
        return rep, self(rep, 0).masked_fill(~(starts < ends), float("-inf"))

    def __call__(self, idx: torch.Tensor, side: int) -> torch.Tensor:
        """Scores [s, B, C] of keys idx [s, B, C]: max over the block's queries and each group's heads."""
        style = self.plan.prune_rope
        k = _gather_keys(self.keys, idx)  # [kv, B, C, d]
        if style == "absolute":
            k = self.rotate(k, idx)
        elif style == "relative":  # left half's key at 0, right half's at 1 (rotated even at 0: some
            k = self.rotate(k, torch.full_like(idx, side))  # RoPE variants scale cos/sin, e.g. yarn)
        else:
            order = torch.arange(idx.shape[-1], device=idx.device).expand_as(idx)
            k = self.rotate(k, order)
        scores = torch.einsum("kgbrd,kbcd->kgbrc", self.rotated, k.to(self.rotated.dtype)).float()
        scores = scores.masked_fill(~self.rows_valid.view(1, 1, *self.rows_valid.shape, 1), float("-inf"))
        scores = scores.amax(dim=(1, 3))  # [kv, B, C]
        return scores.amax(dim=0, keepdim=True) if self.plan.shared else scores


class _KernelScorer(_Scorer):
    """The same scoring, with the halving search of a whole stage in one Triton kernel."""

    def search(self, starts: torch.Tensor, ends: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kvpot.kernels.hip import stage_scan

        return stage_scan(self.rotated, self.rows_valid, self.keys, starts, ends, chunk, self.plan.prune_rope,
                          self.plan.shared, *self.table)


class _HipScorer(HipSearch, _Scorer):
    """`scan="hip"`: hip-attn 1.2.9's search (`kvpot.methods.infinitehip.hipscan`) with this module's scoring."""


def make_scorer(args: tuple, plan: LayerPlan, table: tuple[torch.Tensor, torch.Tensor] | None, **call) -> _Scorer:
    """The scorer of a plan: the paper's search or hip-attn's (`plan.scan`), in PyTorch, or in a Triton kernel
    when a RoPE `table` is given; `call`: `one_block`, `live` (`_Scorer`)."""
    kind = _HipScorer if plan.scan == "hip" else _Scorer if table is None else _KernelScorer
    return kind(*args, table=table, **call)


def _split(sel_starts: torch.Tensor, sel_ends: torch.Tensor, parent: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ranges [s, B, C] of at most `parent` keys into sub-ranges of `chunk` keys: [s, B, C*m]."""
    m = parent // chunk
    offsets = torch.arange(m, device=sel_starts.device) * chunk
    starts = (sel_starts.unsqueeze(-1) + offsets).flatten(-2)
    ends = torch.minimum(starts + chunk, sel_ends.unsqueeze(-1).expand(*sel_ends.shape, m).flatten(-2))
    return starts, ends


def run_stage(scorer: _Scorer, starts: torch.Tensor, ends: torch.Tensor, stage: Stage,
              keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every candidate range [s, B, C] by its representative; keep the best `keep` tokens' chunks."""
    valid = starts < ends
    scorer.begin_stage(valid, stage)
    _, score = scorer.search(starts, ends, stage.chunk)  # each range's representative's score
    order = scorer.kept(score, max(1, keep // stage.chunk), starts, stage is scorer.plan.stages[-1])
    if order is None:
        return starts, ends
    kept_starts, kept_ends = starts.gather(-1, order), ends.gather(-1, order)
    kept_valid = valid.gather(-1, order)
    return kept_starts, torch.where(kept_valid, kept_ends, kept_starts)  # padding picks stay empty


def prune(queries: torch.Tensor, rows_valid: torch.Tensor, keys: torch.Tensor, plan: LayerPlan, last_keep: int,
          block_pos: torch.Tensor, window_start: torch.Tensor, rotate: Rotate,
          cached: list[Selection | None] | None = None, due: list[bool] | None = None,
          window_starts: tuple[int, ...] = (), table: tuple[torch.Tensor, torch.Tensor] | None = None,
          one_block: bool | None = None) -> list[Selection]:
    """All stages for a group of query blocks; returns each stage's output.

    queries [kv, g, B, R, d] (un-rotated), rows_valid [B, R], keys [kv, n, d] (un-rotated),
    block_pos [B, R] positions of the queries, window_start [B] (and `window_starts`, the same on
    the host). With `cached` and `due` (decoding), a stage that is not due reuses its cached
    output. With a RoPE `table` (cos, sin) the search runs in the Triton scan kernel. `one_block`: whether the
    call has one query block in all (default: this group has one), which `scan="hip"` follows (`HipSearch.kept`).
    """
    kv = keys.shape[0]
    args = (queries, rows_valid, keys, plan, block_pos, rotate)
    scorer = make_scorer(args, plan, table, one_block=window_start.numel() == 1 if one_block is None else one_block)
    s = 1 if plan.shared else kv
    first = plan.stages[0].chunk
    if not window_starts:
        window_starts = tuple(window_start.tolist())
    span = max(window_starts) - plan.sink  # the widest middle region of the group
    count = max(1, math.ceil(max(span, 0) / first))
    starts = plan.sink + torch.arange(count, device=queries.device) * first
    starts = starts.view(1, 1, -1).expand(s, window_start.numel(), -1)  # [s, B, C]
    ends = torch.minimum(starts + first, window_start.view(1, -1, 1))
    outputs = []
    parent = first
    for i, stage in enumerate(plan.stages):
        if cached is not None and due is not None and not due[i] and cached[i] is not None:
            out = cached[i]
            starts, ends = out.starts, out.ends
        else:
            if i > 0:
                starts, ends = _split(starts, ends, parent, stage.chunk)
            keep = last_keep if i == len(plan.stages) - 1 else stage.keep
            starts, ends = run_stage(scorer, starts, ends, stage, keep)
            out = Selection(starts, ends, window_start, window_starts)
        outputs.append(out)
        parent = stage.chunk
    return outputs


# ---------------------------------------------------------------------------- attention


def _final_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     selection: Selection, chunk: int, plan: LayerPlan, block_pos: torch.Tensor,
                     rows_valid: torch.Tensor, rotate: Rotate, width: int) -> torch.Tensor:
    """Exact attention of the blocks' queries over sinks + selected + window.

    query [B, h, R, d] (un-rotated), keys/values [kv, n, d]; block_pos, rows_valid [B, R]; width
    (host) the widest window of the group, last query - window start + 1. Returns [B, h, R, d].
    """
    b, h, r, d = query.shape
    kv, n = keys.shape[0], keys.shape[1]
    device = keys.device
    w0 = selection.window_start  # [B]
    sel_idx, sel_valid = selection.tokens(chunk)  # [s, B, M]
    s = sel_idx.shape[0]
    sink_idx = torch.arange(plan.sink, device=device).view(1, 1, -1).expand(s, b, -1)  # [s, B, S]
    sink_valid = sink_idx < w0.view(1, -1, 1)
    last = block_pos.amax(dim=-1)  # [B] last query position of each block
    win_idx = (w0.view(-1, 1) + torch.arange(width, device=device)).view(1, b, -1).expand(s, -1, -1)  # [s, B, W]
    win_valid = win_idx <= last.view(1, -1, 1)
    idx = torch.cat([sink_idx, sel_idx, win_idx], dim=-1)  # [s, B, L]
    valid = torch.cat([sink_valid, sel_valid, win_valid], dim=-1)
    if plan.final_rope == "absolute":
        key_pos, query_pos = idx, block_pos.view(1, b, r)
    else:  # streaming: sinks, then selected keys consecutively, then the window at true spacing
        n_sink = sink_valid.sum(-1, keepdim=True)  # [s, B, 1]
        sel_pos = n_sink + sel_valid.cumsum(-1) - 1
        base = n_sink + sel_valid.sum(-1, keepdim=True)  # [s, B, 1]
        win_pos = base + (win_idx - w0.view(1, -1, 1))
        key_pos = torch.cat([sink_idx, sel_pos, win_pos], dim=-1)
        query_pos = base + (block_pos.view(1, b, r) - w0.view(1, -1, 1))  # [s, B, R]
    key_pos = key_pos.clamp(min=0).masked_fill(~valid, 0)
    k = _gather_keys(keys, idx)  # [kv, B, L, d]
    v = _gather_keys(values, idx)
    k = rotate(k, key_pos).transpose(0, 1)  # [B, kv, L, d]
    v = v.transpose(0, 1)
    g = h // kv
    q = query.reshape(b, kv, g, r, d).permute(1, 2, 0, 3, 4)  # [kv, g, B, R, d]
    q = rotate(q, query_pos.unsqueeze(1)).permute(2, 0, 1, 3, 4).reshape(b, h, r, d)
    causal = idx.unsqueeze(-2) <= block_pos.view(1, b, r, 1)  # [s, B, R, L]
    mask = (valid.unsqueeze(-2) & causal & (idx.unsqueeze(-2) < n)).transpose(0, 1)  # [B, s, R, L]
    mask = mask | ~rows_valid.view(b, 1, r, 1)  # padded rows: attend to anything, dropped later
    if s > 1:
        mask = mask.unsqueeze(2).expand(b, s, g, r, mask.shape[-1]).reshape(b, h, r, -1)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling,
                                          enable_gqa=True)


def sparse_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                     plan: LayerPlan, last_keep: int, rotate: Rotate, masks: MaskCache | None = None,
                     due: list[bool] | None = None, table: tuple[torch.Tensor, torch.Tensor] | None = None,
                     gpu_cache=None) -> torch.Tensor:
    """InfiniteHiP attention of the last `q` entries' queries over all `n` entries.

    query [h, q, d] (un-rotated), keys/values [kv, n, d] (keys un-rotated); the queries are the
    last `q` positions `n-q .. n-1`. `last_keep` is the last stage's token count for this layer.
    With `masks` (decoding, q == 1) each stage is reused unless `due`; the window then starts where
    it started when stage 1 last ran, so no key falls between the selection and the window.
    With a RoPE `table` (cos, sin) [P, d] covering every position used, the scan and the attention
    run in Triton (`kvpot.kernels.hip`); sizes come from the host, so nothing waits for the device.
    With `gpu_cache` (offloading), keys/values are in pinned host memory and the attention kernel
    reads them through that GPU cache. Returns [h, q, d].
    """
    h, q, d = query.shape
    kv, n = keys.shape[0], keys.shape[1]
    rows = plan.query_block
    offset = n - q
    if n - plan.window <= plan.sink and masks is None:  # not even the last query has a middle region: dense
        # (offloaded: the context is only sinks + window here, small enough to bring over)
        return _dense(query, keys.to(query.device), values.to(query.device), scaling, offset, rotate)
    if table is not None and all_cached(masks, due):
        return cached_decode(query, keys, values, scaling, plan, masks, table, gpu_cache)
    rows = min(rows, q)  # decoding: one row, not a padded block
    blocks = math.ceil(q / rows)
    s = 1 if plan.shared else kv
    candidates = max(1, math.ceil(max(n - plan.sink, 0) / plan.stages[0].chunk))
    per_block = max(kv * (h // kv) * rows * max(candidates, 1),
                    kv * (plan.sink + last_keep + plan.window + rows) * d * max(s, 1))
    group = max(1, MAX_ELEMENTS // per_block)
    if table is not None:  # the kernels never materialise per-block scores or gathered keys
        group = blocks
    outputs = []
    for first in range(0, blocks, group):
        last_block = min(blocks, first + group)
        lo, hi = first * rows, min(q, last_block * rows)
        nb = last_block - first
        pad = nb * rows - (hi - lo)
        block_q = F.pad(query[:, lo:hi], (0, 0, 0, pad)).view(h, nb, rows, d)  # [h, B, R, d]
        positions = offset + lo + torch.arange(nb * rows, device=query.device).view(nb, rows)  # [B, R]
        rows_valid = positions < n
        positions = positions.clamp(max=n - 1)
        block_starts = [offset + lo + i * rows for i in range(nb)]  # host copies of positions[:, 0]
        window_starts = tuple(max(plan.sink, t + 1 - plan.window) for t in block_starts)
        window_start = (positions[:, 0] + 1 - plan.window).clamp(min=plan.sink)  # [B]
        if masks is not None and masks.stages and not due[0] and masks.stages[0] is not None:
            window_start, window_starts = masks.stages[0].window_start, masks.stages[0].window_starts
        grouped = block_q.view(kv, h // kv, nb, rows, d)  # [kv, g, B, R, d]
        cached = masks.stages if masks is not None and masks.stages else None
        outputs_by_stage = prune(grouped, rows_valid, keys, plan, last_keep, positions, window_start, rotate,
                                 cached, due, window_starts, table, blocks == 1)
        if masks is not None:
            masks.recomputed.append([i for i, out in enumerate(outputs_by_stage)
                                     if cached is None or out is not cached[i]])
            masks.stages = outputs_by_stage
        selection, chunk = outputs_by_stage[-1], plan.stages[-1].chunk
        # the widest window of the group, from the window the selection was made with
        width = max(min(t + rows - 1, n - 1) - w + 1 for t, w in zip(block_starts, selection.window_starts))
        if table is not None:
            from kvpot.kernels import hip

            out = hip.sparse_attention(query[:, lo:hi], keys, values, scaling, selection.starts, selection.ends,
                                       chunk, selection.window_start, width, plan.sink, rows,
                                       plan.final_rope == "streaming", *table, offset=offset + lo,
                                       memo=selection.memo, gpu_cache=gpu_cache)  # [h, hi - lo, d]
            outputs.append(out)
            continue
        out = _final_attention(block_q.permute(1, 0, 2, 3), keys, values, scaling, selection, chunk, plan,
                               positions, rows_valid, rotate, width)  # [B, h, R, d]
        outputs.append(out.permute(1, 0, 2, 3).reshape(h, nb * rows, d)[:, : hi - lo])
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]


def _dense(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, offset: int,
           rotate: Rotate) -> torch.Tensor:
    """Causal attention at true positions, for when every key is a sink or in the window.

    Streaming and absolute positions coincide there (nothing is selected between the sinks and
    the window), so this is exactly what the sparse path would compute, without the gathers.
    """
    from kvpot.attention import attend

    q, n = query.shape[1], keys.shape[1]
    k = rotate(keys, torch.arange(n, device=keys.device).view(1, n))  # [kv, n, d]
    rotated = rotate(query, (offset + torch.arange(q, device=keys.device)).view(1, q))  # [h, q, d]
    return attend(rotated[None], k[None].to(query.dtype), values[None].to(query.dtype), scaling)[0]
