"""hip-attn 1.2.9's block selection (its scan stages) re-stated in plain PyTorch, next to kvpot's, with each
difference a switch: what `kvpot bench hip-reference` uses to say *why* the two select different keys.

Written from reading hip-attn's kernels (`hip_attn/v1_2/attention_extend.py`, `scan_stage.py`
`chunk_controllable_sampling_mask_cuda`, `stage_prologue.py`), not copied from them. For each block of
`query_block` queries and each pruning stage, hip-attn:

- **per_head**: runs the halving search (Algorithm 3) once per *query head*, each head following its own path
  (its queries against the probed keys of its KV head), and only then takes the max over heads of the chunk
  scores (`HIP_HEAD_REDUCE=1`, after the scan kernel). kvpot (and the paper's Algorithm 3, "max over queries and
  heads" at each split) takes the max over heads at every split, so all heads share one path;
- **path_max**: scores a chunk by the best score its search met (the running max of each step's winning probe),
  where kvpot (and the paper: "the maximum attention score between the query block and that chunk's
  representative token") scores the representative key itself;
- **strict**: moves right on a tie (`left > right` keeps the left half), kvpot's `scan="paper"` keeps the left half on a tie;
- **hip_region**: offers the first stage the same chunks for every block, `[sink + i * chunk, ...)` up to
  `n - window` (the last one cut there), and a chunk stays in play while its current left end is at most the
  block's first query - window, even where the chunk runs into the window; a stage keeps whole chunks (realigned
  to the chunk grid from the sinks). kvpot's `scan="paper"` cuts each block's candidates at its window's start.

- **topk_order** (one query block: decoding, a short chunk): a stage passes its picks on in the order CUDA's
  `torch.topk(sorted=False)` leaves them (`stage_prologue` sorts them only when BDST > 1); with **streaming**
  positions that order moves the probes. The final selection is sorted.

With every switch off this is kvpot's selection (`kvpot.methods.infinitehip.reference.prune`, shared, relative
style, `scan="paper"`); with `HIP` (and `streaming`, `topk_order` where they apply) it is `scan="hip"` before each
block's window; tests/test_hip_reference.py checks both. Positions: the later layers' style (`relative`: probes at 0 and
1, queries at window + 1), or with **streaming** the first layers' (hip-attn's `scan_extend_backend="streaming"`,
kvpot's chunk-indexed positions): a probe sits at its candidate's column in the stage, and the queries at hip-attn's
column count of the stage + window (capped at the query's own position), the same count for every block: the first
stage's chunks from the sinks to n - window, then each stage's kept chunks split into the next's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvpot.rope import rotate_half

HIP = dict(per_head=True, path_max=True, strict=True, hip_region=True)
KVPOT = dict(per_head=False, path_max=False, strict=False, hip_region=False)


@dataclass(frozen=True)
class Rule:
    chunks: tuple[int, ...]
    keep: tuple[int, ...]  # tokens each stage passes on
    sink: int
    window: int
    query_block: int
    per_head: bool = False
    path_max: bool = False
    strict: bool = False
    hip_region: bool = False
    streaming: bool = False  # the first layers' positions (see the module docstring)
    topk_order: bool = False  # one query block: stages pass their picks on in CUDA's unsorted top-k order


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position) -> torch.Tensor:
    return x * cos[position] + rotate_half(x) * sin[position]


def select(rule: Rule, query: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per stage, the ranges `(starts, ends)` [blocks, C] it keeps (empty ranges: start >= end).

    query [h, q, d] un-rotated, the last q positions of n; keys [kv, n, d] un-rotated; cos/sin [P, d] the RoPE
    table (P > window + 1). One selection shared by all heads, as kvpot's `selection="shared"` and hip-attn's
    default head reduction.
    """
    h, q, d = query.shape
    kv, n = keys.shape[0], keys.shape[1]
    g, r = h // kv, rule.query_block
    blocks = math.ceil(q / r)
    dev = keys.device
    padded = torch.nn.functional.pad(query, (0, 0, 0, blocks * r - q)).view(h, blocks, r, d)
    positions = n - q + torch.arange(blocks * r, device=dev).view(blocks, r)
    rows_ok = positions < n  # [B, R]
    first = positions[:, 0]  # [B]
    qrot = _rotate(padded.float(), cos.float(), sin.float(), rule.window + 1)  # relative: queries at window + 1
    krot = [_rotate(keys.float(), cos.float(), sin.float(), side) for side in (0, 1)]  # probes at 0 / 1
    head_kv = torch.arange(h, device=dev) // g
    limit = first - rule.window  # hip-attn: a chunk plays while its left end <= this
    w0 = (first + 1 - rule.window).clamp(min=rule.sink)  # kvpot: candidates end before the window

    columns = [math.ceil(max(0, n - rule.sink - rule.window) / rule.chunks[0])]  # hip-attn's, per stage
    for i in range(1, len(rule.chunks)):
        prev = rule.chunks[i - 1]
        columns.append(min(columns[-1], rule.keep[i - 1] // prev) * (prev // rule.chunks[i]))
    if rule.streaming:
        keys_f = keys.float()
    stage_q = [qrot]  # the queries of the stage being scanned

    def head_scores(idx: torch.Tensor, side: int) -> torch.Tensor:
        """[h, B, C] scores (max over valid rows) of keys idx [S, B, C] (S = 1 or h)."""
        idx = idx.clamp(0, n - 1)
        q_now = stage_q[0]
        if rule.streaming:  # each probe at its candidate's column
            column = torch.arange(idx.shape[-1], device=dev)
            source = keys_f[:, idx[0]] if idx.shape[0] == 1 else keys_f[head_kv.view(-1, 1, 1), idx]
            k = _rotate(source, cos.float(), sin.float(), column)
        elif idx.shape[0] == 1:
            k = krot[side][:, idx[0]]  # [kv, B, C, d]
        else:
            k = krot[side][head_kv.view(-1, 1, 1), idx]  # [h, B, C, d]
        if idx.shape[0] == 1:
            sc = torch.einsum("kgbrd,kbcd->kgbrc", q_now.view(kv, g, blocks, r, d), k).reshape(h, blocks, r, -1)
        else:
            sc = torch.einsum("hbrd,hbcd->hbrc", q_now, k)
        return sc.masked_fill(~rows_ok.view(1, blocks, r, 1), float("-inf")).amax(2)

    def reduce(sc: torch.Tensor) -> torch.Tensor:  # per path: shared paths decide on the max over heads
        return sc if rule.per_head else sc.amax(0, keepdim=True)

    # the first stage's candidates
    c0 = rule.chunks[0]
    if rule.hip_region:
        count = math.ceil(max(0, n - rule.sink - rule.window) / c0)
        starts = (rule.sink + torch.arange(count, device=dev) * c0).view(1, -1).expand(blocks, -1)
        ends = torch.clamp(starts + c0, max=n - rule.window)
    else:
        count = max(1, math.ceil(max(int(w0.max()) - rule.sink, 0) / c0))
        starts = (rule.sink + torch.arange(count, device=dev) * c0).view(1, -1).expand(blocks, -1)
        ends = torch.minimum(starts + c0, w0.view(-1, 1))
    out = []
    parent = c0
    for i, chunk in enumerate(rule.chunks):
        if i > 0:  # children of the kept ranges
            m = parent // chunk
            offsets = torch.arange(m, device=dev) * chunk
            starts = (starts.unsqueeze(-1) + offsets).flatten(-2)
            if rule.hip_region:  # whole realigned parents, split evenly
                ends = starts + chunk
            else:
                ends = torch.minimum(starts + chunk, ends.unsqueeze(-1).expand(*ends.shape, m).flatten(-2))
        if rule.streaming:  # queries at the stage's column count + window, at most their own positions
            at = positions.clamp(max=columns[i] + rule.window)
            stage_q[0] = _rotate(padded.float(), cos.float(), sin.float(), at)
        s = h if rule.per_head else 1
        left, right = starts.unsqueeze(0).expand(s, -1, -1), ends.unsqueeze(0).expand(s, -1, -1)
        best = torch.full(left.shape, -32000.0, device=dev)
        for _ in range(max(0, math.ceil(math.log2(chunk)))):
            if rule.hip_region:
                active = (left < right) & (left <= limit.view(1, -1, 1))
            else:
                active = right - left > 1
            center = (left + right) // 2
            sl = reduce(head_scores((left + center) // 2, 0))
            sr = reduce(head_scores((center + right) // 2, 1))
            go_left = sl > sr if rule.strict else sl >= sr
            if rule.hip_region:
                sl = sl.masked_fill(~active, float("-inf"))
                sr = sr.masked_fill(~active, float("-inf"))
            best = torch.where(active, torch.maximum(best, torch.where(go_left, sl, sr)), best)
            right = torch.where(active & go_left, center, right)
            left = torch.where(active & ~go_left, center, left)
        if rule.path_max:
            score = best
        else:
            score = reduce(head_scores(left, 0))
        score = score.amax(0)  # [B, C]: hip-attn's head reduction (a no-op for shared paths)
        if rule.hip_region:
            score = torch.where(starts <= limit.view(-1, 1), score, torch.full_like(score, -32000.0))
        else:
            score = score.masked_fill(starts >= ends, float("-inf"))
        kept = max(1, rule.keep[i] // chunk)
        if rule.topk_order:
            order = _unsorted_topk(score, min(kept, score.shape[-1]))
            if i == len(rule.chunks) - 1:  # hip-attn sorts the final selection
                order = order.gather(-1, starts.gather(-1, order).argsort(dim=-1))
            starts, ends = starts.gather(-1, order), ends.gather(-1, order)
        elif score.shape[-1] > kept:
            order = score.sort(dim=-1, descending=True, stable=True).indices[:, :kept].sort(dim=-1).values
            starts, ends = starts.gather(-1, order), ends.gather(-1, order)
            if not rule.hip_region:
                valid = score.gather(-1, order) > float("-inf")
                ends = torch.where(valid, ends, starts)
        if rule.hip_region:  # whole chunks of this stage from here on
            ends = starts + chunk
        out.append((starts, ends))
        parent = chunk
    return out


def _unsorted_topk(score: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk(score, k, sorted=False)'s indices as CUDA's kernel leaves them (its gather pass writes the
    values above the k-th in index order, then values equal to it, in index order, until k are out)."""
    c = score.shape[-1]
    kth = score.topk(k, dim=-1).values[:, -1:]
    above = score > kth
    equal = score == kth
    ties = equal & (equal.cumsum(-1) <= k - above.sum(-1, keepdim=True))
    rank = torch.arange(c, device=score.device) + (~above) * c  # above first, then ties, each in index order
    return rank.masked_fill(~(above | ties), 3 * c).sort(dim=-1).indices[:, :k]
