"""Tile sweep of batch-invariant decoding's linear kernel (`kvpot.kernels.invariant.invariant_linear`) on a GPU.

For each tile shape (BLOCK_N, BLOCK_K, warps, stages) and each product of the `llama3-8b` decoding step and
SmolLM2-135M's, times the kernel at 1, 8 and 64 rows against cuBLAS (`F.linear`) and, at one row, kvpot's
matrix-vector kernel; checks that row 0 comes out bit for bit the same alone and in the batch of 64. The whole
8B step's products (7 a layer x 32 layers, then the vocabulary head) are summed per tile shape.

    python benchmarks/engine-core-h100/invariant_sweep.py --out DIR

Writes DIR/invariant_sweep.json and prints a table (microseconds per product, the step's products in ms).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

TILES = [(64, 64, 4, 3), (32, 128, 4, 4), (16, 256, 4, 4), (16, 128, 4, 4), (32, 256, 4, 3), (16, 512, 4, 3),
         (32, 64, 4, 4), (16, 256, 2, 4), (64, 128, 4, 3), (128, 64, 4, 3)]
# (name, N, K, uses a step): the 8B step's products (per layer, then the head once) and SmolLM2's
SHAPES = [("8b-q", 4096, 4096, 32), ("8b-kv", 1024, 4096, 64), ("8b-o", 4096, 4096, 32), ("8b-up", 14336, 4096, 64),
          ("8b-down", 4096, 14336, 32), ("8b-head", 128256, 4096, 1),
          ("smol-q", 576, 576, 0), ("smol-kv", 192, 576, 0), ("smol-up", 1536, 576, 0), ("smol-down", 576, 1536, 0),
          ("smol-head", 49152, 576, 0)]
ROWS = (1, 8, 64)


def timed(fn, repeats: int = 50) -> float:
    """Microseconds per call: a CUDA graph of `repeats` calls, replayed, after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import kvpot.kernels.invariant as invariant
    from kvpot.kernels.gemv import gemv

    rows = {}
    for name, n, k, _ in SHAPES:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(max(ROWS), k, device="cuda", dtype=torch.bfloat16)
        entry = {"cublas": {m: timed(lambda m=m: F.linear(x[:m], weight)) for m in ROWS},
                 "gemv": timed(lambda: gemv(x[:1], weight)), "tiles": {}}
        for tile in TILES:
            run = functools.partial(invariant.invariant_linear, weight=weight, shape=tile)
            same = torch.equal(run(x[:1])[0], run(x)[0])
            entry["tiles"][str(tile)] = {"us": {m: timed(lambda m=m: run(x[:m])) for m in ROWS}, "row_invariant": same}
        rows[name] = entry
        print(name, {t: [round(v, 1) for v in e["us"].values()] for t, e in entry["tiles"].items()}, flush=True)
    step = {}
    for label in ["cublas", "gemv"] + [str(t) for t in TILES]:
        per_rows = {}
        for m in ROWS:
            total = 0.0
            for name, _, _, uses in SHAPES:
                entry = rows[name]
                if label == "cublas":
                    us = entry["cublas"][m]
                elif label == "gemv":
                    us = entry["gemv"] if m == 1 else float("nan")
                else:
                    us = entry["tiles"][label]["us"][m]
                total += uses * us
            per_rows[m] = total / 1000
        step[label] = per_rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "invariant_sweep.json").write_text(json.dumps({"shapes": rows, "step_ms": step,
                                                               "device": torch.cuda.get_device_name()}, indent=1))
    print(f"{'8B step products, ms':<24}" + "".join(f"{m:>10} rows" for m in ROWS))
    for label, per_rows in step.items():
        print(f"{label:<24}" + "".join(f"{v:>15.2f}" for v in per_rows.values()))


if __name__ == "__main__":
    main()
