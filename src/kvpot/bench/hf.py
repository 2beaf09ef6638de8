"""Plain transformers in the same bench run: one-shot prefill into a `DynamicCache`, greedy decoding.

This is what a user gets from `model.generate` without kvpot: SDPA attention over the whole
context, a cache that grows with it, the next token read back every step (generate checks its
stopping criteria on the host each step).
"""

from __future__ import annotations

import statistics
import time

from kvpot.bench.common import SdpaFloor, peak_memory, reset_peak, synchronize
from kvpot.compat import cache_kwargs


def _prefill(model, ids, question, device: str):
    """One forward over the context, one over the question (timed, synchronised); the cache, the last
    logits and the seconds it took. Call under `torch.no_grad()` and `SdpaFloor(model)`."""
    from transformers import DynamicCache

    synchronize(device)
    started = time.perf_counter()
    cache = DynamicCache()
    for part in (ids, question):
        if part.numel():
            logits = model(input_ids=part.view(1, -1), use_cache=True, logits_to_keep=1,
                           **cache_kwargs(model, cache)).logits[0, -1]
    synchronize(device)
    return cache, logits, time.perf_counter() - started


def hf_prefill_row(model, ids, question, device: str) -> dict:
    import torch

    before = reset_peak(device)
    with torch.no_grad(), SdpaFloor(model):
        cache, _, seconds = _prefill(model, ids, question, device)
    entries = cache.get_seq_length()
    del cache
    total = ids.numel() + question.numel()
    return {"prefill_seconds": seconds, "samples": [seconds], "compress_seconds": 0.0, "compress_share": 0.0,
            "tokens_per_second": total / seconds if seconds > 0 else None, "question_tokens": question.numel(),
            "peak_memory_bytes": peak_memory(device), "memory_before_bytes": before, "max_kv_entries": entries,
            "baseline": "transformers: one-shot prefill, DynamicCache, SDPA"}


def hf_decode_row(model, ids, question, steps: int, warmup: int, device: str) -> dict:
    """Greedy decoding after the context: per-step host times (each step reads its token back)."""
    import torch

    before = reset_peak(device)
    with torch.no_grad(), SdpaFloor(model):
        cache, logits, prefill = _prefill(model, ids, question, device)
        times = []
        for _ in range(warmup + steps):
            begun = time.perf_counter()
            token = int(logits.argmax())  # the read-back generate does for its stopping criteria
            logits = model(input_ids=torch.tensor([[token]], device=device), use_cache=True,
                           **cache_kwargs(model, cache)).logits[0, -1]
            synchronize(device)
            times.append(time.perf_counter() - begun)
    entries = cache.get_seq_length()
    del cache
    timed = times[warmup:]
    return {**step_stats([1000 * t for t in timed]), "prefill_seconds": prefill,
            "peak_memory_bytes": peak_memory(device), "memory_before_bytes": before, "max_kv_entries": entries,
            "final_kv_entries": entries, "baseline": "transformers: DynamicCache, SDPA, greedy"}


def step_stats(step_ms: list[float]) -> dict:
    """Median, p90 and mean of per-step milliseconds, and tokens per second at the median."""
    median = statistics.median(step_ms)
    p90 = statistics.quantiles(step_ms, n=10)[-1] if len(step_ms) > 1 else median
    return {"ms_per_token": median, "ms_per_token_p90": p90, "ms_per_token_mean": statistics.fmean(step_ms),
            "tokens_per_second": 1000 / median if median > 0 else None, "steps": len(step_ms),
            "samples_ms": step_ms}
