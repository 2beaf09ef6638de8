"""Time one token's linear layer: `F.linear` (cuBLAS) beside `kvpot.kernels.gemv.gemv` over launch shapes.

Each product is timed the way a decoding step meets it: a CUDA graph replays `--launches` products, each
on its own copy of the weights (together well past the 50 MB L2 cache, as a step's 14 GB are), and the
figure is microseconds per product (median of `--repeats` replays) and the bandwidth it reached. Shapes:
the `llama3-8b` and `llama3.2-1b` steps' products (bf16). One JSON line per (shape, implementation,
launch shape); `"default": true` marks the shape `gemv.config` picks at this commit. The launch shapes run
in a shuffled order (`--seed`) and cuBLAS is timed before and after them (`"when"`), so a drift of the
machine over the sweep (its clocks, its temperature) shows instead of favouring the shapes timed first."""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch
import torch.nn.functional as F

from graphs import time_graph  # this folder's: the script's own directory is on the path
from kvpot.kernels.gemv import config, gemv

SHAPES = {  # name: (N outputs, K inputs)
    "8b-q/o": (4096, 4096), "8b-k/v": (1024, 4096), "8b-gate/up": (14336, 4096), "8b-down": (4096, 14336),
    "8b-head": (128256, 4096),
    "1b-q/o": (2048, 2048), "1b-k/v": (512, 2048), "1b-gate/up": (8192, 2048), "1b-down": (2048, 8192),
}


def rows(name: str, n: int, k: int, args) -> None:
    copies = max(2, min(args.launches, -(-args.bytes_in_flight // (2 * n * k))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    x = torch.randn(1, 1, k, device="cuda", dtype=torch.bfloat16)
    picks = [weights[i % copies] for i in range(args.launches)]

    def emit(impl: str, shape, us: float, when: str | None = None) -> None:
        print(json.dumps({"shape": name, "n": n, "k": k, "impl": impl, "launch": shape, "when": when,
                          "default": shape == config(n, k), "us": round(us, 3),
                          "tb_per_s": round(2 * n * k / us / 1e6, 3)}), flush=True)

    cublas = [lambda w=w: F.linear(x, w) for w in picks]
    emit("F.linear", None, time_graph(cublas, args.repeats), "before")
    reference = F.linear(x.float(), weights[0].float())
    shapes = [s for s in itertools.product(args.block_n, args.block_k, args.warps) if s[1] <= max(k, 16)]
    random.Random(args.seed).shuffle(shapes)
    for shape in shapes:
        out = gemv(x, weights[0], shape=shape)
        if not torch.allclose(out.float(), reference, rtol=2**-7, atol=2e-2):
            raise SystemExit(f"gemv {shape} on {name}: wrong result")
        emit("gemv", shape, time_graph([lambda w=w: gemv(x, w, shape=shape) for w in picks], args.repeats))
    emit("F.linear", None, time_graph(cublas, args.repeats), "after")
    del weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--block-n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--block-k", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--launches", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0, help="the launch shapes' shuffled order")
    parser.add_argument("--bytes-in-flight", type=int, default=1 << 30, help="weights' bytes a graph cycles through")
    args = parser.parse_args()
    for name in args.shapes:
        rows(name, *SHAPES[name], args)


if __name__ == "__main__":
    main()
