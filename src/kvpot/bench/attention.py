"""`kvpot bench attention`: microseconds per call of one layer's attention over a cache of each length."""

from __future__ import annotations

from kvpot.bench.common import checkpoint, free_memory, mark_oom, synchronize
from kvpot.bench.config import BenchConfig


def bench_attention(config: BenchConfig, model_config, dtype, runs, results, progress) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    from torch.utils import benchmark
    from tqdm.auto import tqdm

    from kvpot.attention import attend
    from kvpot.models.shapes import head_dim

    heads, kv_heads, d = model_config.num_attention_heads, model_config.num_key_value_heads, head_dim(model_config)
    scale = d ** -0.5
    device = config.device
    generator = torch.Generator(device=device).manual_seed(config.seed)

    def rand(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=dtype)

    def dense(q, k, v):
        if q.shape[2] == 1:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        mask = causal_lower_right(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def kvpot(q, k, v):
        return attend(q, k, v, scale)

    def time_call(fn, q, k, v) -> tuple[float, list[float]]:
        fn(q, k, v)  # warm-up
        timer = benchmark.Timer(stmt="fn(q, k, v)", globals={"fn": fn, "q": q, "k": k, "v": v},
                                num_threads=torch.get_num_threads())
        measurement = timer.blocked_autorange(min_run_time=config.min_time)
        samples = [1e6 * t for t in measurement.times]
        return 1e6 * measurement.median, samples

    from kvpot.methods.infinitehip import InfiniteHiP

    # (label, function, cache entries at a length)
    entries = [("sdpa", dense, lambda n: n), ("kvpot", kvpot, lambda n: n)]
    hip_runs = [run for run in runs if isinstance(run.method, InfiniteHiP)]
    for run in runs:
        if run in hip_runs:
            continue
        bound = run.method.max_entries()
        entries.append((run.label, kvpot, lambda n, b=bound: n if b is None else min(n, b)))
    with tqdm(total=len(entries) * len(config.lengths), unit="run", desc="bench attention",
              disable=not progress) as bar:
        for label, fn, entries_at in entries:
            out_of_memory = False
            for length in config.lengths:
                bar.set_postfix_str(f"{label} @ {length} tokens")
                n = entries_at(length)
                row = {"method": label, "length": length, "cache_entries": n, "oom": False, "skipped": False,
                       "heads": heads, "kv_heads": kv_heads, "head_dim": d, "block": config.block}
                if out_of_memory:
                    row["skipped"] = True
                else:
                    try:
                        k, v = rand(1, kv_heads, n, d), rand(1, kv_heads, n, d)
                        row["decode_us"], row["decode_samples_us"] = time_call(fn, rand(1, heads, 1, d), k, v)
                        block = min(config.block, n)
                        row["prefill_us"], row["prefill_samples_us"] = time_call(fn, rand(1, heads, block, d), k, v)
                        row["prefill_block"] = block
                        del k, v
                    except Exception as err:  # noqa: BLE001
                        mark_oom(row, err)
                        out_of_memory = True
                    free_memory(device)
                results["rows"].append(row)
                checkpoint(results, config.out)
                bar.update()
    for run in hip_runs:
        _bench_hip_attention(config, run, model_config, dtype, results, progress)


def _bench_hip_attention(config: BenchConfig, run, model_config, dtype, results, progress) -> None:
    """InfiniteHiP's attention for one layer (the first that prunes with relative positions).

    decode: the mean per step over one refresh period (every stage recomputed at its step 0, as
    in steady decoding), timed eagerly (host launches included) and, on CUDA, as one CUDA-graph
    replay of the whole period (device time only). prefill: one `--block` of queries at the end
    of the context. Each with a profile of where the device time goes (scan / attention / other).
    """
    import math

    import torch
    from tqdm.auto import tqdm

    from kvpot.rope import Rope
    from kvpot.models.shapes import head_dim, rotary
    from kvpot.methods.infinitehip.reference import MaskCache

    heads, kv_heads, d = model_config.num_attention_heads, model_config.num_key_value_heads, head_dim(model_config)
    device, scale = config.device, d ** -0.5
    method = run.method
    runtime = method.runtime(model_config.num_hidden_layers, getattr(model_config, "max_position_embeddings", None),
                             Rope(rotary(config.shape, device)))
    index = min(method.early_layers, len(runtime.plans) - 1)
    period = math.lcm(*method.refresh)
    generator = torch.Generator(device=device).manual_seed(config.seed + 1)
    cuda = device.startswith("cuda")

    def rand(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=dtype)

    def decode_period(q, k, v):
        runtime.masks[index] = MaskCache()  # (an offloading GPU cache stays warm across periods)
        for step in range(period):
            runtime.step = step
            runtime.attend(index, q, k, v, scale, decoding=True)

    for length in tqdm(config.lengths, desc=f"bench attention {run.label}", disable=not progress):
        row = {"method": run.label, "length": length, "cache_entries": length, "oom": False, "skipped": False,
               "heads": heads, "kv_heads": kv_heads, "head_dim": d, "layer": index, "refresh_period": period,
               "kernels": runtime.table(rand(1, 1, d), 2) is not None}
        try:
            k, v = rand(kv_heads, length, d), rand(kv_heads, length, d)
            if method.offload and cuda:  # the context in pinned host memory, read through the GPU cache
                k, v = k.cpu().pin_memory(), v.cpu().pin_memory()
                free_memory(device)
            q1 = rand(heads, 1, d)
            row["decode_us"] = _median_us(lambda: decode_period(q1, k, v), config.min_time) / period
            row["decode_breakdown_us"] = _device_breakdown(lambda: decode_period(q1, k, v), device, period)
            if cuda:
                row["decode_graph_us"] = _graph_us(lambda: decode_period(q1, k, v)) / period
            if method.offload:
                row["offload"] = runtime.offload_stats()  # over every timed step (LRU, warm after the first)
            block = min(config.block, length)
            qb = rand(heads, block, d)
            row["prefill_us"] = _median_us(lambda: runtime.attend(index, qb, k, v, scale, decoding=False),
                                           config.min_time)
            row["prefill_breakdown_us"] = _device_breakdown(
                lambda: runtime.attend(index, qb, k, v, scale, decoding=False), device, 1)
            row["prefill_block"] = block
            k = v = None  # free the context before the next length (not `del`: the lambdas above read k and v)
        except Exception as err:  # noqa: BLE001
            mark_oom(row, err)
        free_memory(device)
        results["rows"].append(row)
        checkpoint(results, config.out)


def _median_us(fn, min_time: float) -> float:
    """Median µs of `fn()` (host clock, synchronised: launches included), after one warm-up call."""
    import torch
    from torch.utils import benchmark

    fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return 1e6 * timer.blocked_autorange(min_run_time=min_time).median


def _graph_us(fn, replays: int = 20) -> float:
    """Median µs of one CUDA-graph replay of `fn` (captured after a warm-up on a side stream)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2]


def _device_breakdown(fn, device: str, per: int) -> dict | None:
    """Device µs per call (divided by `per`) by kind of kernel: InfiniteHiP's scan and attention
    kernels, and the rest (top-k, sort, gathers, small index ops); plus the kernel count.
    None without CUDA."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    parts = {"scan": 0.0, "attention": 0.0, "other": 0.0}
    count = 0
    for e in prof.events():
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        count += 1
        if "_scan_kernel" in e.name or "_scan_step_kernel" in e.name:
            kind = "scan"
        elif "_attention_kernel" in e.name or "_merge_kernel" in e.name:
            kind = "attention"
        else:
            kind = "other"
        parts[kind] += float(e.device_time_total or 0.0)
    return {**{k: v / per for k, v in parts.items()}, "kernels": count / per}
