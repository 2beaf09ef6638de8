"""One prefill chunk's two big kernels at llama3-8b shape, per schedule and tile (issue 9): stage 1 of
the scan, and the final sparse attention.

The shape the attention bench's prefill runs at 1M: 8 KV heads x 4 query heads each, head dim 128,
a 2,048-query chunk in 32 blocks of 64 rows, a shared selection over 1M/256 = 4,096 candidate
chunks of 256 keys, relative RoPE (layers past the third). Random bf16 data; the representatives
of every schedule are compared with the fused one's (they are the same search; "turned" queries
round differently from rotated keys, so a near-tie may go the other way there).
The attention reads, for each of the 32 blocks, 256 sinks + 256 selected ranges of 8 keys (random,
distinct, below the window) + its 1,024-key window and itself, with streaming RoPE; outputs of
every tile are compared with the default's.
Run:  PYTHONPATH=src python benchmarks/infinitehip-kernels-h100/prefill_sweep.py OUT.json
"""

import json
import sys

import torch

from kvpot.kernels.hip import sparse_attention, stage_scan


def _time(run) -> tuple[float, list[float]]:
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2], times


def attention_rows(n: int) -> list[dict]:
    dev, kv, g, d, q, rows, sink, chunk, window = "cuda", 8, 4, 128, 2048, 64, 256, 8, 1024
    gen = torch.Generator(device=dev).manual_seed(1)
    keys = torch.randn(kv, n, d, device=dev, generator=gen).to(torch.bfloat16)
    values = torch.randn(kv, n, d, device=dev, generator=gen).to(torch.bfloat16)
    query = torch.randn(kv * g, q, d, device=dev, generator=gen).to(torch.bfloat16)
    blocks = q // rows
    first = n - q + torch.arange(blocks, device=dev) * rows  # each block's first query
    w0 = first - window  # [B]
    count = q // chunk  # ranges per block: 2,048 selected keys
    slots = (w0.min().item() - sink) // chunk
    picks = torch.stack([torch.randperm(slots, device=dev, generator=gen)[:count].sort().values
                         for _ in range(blocks)])  # [B, C]
    starts = (sink + picks * chunk).unsqueeze(0).contiguous()  # [1, B, C]
    ends = starts + chunk
    cos, sin = _table(n + window + 2, d, dev)
    width = window + rows
    out = []
    reference = None
    for name, opts in (("bm64", {}), ("bm128", {"block_m": 128}), ("bm256", {"block_m": 256}),
                       ("bm256-split1", {"block_m": 256, "splits": 1})):
        try:
            run = lambda: sparse_attention(query, keys, values, d ** -0.5, starts, ends, chunk, w0, width, sink,
                                           rows, True, cos, sin, **opts)
            result = run()
            ms, times = _time(run)
            if reference is None:
                reference = result.float()
            err = float((result.float() - reference).norm() / reference.norm())
            row = {"kernel": "attention", "context": n, "tile": name, "ms": ms, "times_ms": times,
                   "rel_diff_to_bm64": err}
        except Exception as e:  # noqa: BLE001 - record the failure, go on
            row = {"kernel": "attention", "context": n, "tile": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(row, flush=True)
        out.append(row)
    return out


def _table(length: int, d: int, dev: str):
    angles = torch.arange(length, device=dev, dtype=torch.float32)[:, None] * (
        1.0 / 500000 ** (torch.arange(0, d, 2, device=dev) / d))[None, :]
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def main(out: str) -> None:
    dev = "cuda"
    kv, g, d, blocks, rows, chunk = 8, 4, 128, 32, 64, 256
    results = []
    for n in (131072, 1048576):
        gen = torch.Generator(device=dev).manual_seed(0)
        keys = torch.randn(kv, n, d, device=dev, generator=gen).to(torch.bfloat16)
        queries = torch.randn(kv, g, blocks, rows, d, device=dev, generator=gen).to(torch.bfloat16)
        cos, sin = _table(n + 4096, d, dev)
        count = (n - 1024) // chunk
        starts = (torch.arange(count, device=dev) * chunk).view(1, 1, -1).expand(1, blocks, -1).contiguous()
        ends = starts + chunk
        valid = torch.ones(blocks, rows, dtype=torch.bool, device=dev)
        reference = None
        for name, opts in (("fused", {"stepwise": False}),
                           ("stepwise-c32-keys-rotated", {"stepwise": True, "block_c": 32, "turn": False}),
                           ("stepwise-c64", {"stepwise": True, "block_c": 64}),
                           ("stepwise-c64-w4", {"stepwise": True, "block_c": 64, "warps": 4}),
                           ("stepwise-c64-w16", {"stepwise": True, "block_c": 64, "warps": 16}),
                           ("stepwise-c128-w16", {"stepwise": True, "block_c": 128, "warps": 16})):
            try:
                run = lambda: stage_scan(queries, valid, keys, starts, ends, chunk, "relative", True, cos, sin, **opts)  # noqa: F821 - runs before the `del keys` below
                rep, _ = run()
                ms, times = _time(run)
                if reference is None:
                    reference = rep
                agree = float((rep == reference).float().mean())
                row = {"kernel": "scan stage 1", "context": n, "schedule": name, "ms": ms, "times_ms": times,
                       "agree_with_fused": agree}
            except Exception as e:  # noqa: BLE001 - record the failure, go on
                row = {"kernel": "scan stage 1", "context": n, "schedule": name,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(row, flush=True)
            results.append(row)
        del keys
        torch.cuda.empty_cache()
    results += attention_rows(1048576)
    json.dump({"device": torch.cuda.get_device_name(), "rows": results}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
