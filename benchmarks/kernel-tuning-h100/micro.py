"""Time D2O's and RoCo's steady-step kernels alone over their launch shapes, beside H2O's replacement.

One CUDA graph replays `--layers` launches (a decoding step's worth, on one layer's buffers: each launch
replaces the newest entry as a steady step does); the figure is microseconds per launch (median of
`--repeats` replays). Shapes: the `llama3-8b` step at bound 4,096 (batch 1, 8 KV heads, 128 dims), D2O's
capacity as its prefill leaves it (a 32K prompt: 32,800) and its live entries at two per-layer budgets.
Writes one JSON line per configuration to stdout; the launch shape never changes the results (the
kernel tests pin them), only the time."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json

import torch

from graphs import time_graph  # this folder's: the script's own directory is on the path
from kvpot.kernels.replace import d2o_splits, d2o_step, replace_newest, tile
from kvpot.kernels.roco import SEARCH_BITS, roco_step


def state(capacity: int, n: int, kv: int = 8, d: int = 128, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys = torch.randn(1, kv, capacity, d, device="cuda", dtype=torch.bfloat16, generator=g)
    values = torch.randn(1, kv, capacity, d, device="cuda", dtype=torch.bfloat16, generator=g)
    positions = torch.empty(1, kv, capacity, dtype=torch.long, device="cuda")
    for h in range(kv):  # stream positions out of order (as replacement leaves them), the newest last
        positions[0, h, : n - 1] = torch.randperm(32768, generator=g, device="cuda")[: n - 1]
    positions[:, :, n - 1:] = 40000
    rope = positions.clone()
    observation = torch.rand(1, kv, capacity, device="cuda", generator=g) / n
    scores = torch.rand(1, kv, capacity, device="cuda", generator=g)
    return keys, values, positions, rope, observation, scores


def d2o_rows(args):
    capacity = args.d2o_capacity
    for n in args.d2o_n:
        keys, values, positions, rope, observation, scores = state(capacity, n)
        tau = torch.zeros(1, 8, device="cuda")
        count = torch.zeros(1, 8, dtype=torch.int32, device="cuda")
        default = (d2o_splits(n), tile(n)[1], 32)  # d2o_step's defaults
        for splits, warps, block_n in itertools.product(args.splits, args.warps, args.block_n):
            def launch():
                d2o_step(keys, values, positions, rope, scores, observation, n, tau, 0.7, False, count,
                         sinks=4, recent=1024, splits=splits, warps=warps, block_n=block_n)
            us = time_graph([launch] * args.layers, args.repeats)
            print(json.dumps({"kernel": "d2o_step", "capacity": capacity, "n": n, "splits": splits, "warps": warps,
                              "block_n": block_n, "default": (splits, warps, block_n) == default, "us": us}), flush=True)
        h2o = lambda: replace_newest(keys, values, positions, rope, n, stored=scores, sinks=0, recent=1024,  # noqa: E731
                                     observation=observation, fold="add")
        print(json.dumps({"kernel": "replace_newest(fold=add): H2O", "capacity": capacity, "n": n,
                          "us": time_graph([h2o] * args.layers, args.repeats)}), flush=True)


def roco_rows(args):
    n, capacity = args.roco_n, args.roco_n + 2047
    keys, values, positions, rope, observation, sums = state(capacity, n, seed=1)
    squares = sums * sums * 0.5
    counts = torch.full_like(sums, 7.0)
    if args.roco_ties:  # every entry the same statistics, step after step: all tied, the age search every time
        observation.zero_()
        sums.fill_(1.0)
        squares.fill_(1.0)
    step, bit_widths, source = roco_step, args.roco_bits, "kvpot"
    if args.roco_from:  # another copy of kernels/roco.py (one without `bits`: times it as it is)
        spec = importlib.util.spec_from_file_location("roco_from", args.roco_from)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        step, source = module.roco_step, args.roco_from
        bit_widths = bit_widths if hasattr(module, "SEARCH_BITS") else [None]
    for warps, bits in itertools.product(args.roco_warps, bit_widths):
        def launch():
            extra = {} if bits is None else {"bits": bits}
            step(keys, values, positions, rope, sums, squares, counts, observation, n, sinks=4, recent=10,
                 volatile=round(0.1 * (n - 1)), warps=warps, **extra)
        us = time_graph([launch] * args.layers, args.repeats)
        default = warps == max(4, min(32, max(16, triton_pow2(n - 1)) // 512)) and bits in (None, SEARCH_BITS)
        print(json.dumps({"kernel": "roco_step", "source": source, "ties": args.roco_ties, "capacity": capacity,
                          "n": n, "warps": warps, "bits": bits, "default": default, "us": us}), flush=True)
    stream = lambda: replace_newest(keys, values, positions, rope, n, sinks=4)  # noqa: E731
    print(json.dumps({"kernel": "replace_newest(age): StreamingLLM", "capacity": capacity, "n": n,
                      "us": time_graph([stream] * args.layers, args.repeats)}), flush=True)


def triton_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--d2o-capacity", type=int, default=32800)
    parser.add_argument("--d2o-n", type=int, nargs="+", default=[4097, 5424])
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--roco-n", type=int, default=4097)
    parser.add_argument("--roco-warps", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--roco-bits", type=int, nargs="+", default=[SEARCH_BITS],
                        help="bits RoCo's k-th largest search settles per reduction (2, 3 or 4)")
    parser.add_argument("--roco-from", help="time roco_step from this copy of kernels/roco.py instead (a baseline)")
    parser.add_argument("--roco-ties", action="store_true",
                        help="every entry's statistics equal: RoCo's age search runs at every step (its worst case)")
    parser.add_argument("--only", choices=["d2o", "roco"])
    args = parser.parse_args()
    if args.only != "roco":
        d2o_rows(args)
    if args.only != "d2o":
        roco_rows(args)


if __name__ == "__main__":
    main()
