"""Issue 46, on a CPU: kvpot's `scan="hip"` selection against hip-attn 1.2.9's own kernels (Triton's interpreter),
prefill, a first layer (`early`) and a later one (`late`), a scaled-down `paper-hipscan` case.

Run:  PYTHONPATH=<triton>:<hip-attn unpacked>:src python benchmarks/hip-reference-h100/early.py [N] [Q] \
          [--keep 4096,512,256] [--early-keep 256] [--cache DIR]
(about a minute per layer for hip-attn at N=2048, Q=128; its selections are cached in DIR, so kvpot's side can be
rerun at another commit without the interpreter.) Prints the recall of hip-attn's keys per stage. `--full-size` runs
the paper-hipscan case as the GPU does: at N=16384, Q=64, layer 0 (`--layers early`, 3.5 min) it printed
1.000 / 0.899 / 0.456 at commit 8f169e3 (the GPU's 16K first-layer gap reproduced on a CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=2048)
    parser.add_argument("q", type=int, nargs="?", default=128)
    parser.add_argument("--keep", default="4096,512,256")
    parser.add_argument("--early-keep", type=int, default=256)
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--cache", default="/tmp/hip-early")
    parser.add_argument("--full-size", action="store_true",
                        help="the paper-hipscan case as the GPU runs it (chunks 256/32/8, sink 256, window 1024)")
    parser.add_argument("--layers", default="early,late", help="early, late or both (comma-separated)")
    args = parser.parse_args(argv)
    from kvpot.bench import hip_reference as ref
    from kvpot.bench.hip_inputs import random_inputs
    from kvpot.bench.hip_mapping import CASES

    keep = tuple(int(x) for x in args.keep.split(","))
    case = CASES["paper-hipscan"] if args.full_size else replace(
        CASES["paper-hipscan"], name="hipscan-small", chunks=(64, 16, 4), keep=keep, early_keep=args.early_keep,
        sink=64, window=256, refresh=(4, 2, 1))
    inputs = random_inputs(args.shape, args.n, args.q, "cpu", torch.float32, 0)
    os.makedirs(args.cache, exist_ok=True)
    hip = None
    for kind in args.layers.split(","):
        early = kind == "early"
        sizes = "full" if args.full_size else f"{args.keep}-{args.early_keep}"
        path = os.path.join(args.cache, f"{args.shape}-{args.n}-{args.q}-{sizes}-{kind}.pt")
        if not os.path.exists(path):
            if hip is None:
                os.environ["TRITON_INTERPRET"] = "1"
                from kvpot.bench.hip_shim import load_hip_interpreted

                hip = load_hip_interpreted()
            torch.save(ref.hip_prefill(hip, case, inputs, early, "cpu", 1).stages, path)
        theirs = ref.Side(None, torch.load(path), 0)
        mine = ref.kvpot_prefill(case, inputs, early, "cpu", 1)
        rows = ref.compare_stages(mine, theirs, case, args.n, args.q)
        print(kind, " / ".join(f"{r['recall']:.3f}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
