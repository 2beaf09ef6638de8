"""kvpot's InfiniteHiP parameters as hip-attn 1.2.9 `HiPAttentionArgs`, the named comparison cases, and the
arithmetic of comparing two selections (docs/methods.md, "InfiniteHiP beside hip-attn").

Nothing here imports hip-attn: the mapping is data, checked by tests/test_hip_reference.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvpot.errors import KvpotError

# kvpot parameter -> the HiPAttentionArgs field (or HiPAttentionConfig field, where only the caller's config has it)
MAPPING: dict[str, str] = {
    "chunks[i]": "stages[i].stage_chunk_size",
    "keep[i], i < last": "stages[i + 1].stage_k (the tokens stage i passes on)",
    "keep[-1]": "second_stage_k (layers past early_layers)",
    "early_keep": "second_stage_k in the first layers (HiPAttentionConfig.layers[0], its dense_layers)",
    "early_layers": "HiPAttentionConfig.dense_layers = [0 .. early_layers - 1] (the caller's config; 4 layers there)",
    "sink": "sink_token_size",
    "window": "sliding_window_size (hip-attn's final attention reads sliding_window_size + stages[0].stage_chunk_size"
              " + block_size_q recent keys, and its candidates stop sliding_window_size keys before the last key)",
    "query_block": "stages[i].stage_block_size_q and block_sparse_block_size_q",
    "rope='dynamic'": "scan_extend_backend='streaming' (first layers) / 'relative' (others), sa_extend_backend="
                      "'streaming', using_extend=True, need_apply_rope=True with rope_cos/rope_sin",
    "rope='dynamic', first layers, scan='hip'": "scan_extend_backend='streaming': a probe at its candidate's column in "
                                                "the stage, the queries at hip-attn's column count of the stage "
                                                "(hipscan.hip_columns: from its MAX_TSRC, the same for every block) + "
                                                "sliding_window_size, capped at the query's position",
    "rope='relative'": "scan_extend_backend='relative' in every layer",
    "rope='absolute'": "using_extend=False on keys rotated at their true positions",
    "selection='shared'": "env HIP_HEAD_REDUCE=1 (hip-attn's default: scores max-reduced over query heads)",
    "scan='hip'": "hip-attn's scan kernel as it is (each query head searches on its own path, a chunk scores the best "
                  "probe its path met, heads max-reduced after the search)",
    "refresh": "HiPAttentionConfig.mask_refresh_interval (the caller passes cached_metadata.stage_caches[:i + 1])",
    "offload, gpu_cache_tokens": "offload_cache (HiPOffloadCache: UVM host memory + GPU cache, sized in its "
                                 "constructor)",
}
# where nothing maps
UNMAPPED: dict[str, str] = {
    "selection='head'": "hip-attn selects per query head (HIP_HEAD_REDUCE=0), kvpot per KV head",
    "scan='paper'": "no hip-attn setting: the paper's search (max over heads at every split, a chunk scored by its "
                    "representative key); hip-attn 1.2.9's kernel always runs its own (kvpot's scan='hip')",
    "chunk_size": "none: hip-attn attends what its caller passes (sglang's chunked prefill sizes it)",
    "kernels": "none: hip-attn always runs Triton (TileLang optional)",
    "stages[i].stage_block_stride_q": "no kvpot parameter: hip-attn scores every 4th query of a block in stages 0-1 "
                                      "by default; kvpot scores every query (stride 1)",
    "using_landmark, landmark_stage_k": "no kvpot parameter: hip-attn 1.2.x scores a chunk by a sampled landmark key "
                                        "(env HIP_DEBUG_LANDMARK_BASED_SCAN_STAGE, default on) in prefill; kvpot runs "
                                        "the paper's halving search (Algorithm 3), as hip-attn does with landmarks off "
                                        "and in decoding",
    "rope='dynamic', first layers, scan='paper'": "no hip-attn setting: kvpot's reading puts a block's queries at "
                                                  "its own valid candidates + window (hip-attn: the stage's column "
                                                  "count + window, every block alike)",
    "first-layer columns": "hip-attn's candidate region (chunks up to n - window for every block, kept while their "
                           "left end is at most the block's first query - window) changes which chunk sits in which "
                           "column, so a chunk kvpot cannot keep (it runs into the block's window) shifts the streaming "
                           "positions of every later column; and decoding (one query block) skips its sort, so there "
                           "the columns follow torch.topk(sorted=False)'s order, and MAX_TSRC is the paged cache's "
                           "capacity where kvpot's eager step counts the keys so far",
    "model_context_length": "no kvpot parameter: hip-attn shifts streaming positions to fit it; kvpot halves its "
                            "defaulted sizes to fit the model's window instead",
}


@dataclass(frozen=True)
class HipCase:
    """One configuration, run on both sides. `early`: a layer among the first `early_layers` (hip-attn: a dense
    layer of HiPAttentionConfig), else a later one."""

    name: str
    chunks: tuple[int, ...]
    keep: tuple[int, ...]  # tokens each stage passes on (the last: second_stage_k of a later layer)
    early_keep: int
    sink: int
    window: int
    query_block: int
    refresh: tuple[int, ...]
    stride_q: tuple[int, ...]  # hip-attn only
    landmark: bool  # hip-attn only (prefill)
    decode_chunks: tuple[int, ...] | None = None  # hip-attn's config has other chunks for decoding
    note: str = ""
    scan: str = "paper"  # kvpot's InfiniteHiP(scan=...): "hip" searches as hip-attn's kernel does

    def kvpot_method(self, decoding: bool = False):
        """kvpot's InfiniteHiP with this case's values (explicit: no short-window halving)."""
        from kvpot.methods.infinitehip import InfiniteHiP

        chunks = self.decode_chunks if decoding and self.decode_chunks else self.chunks
        return InfiniteHiP(chunks=chunks, keep=self.keep, early_keep=self.early_keep, sink=self.sink,
                           window=self.window, query_block=self.query_block, refresh=self.refresh, scan=self.scan)

    def hip_fields(self, early: bool, decoding: bool = False) -> dict:
        """HiPAttentionArgs keyword arguments (tensors and positions aside); `stages` as ScanStage kwargs."""
        chunks = self.decode_chunks if decoding and self.decode_chunks else self.chunks
        stages = [dict(stage_block_size_q=self.query_block, stage_block_stride_q=stride, stage_chunk_size=chunk,
                       stage_k=None if i == 0 else self.keep[i - 1], stage_stride=1)
                  for i, (chunk, stride) in enumerate(zip(chunks, self.stride_q))]
        return dict(sink_token_size=self.sink, sliding_window_size=self.window,
                    second_stage_k=self.early_keep if early else self.keep[-1], stages=stages,
                    block_sparse_block_size_q=self.query_block, using_landmark=self.landmark and not decoding,
                    landmark_stage_k=[1] * len(chunks), scan_extend_backend="streaming" if early else "relative",
                    sa_extend_backend="streaming", using_extend=True, need_apply_rope=True, rope_is_neox_style=True,
                    is_decode=decoding, require_cache_statistics=False, require_stage_caches=True)


PAPER = HipCase("paper", (256, 32, 8), (32768, 8192, 2048), 4096, 256, 1024, 64, (32, 16, 8), (1, 1, 1), False,
                note="the paper's settings as kvpot reads them (kvpot's defaults), hip-attn without its query "
                     "stride and landmarks: the same algorithm on both sides")
CASES: dict[str, HipCase] = {
    "paper": PAPER,
    "paper-hipscan": replace(PAPER, name="paper-hipscan", scan="hip",
                             note="the paper's settings with kvpot's scan='hip': both sides search as hip-attn's kernel "
                                  "does (per-query-head paths, path-max chunk scores)"),
    "hip-args": replace(PAPER, name="hip-args", window=512, stride_q=(4, 4, 1), landmark=True,
                        note="HiPAttentionArgs' defaults (window 512, query stride 4/4/1, landmark scan); kvpot "
                             "takes what maps"),
    "hip-config": replace(PAPER, name="hip-config", chunks=(64, 16, 4), decode_chunks=(128, 32, 8),
                          stride_q=(4, 4, 1), landmark=True, refresh=(64, 16, 8),
                          note="HiPAttentionConfig's defaults (preset 'default', the sglang integration's): prefill "
                               "chunks 64/16/4 with landmarks, decode chunks 128/32/8, refresh 64/16/8, 4 dense "
                               "layers keeping 4096"),
}


def get_case(name: str) -> HipCase:
    if name not in CASES:
        raise KvpotError(f"hip-reference: unknown configuration {name!r}; choose one of: {', '.join(CASES)}.")
    return CASES[name]


# ---------------------------------------------------------------------------- comparing selections


def range_mask(starts: torch.Tensor, ends: torch.Tensor, n: int) -> torch.Tensor:
    """[B, C] ranges [start, end) -> [B, n] bool: which keys any range of a row covers (empty ranges add none)."""
    starts, ends = starts.long(), ends.long()
    ok = ends > starts
    delta = torch.zeros(starts.shape[0], n + 1, dtype=torch.int32, device=starts.device)
    delta.scatter_add_(1, torch.where(ok, starts, n).clamp(0, n), ok.int())
    delta.scatter_add_(1, torch.where(ok, ends, n).clamp(0, n), -ok.int())
    return delta[:, :n].cumsum(1) > 0


def overlap(kvpot_keys: torch.Tensor, hip_keys: torch.Tensor, region_end: torch.Tensor, region_start: int) -> dict:
    """Agreement of two selections [B, n] bool over each row's region [region_start, region_end[b]).

    recall: of the keys hip-attn keeps there, the share kvpot keeps too; precision: of kvpot's, the share
    hip-attn keeps; both pooled over rows (counts summed), and `block_recall_min` the worst row's recall.
    """
    n = kvpot_keys.shape[1]
    column = torch.arange(n, device=kvpot_keys.device)
    region = (column >= region_start) & (column < region_end.view(-1, 1))
    k, h = kvpot_keys & region, hip_keys & region
    both = (k & h).sum(1)
    hk, kk = h.sum(1), k.sum(1)
    rows = hk > 0
    per_row = both[rows].float() / hk[rows].float()
    return {"hip_keys": int(hk.sum()), "kvpot_keys": int(kk.sum()), "common": int(both.sum()),
            "recall": float(both.sum() / hk.sum()) if int(hk.sum()) else None,
            "precision": float(both.sum() / kk.sum()) if int(kk.sum()) else None,
            "block_recall_min": float(per_row.min()) if per_row.numel() else None, "blocks": int(rows.sum())}


def output_errors(out: torch.Tensor, reference: torch.Tensor) -> dict:
    """Max and mean absolute difference, in float32."""
    diff = (out.float() - reference.float()).abs()
    return {"max": float(diff.max()), "mean": float(diff.mean())}
