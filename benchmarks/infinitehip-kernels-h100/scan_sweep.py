"""Stage 1 of one prefill chunk's scan at llama3-8b shape, per schedule and tile width (issue 9).

The shape the attention bench's prefill runs at 1M: 8 KV heads x 4 query heads each, head dim 128,
a 2,048-query chunk in 32 blocks of 64 rows, a shared selection over 1M/256 = 4,096 candidate
chunks of 256 keys, relative RoPE (layers past the third). Random bf16 data; the representatives
of every schedule are compared with the fused one's (they are the same search; "turned" queries
round differently from rotated keys, so a near-tie may go the other way there).
Run:  PYTHONPATH=src python benchmarks/infinitehip-kernels-h100/scan_sweep.py OUT.json
"""

import json
import sys

import torch

from kvpot.kernels.hip import stage_scan


def main(out: str) -> None:
    dev = "cuda"
    kv, g, d, blocks, rows, chunk = 8, 4, 128, 32, 64, 256
    results = []
    for n in (131072, 1048576):
        gen = torch.Generator(device=dev).manual_seed(0)
        keys = torch.randn(kv, n, d, device=dev, generator=gen).to(torch.bfloat16)
        queries = torch.randn(kv, g, blocks, rows, d, device=dev, generator=gen).to(torch.bfloat16)
        angles = torch.arange(n + 4096, device=dev, dtype=torch.float32)[:, None] * (
            1.0 / 500000 ** (torch.arange(0, d, 2, device=dev) / d))[None, :]
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
        count = (n - 1024) // chunk
        starts = (torch.arange(count, device=dev) * chunk).view(1, 1, -1).expand(1, blocks, -1).contiguous()
        ends = starts + chunk
        valid = torch.ones(blocks, rows, dtype=torch.bool, device=dev)
        reference = None
        for name, opts in (("fused", {"stepwise": False}),
                           ("stepwise-c32-keys-rotated", {"stepwise": True, "block_c": 32, "turn": False}),
                           ("stepwise-c32", {"stepwise": True, "block_c": 32}),
                           ("stepwise-c64", {"stepwise": True, "block_c": 64}),
                           ("stepwise-c16", {"stepwise": True, "block_c": 16})):
            try:
                run = lambda: stage_scan(queries, valid, keys, starts, ends, chunk, "relative", True, cos, sin, **opts)
                rep, _ = run()
                torch.cuda.synchronize()
                times = []
                for _ in range(5):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    run()
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b))
                if reference is None:
                    reference = rep
                agree = float((rep == reference).float().mean())
                row = {"context": n, "schedule": name, "ms": sorted(times)[len(times) // 2], "times_ms": times,
                       "agree_with_fused": agree}
            except Exception as e:  # noqa: BLE001 - record the failure, go on
                row = {"context": n, "schedule": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(row, flush=True)
            results.append(row)
        del keys
        torch.cuda.empty_cache()
    json.dump({"device": torch.cuda.get_device_name(), "rows": results}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
