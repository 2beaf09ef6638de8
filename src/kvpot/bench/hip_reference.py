"""`kvpot bench hip-reference`: kvpot's InfiniteHiP beside hip-attn 1.2.9 (the authors' kernels) on the same q/k/v.

For each length and configuration (`kvpot.bench.hip_mapping.CASES`), one layer's attention:

- **prefill**: the last `queries` positions as one extend call over all `n` keys. Per pruning stage, the keys each
  side keeps between the sinks and the window (kvpot's recall of hip-attn's selection, and its precision), and
  the outputs' errors against dense attention (true positions) and against each other;
- **decode**: `decode_steps` single-query steps growing the cache by one key each, with each side's mask refresh
  (`refresh`) and without it (every stage every step): the last stage's recall on the steps that recompute it,
  and the outputs' errors;
- **timing** on CUDA: microseconds per layer call (CUDA events; prefill the median of `repeats` calls, decode the
  mean over the steps, refreshes included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpot.bench.hip_inputs import Inputs
from kvpot.errors import KvpotError
from kvpot.bench.hip_mapping import HipCase, output_errors, overlap, range_mask
from kvpot.methods.infinitehip.reference import MaskCache, sparse_attention


@dataclass
class Side:
    out: torch.Tensor  # [heads, q, d]
    stages: list[tuple[torch.Tensor, torch.Tensor]]  # per stage, kept ranges (starts, ends) [blocks, C]
    micros: float | None = None


def _timed(fn, device: str, repeats: int):
    """fn()'s result and its median device time in microseconds (None on CPU)."""
    result = fn()
    if not device.startswith("cuda"):
        return result, None
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(1000.0 * a.elapsed_time(b))
    return result, sorted(times)[len(times) // 2]


def dense(inputs: Inputs, query: torch.Tensor, n: int) -> torch.Tensor:
    """Causal attention at true positions over the first n keys; query [h, q, d] = positions n-q .. n-1."""
    q = query.shape[1]
    table = lambda pos, x: inputs.rope.cos_sin(pos, x, n + 1)  # noqa: E731
    cos, sin = table(torch.arange(n, device=query.device).view(1, n), inputs.keys)
    from kvpot.rope import rotate_half

    k = inputs.keys[:, :n] * cos + rotate_half(inputs.keys[:, :n]) * sin
    cos, sin = table(torch.arange(n - q, n, device=query.device).view(1, q), query)
    rq = query * cos + rotate_half(query) * sin
    mask = torch.ones(q, n, dtype=torch.bool, device=query.device).tril(n - q)
    return F.scaled_dot_product_attention(rq[None], k[None], inputs.values[None, :, :n], attn_mask=mask,
                                          scale=inputs.scaling, enable_gqa=True)[0]


# ---------------------------------------------------------------------------- kvpot's side


def _kvpot_runtime(case: HipCase, inputs: Inputs, early: bool, decoding: bool, refresh: bool):
    method = case.kvpot_method(decoding)
    if not refresh:
        method.refresh = (1,) * len(method.refresh)
    runtime = method.runtime(method.early_layers + 1, None, inputs.rope)
    return runtime, 0 if early else method.early_layers


def kvpot_prefill(case: HipCase, inputs: Inputs, early: bool, device: str, repeats: int) -> Side:
    runtime, index = _kvpot_runtime(case, inputs, early, False, True)
    keys, n = inputs.keys, inputs.keys.shape[1]
    plan, last = runtime.plans[index], runtime.last_keep[index]
    bound = n + plan.window + 2
    table = runtime.table(inputs.query, bound + 1)

    def rotate(x, positions):
        from kvpot.rope import rotate_half

        cos, sin = inputs.rope.cos_sin(positions, x, bound)
        return x * cos + rotate_half(x) * sin

    masks = MaskCache()

    def call():
        return sparse_attention(inputs.query, keys, inputs.values, inputs.scaling, plan, last, rotate, masks=masks,
                                due=[True] * len(plan.stages), table=table)

    out, micros = _timed(call, device, repeats)
    blocks = math.ceil(inputs.query.shape[1] / plan.query_block)
    if masks.stages[0].starts.shape[1] != blocks:  # the PyTorch reference prunes in groups; the masks hold the last
        raise KvpotError(f"hip-reference: kvpot's PyTorch reference pruned {blocks} query blocks in groups; compare "
                         "on CUDA (the kernels prune all at once) or with fewer --queries.")
    return Side(out, [(s.starts[0], s.ends[0]) for s in masks.stages], micros)


# ---------------------------------------------------------------------------- hip-attn's side


def hip_args(hip, case: HipCase, inputs: Inputs, early: bool, positions: torch.Tensor, decoding: bool, **extra):
    """HiPAttentionArgs for this case; `extra`: more fields (the paged cache and masking query of a decoding step).
    extend_context_length is the keys' count (the cache's capacity: hip-attn's MAX_TSRC when it reads a paged
    cache, sglang's max_context_len)."""
    fields = case.hip_fields(early, decoding)
    stages = [hip.scan_stage(**stage) for stage in fields.pop("stages")]
    cos, sin = inputs.rope.table(int(positions.max()) + case.window + 2 * max(case.chunks) + 4096, inputs.keys)
    return hip.args(position_ids=positions.view(1, -1), stages=stages, rope_cos=cos, rope_sin=sin,
                    model_context_length=inputs.max_positions, extend_context_length=inputs.keys.shape[1],
                    layer_id=0 if early else 31, **fields, **extra)


def _bthd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0).contiguous()  # [h, t, d] -> [1, t, h, d]


def hip_query(query: torch.Tensor, scaling: float) -> torch.Tensor:
    """The query as hip-attn takes it: multiplied by the softmax scale first. Its attention kernels apply none
    (`attention_extend_bsa`: q * sqrt(d) / d^(1/4) against k / d^(1/4), a factor of 1), and every caller in the
    package (paged_hip.py: `query * sm_scale`, `query_for_mask * sm_scale`) scales first; the scan's selection does
    not change (a positive factor keeps every comparison)."""
    return (query * scaling).to(query.dtype)


def paged_cache(keys: torch.Tensor, values: torch.Tensor, length: int, width: int) -> dict:
    """keys/values [kv_heads, n, d] as hip-attn's paged KV cache (HiPAttentionArgs k_cache, v_cache, block_table,
    cache_seq_lens), the layout its sglang integration passes (paged_hip.py `_forward_paged_hip`): page size 1,
    k_cache / v_cache [slots, 1, kv_heads, d] (here a strided view of the n keys, no copy: hip-attn's kernels take
    every stride), block_table [1, width] int32 mapping position t to its slot (t for t < length; 0 beyond, as a
    fresh req_to_token row), cache_seq_lens [1] int32 = length (its kernels mask loads at t >= length). hip-attn
    reads key t of KV head h at k_cache[block_table[0, t // page], t % page, h] (uvm_gpu_cache.load_tokens)."""
    if keys.shape[1] < length or width < length:
        raise KvpotError(f"hip-reference: a paged view of {length} keys needs that many (have {keys.shape[1]}, "
                         f"table width {width}).")
    columns = torch.arange(width, device=keys.device, dtype=torch.int32)
    table = torch.where(columns < length, columns, torch.zeros_like(columns)).view(1, width)
    return dict(k_cache=keys.transpose(0, 1).unsqueeze(1), v_cache=values.transpose(0, 1).unsqueeze(1),
                block_table=table, cache_seq_lens=torch.tensor([length], device=keys.device, dtype=torch.int32))


def read_paged(paged: dict, which: str = "k_cache") -> torch.Tensor:
    """What hip-attn reads through a paged cache, as [kv_heads, length, d]: a plain gather through the block table
    (for tests: it must equal keys[:, :length])."""
    cache, table, length = paged[which], paged["block_table"][0], int(paged["cache_seq_lens"][0])
    t = torch.arange(length, device=table.device)
    page_size = cache.shape[1]
    return cache[table[t // page_size].long(), t % page_size].transpose(0, 1)


def hip_stage_ranges(metadata, case: HipCase, chunks: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per stage, the ranges hip-attn kept, for query head 0 (the heads share one selection under its default
    HIP_HEAD_REDUCE=1): stage i < last from the next stage's cached input, the last from `indices`/`ks`."""
    out = []
    for cache in (metadata.stage_caches or [])[1:]:
        out.append((cache.indices_left[0, :, 0], cache.indices_right[0, :, 0]))
    idx, ks = metadata.indices[0], metadata.ks[0]  # [blocks, K], [blocks]
    live = torch.arange(idx.shape[-1], device=idx.device).view(1, -1) < ks.view(-1, 1)
    starts = torch.where(live, idx, 0)
    out.append((starts, torch.where(live, idx + chunks[-1], 0)))
    return out


def hip_prefill(hip, case: HipCase, inputs: Inputs, early: bool, device: str, repeats: int) -> Side:
    n, q = inputs.keys.shape[1], inputs.query.shape[1]
    positions = torch.arange(n - q, n, device=inputs.keys.device)
    args = hip_args(hip, case, inputs, early, positions, False)
    qh, kh, vh = _bthd(hip_query(inputs.query, inputs.scaling)), _bthd(inputs.keys), _bthd(inputs.values)
    (out, metadata), micros = _timed(lambda: hip.attention(qh, kh, vh, args), device, repeats)
    return Side(out[0].transpose(0, 1), hip_stage_ranges(metadata, case, case.chunks), micros)


# ---------------------------------------------------------------------------- comparing


def region_ends(case: HipCase, n: int, q: int, blocks: int, device) -> torch.Tensor:
    """Per query block, where the keys both sides choose from end: before kvpot's window, hip-attn's candidate
    limit (n - window) and hip-attn's wider final window (window + first chunk + block)."""
    first = n - q + torch.arange(blocks, device=device) * case.query_block
    kvpot_w0 = (first + 1 - case.window).clamp(min=case.sink)
    hip_w0 = first + 1 - (case.window + case.chunks[0] + case.query_block)
    return torch.minimum(torch.minimum(kvpot_w0, hip_w0), torch.full_like(first, n - case.window)).clamp(min=case.sink)


def compare_stages(kvpot: Side, hip: Side, case: HipCase, n: int, q: int) -> list[dict]:
    rows = []
    for i, ((ks, ke), (hs, he)) in enumerate(zip(kvpot.stages, hip.stages)):
        blocks = min(ks.shape[0], hs.shape[0])
        ends = region_ends(case, n, q, blocks, ks.device)
        stats = {"stage": i + 1, "chunk": case.chunks[i]}
        stats.update(_pooled(ks[:blocks], ke[:blocks], hs[:blocks], he[:blocks], n, ends, case.sink))
        rows.append(stats)
    return rows


def _pooled(ks, ke, hs, he, n, ends, sink, group: int = 64) -> dict:
    """overlap() over blocks in groups (a [blocks, n] mask at 1M keys would not fit)."""
    total = {"hip_keys": 0, "kvpot_keys": 0, "common": 0, "blocks": 0}
    worst = []
    for lo in range(0, ks.shape[0], group):
        part = overlap(range_mask(ks[lo:lo + group], ke[lo:lo + group], n),
                       range_mask(hs[lo:lo + group], he[lo:lo + group], n), ends[lo:lo + group], sink)
        for key in total:
            total[key] += part[key]
        if part["block_recall_min"] is not None:
            worst.append(part["block_recall_min"])
    total["recall"] = total["common"] / total["hip_keys"] if total["hip_keys"] else None
    total["precision"] = total["common"] / total["kvpot_keys"] if total["kvpot_keys"] else None
    total["block_recall_min"] = min(worst) if worst else None
    return total


def compare_outputs(kvpot_out, hip_out, reference) -> dict:
    return {"kvpot_vs_dense": output_errors(kvpot_out, reference), "hip_vs_dense": output_errors(hip_out, reference),
            "kvpot_vs_hip": output_errors(kvpot_out, hip_out)}


def restated(case: HipCase, inputs: Inputs, hip: Side, switches: dict) -> list[dict]:
    """hip-attn's selection rule re-stated in PyTorch (`kvpot.bench.hip_rule`, later layers only) on the same
    inputs: per stage, its recall of the keys hip-attn itself kept (1.0 = the rule is hip-attn's)."""
    from kvpot.bench.hip_rule import Rule, select

    n, q = inputs.keys.shape[1], inputs.query.shape[1]
    cos, sin = inputs.rope.table(n + case.window + 2, inputs.keys)
    rule = Rule(case.chunks, case.keep, case.sink, case.window, case.query_block, **switches)
    ranges = select(rule, inputs.query, inputs.keys, cos, sin)
    return compare_stages(Side(inputs.query, ranges), hip, case, n, q)


def prefill_row(hip, case: HipCase, inputs: Inputs, early: bool, device: str, repeats: int) -> dict:
    from kvpot.bench.hip_rule import HIP

    n, q = inputs.keys.shape[1], inputs.query.shape[1]
    mine = kvpot_prefill(case, inputs, early, device, repeats)
    theirs = hip_prefill(hip, case, inputs, early, device, repeats)
    reference = dense(inputs, inputs.query, n)
    extra = {}
    if not early and case.stride_q == (1,) * len(case.chunks) and not case.landmark:
        extra["restated_rule"] = [{k: st[k] for k in ("stage", "recall", "precision")}
                                  for st in restated(case, inputs, theirs, HIP)]
    return {"phase": "prefill", "queries": q, "stages": compare_stages(mine, theirs, case, n, q), **extra,
            "errors": compare_outputs(mine.out, theirs.out, reference),
            "kvpot_us": mine.micros, "hip_us": theirs.micros, "blocks": math.ceil(q / case.query_block)}


# ---------------------------------------------------------------------------- decoding


def hip_refresh_stage(step: int, refresh: tuple[int, ...]) -> int | None:
    """The first stage hip-attn recomputes at decoding step `step` (HiPMaskRefreshState.update), None for none."""
    for i, every in enumerate(refresh):
        if step % every == 0:
            return i
    return None


class HipDecoder:
    """hip-attn's decoding steps with its mask refresh: the caller's side of `cached_metadata`, as hip-attn's
    memory pool builds it (stage i recomputed from its cached input; none: the last indices reused)."""

    def __init__(self, hip, case: HipCase, inputs: Inputs, early: bool, refresh: bool):
        self.hip, self.case, self.inputs, self.early = hip, case, inputs, early
        self.refresh = case.refresh if refresh else (1,) * len(case.refresh)
        self.last = None
        self.stage_caches = None

    def cached(self, step: int):
        stage = hip_refresh_stage(step, self.refresh)
        if self.last is None or stage == 0:
            return None, True
        empty = dict(mask_cache_statistics=None, sa_cache_statistics=None)
        if stage is None:
            last = self.last
            return self.hip.metadata(indices=last.indices, ks=last.ks, ks_count=last.ks_count,
                                     ks_start_end=last.ks_start_end, stage_caches=None, **empty), False
        return self.hip.metadata(indices=None, ks=None, ks_count=None, ks_start_end=None,
                                 stage_caches=list(self.stage_caches[:stage + 1]), **empty), True

    def __call__(self, step: int, query: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
        """One step: query [heads, 1, d] at position n - 1 over the first n keys -> ([heads, 1, d], recomputed).

        Sent as hip-attn's serving integration sends a decoding step (paged_hip.py `_forward_paged_hip`,
        is_decode=True): k and v None, the keys and values in its paged cache (`paged_cache`: page size 1,
        block_table over the cache's capacity, cache_seq_lens = n), the query scaled (`hip_query`). Its
        block-sparse attention then runs its decoding kernel (`decode_block_sparse_attention`, chosen for fewer
        than 32 query rows, which accepts only a paged cache) on the one query row.

        The scan gets the same query twice, as a separate masking query (`HiPAttentionArgs.q_mask`, the hook
        sglang's `query_for_mask` uses; position_ids follow it: [n - 1, n - 1]): hip-attn 1.2.9's single-row scan
        kernel (`decode_chunk_controllable_sampling_mask_cuda`, taken when the masking query has one row) does not
        compile with `using_extend=True` (its config's default), with plain or paged keys alike: it passes the
        Python constant `True` as a query mask into code that calls `.to()` on it (Triton 3.6.0: "'bool' object
        has no attribute 'to'") and loads a [1, d] RoPE row under a [heads, d] mask (Triton 3.4.0). Two rows take
        its prefill scan kernel, whose max over a block's rows is the one query's. hip-attn then sizes its final
        window with a query block of 2 (one key more than a single-row scan would).

        Checked on a CPU under Triton's interpreter (benchmarks/hip-reference-h100/interpret.py): the paged cache
        reads the same keys as plain k/v, and with one split per section the decoding kernel's output is its
        prefill kernel's on the same selection. With its default splits it weighs a sparse block once per split
        that reads it (a split steps BLOCK_BK blocks past its own end where ceil(blocks / splits) is no multiple of
        BLOCK_BK): hip-attn's decoding as it ships, measured as it is here."""
        cached, recomputed = self.cached(step)
        q = hip_query(query, self.inputs.scaling)
        positions = torch.full((2,), n - 1, device=query.device)
        capacity = self.inputs.keys.shape[1]
        paged = paged_cache(self.inputs.keys, self.inputs.values, n, capacity)
        args = hip_args(self.hip, self.case, self.inputs, self.early, positions, True,
                        q_mask=_bthd(torch.cat([q, q], dim=1)), **paged)
        out, metadata = self.hip.attention(_bthd(q), None, None, args, cached)
        if recomputed:
            self.last = metadata
            self.stage_caches = metadata.stage_caches
        return out[0].transpose(0, 1), recomputed


def _steps(case, inputs, early, refresh, hip, steps):
    """Fresh decoding state on both sides; yields (s, query, length, kvpot call, hip call)."""
    n = inputs.keys.shape[1]
    runtime, index = _kvpot_runtime(case, inputs, early, True, refresh)
    runtime.decoding = True
    theirs = HipDecoder(hip, case, inputs, early, refresh)
    for s in range(steps):
        length = n - steps + s + 1
        query = inputs.query[:, inputs.query.shape[1] - steps + s:][:, :1]
        keys, values = inputs.keys[:, :length], inputs.values[:, :length]

        def mine(query=query, keys=keys, values=values):
            out = runtime.attend(index, query, keys, values, inputs.scaling, True)
            runtime.step += 1
            return out
        yield s, query, length, mine, (lambda s=s, query=query, length=length: theirs(s, query, length)), \
            runtime.masks[index], theirs


def decode_row(hip, case: HipCase, inputs: Inputs, early: bool, device: str, steps: int, refresh: bool) -> dict:
    """`steps` decoding steps on both sides: the query at position n - steps + s over its first keys; then, on
    CUDA, the same steps again on fresh state (kernels compiled) timed per call."""
    decode_chunks = case.decode_chunks or case.chunks
    errors, recalls = [], []
    for s, query, length, mine, hips, masks, theirs in _steps(case, inputs, early, refresh, hip, steps):
        out_mine = mine()
        out_hip, recomputed = hips()
        errors.append(compare_outputs(out_mine, out_hip, dense(inputs, query, length)))
        if recomputed and masks.recomputed[-1]:  # both recomputed a selection this step
            sel = masks.stages[-1]
            end = length - 1 - case.window - decode_chunks[0] - case.query_block
            ends = torch.minimum(torch.tensor([end], device=query.device), sel.window_start.view(-1)[:1])
            hs, he = hip_stage_ranges(theirs.last, case, decode_chunks)[-1]
            recalls.append(_pooled(sel.starts[0], sel.ends[0], hs[-1:], he[-1:], length, ends.clamp(min=case.sink),
                                   case.sink))
    timing = {}
    if device.startswith("cuda"):
        spent = {"kvpot": 0.0, "hip": 0.0}
        for s, query, length, mine, hips, masks, theirs in _steps(case, inputs, early, refresh, hip, steps):
            for side, fn in (("kvpot", mine), ("hip", hips)):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                spent[side] += 1000.0 * a.elapsed_time(b)
        timing = {"kvpot_us": spent["kvpot"] / steps, "hip_us": spent["hip"] / steps}
    worst = {key: {"max": max(e[key]["max"] for e in errors), "mean": sum(e[key]["mean"] for e in errors) / steps}
             for key in errors[0]}
    recall = [r["recall"] for r in recalls if r["recall"] is not None]
    return {"phase": "decode", "refresh": list(theirs.refresh), "steps": steps, "errors": worst,
            "last_stage_recall_mean": sum(recall) / len(recall) if recall else None,
            "last_stage_recall_min": min(recall) if recall else None, "refreshes_compared": len(recall), **timing}
