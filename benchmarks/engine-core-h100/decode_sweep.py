"""The batched decode attention alone at the 64-reader step's shape, over launch shapes (issue 43's 17 ms target).

One CUDA graph replays `--layers` calls of `kvpot.kernels.decode.decode_attention_batch` (a step's worth, on
one layer's pool: B rows over B slots of `--entries` live entries, `llama3-8b`'s 32 query and 8 KV heads of
128 dims (`--heads 16 --kv-heads 4`: one rank's under TP=2), bf16, keys rotated on load as InfiniPot's `reset` positions store them). Each configuration replaces
`kvpot.kernels.decode.launch_shape` (entries per loop step, warps, stages) and passes `num_splits`; its output
is checked against the default's. The figure is microseconds per call (median of `--repeats` replays) and the
bandwidth it reaches over the keys, values and key positions it must read. One JSON line per configuration.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernel-tuning-h100"))
from graphs import time_graph  # noqa: E402  (benchmarks/kernel-tuning-h100/graphs.py)

import kvpot.kernels.decode as decode  # noqa: E402


def state(batch: int, entries: int, capacity: int, kv: int = 8, heads: int = 32, d: int = 128, seed: int = 0,
          device: str = "cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    slots = batch + 1  # the pool's scratch slot, as `SlotPool` keeps one
    keys = torch.randn(slots, kv, capacity, d, device=device, dtype=torch.bfloat16, generator=g)
    values = torch.randn(slots, kv, capacity, d, device=device, dtype=torch.bfloat16, generator=g)
    rope = torch.randint(0, entries, (slots, kv, capacity), device=device, generator=g)
    query = torch.randn(batch, heads, d, device=device, dtype=torch.bfloat16, generator=g)
    rows = torch.arange(batch, device=device)
    lengths = torch.full((slots,), entries, device=device, dtype=torch.long)
    query_position = torch.full((slots,), entries, device=device, dtype=torch.long)
    freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device).float() / d))
    angles = torch.outer(torch.arange(capacity + 1, device=device).float(), freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    return dict(query=query, keys=keys, values=values, rows=rows, lengths=lengths, scaling=d ** -0.5, cos=cos,
                sin=sin, key_positions=rope, query_positions=query_position)


def run(args) -> None:
    default_shape = decode.launch_shape
    for batch in args.batch:
        kv, heads = args.kv_heads, args.heads
        inputs = state(batch, args.entries, args.capacity, kv=kv, heads=heads, device=args.device)
        reference = decode.decode_attention_batch(**inputs).float()
        kv_bytes = 2 * batch * kv * args.entries * 128 * 2 + batch * kv * args.entries * 8
        d_block, d_warps, d_stages = default_shape(batch, kv, heads // kv, 128, inputs["keys"], inputs["cos"])
        d_splits = decode.default_splits(kv, heads, args.capacity, inputs["keys"].device, batch)
        configs = [(d_block, d_warps, d_stages, d_splits, True)]
        configs += [(b, w, s, sp, False) for b, w, s, sp in
                    itertools.product(args.block_n, args.warps, args.stages, args.splits)]
        for block_n, warps, stages, splits, is_default in configs:
            decode.launch_shape = lambda *a, _c=(block_n, warps, stages): _c  # noqa: E731
            try:
                out = decode.decode_attention_batch(**inputs, num_splits=splits).float()
                error = (out - reference).abs().max().item()
                if args.device != "cuda":  # a smoke run under Triton's interpreter: no timing
                    us = float("nan")
                else:
                    us = time_graph([lambda: decode.decode_attention_batch(**inputs, num_splits=splits)]
                                    * args.layers, args.repeats)
                row = dict(batch=batch, kv_heads=kv, heads=heads, entries=args.entries, block_n=block_n, warps=warps, stages=stages,
                           splits=splits, default=is_default, us=round(us, 2),
                           tb_per_s=round(kv_bytes / us / 1e6, 3), step_ms=round(us * 32 / 1000, 3),
                           max_abs_error=error)
            except Exception as error:  # a shape that does not fit shared memory or registers
                row = dict(batch=batch, block_n=block_n, warps=warps, stages=stages, splits=splits,
                           error=f"{type(error).__name__}: {str(error)[:200]}")
            finally:
                decode.launch_shape = default_shape
            print(json.dumps(row), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--entries", type=int, default=4096, help="live entries a slot (InfiniPot's pot)")
    p.add_argument("--capacity", type=int, default=4097, help="entries a slot holds (the pot and the new token)")
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (a TP=2 rank of llama3-8b: 4)")
    p.add_argument("--heads", type=int, default=32, help="query heads (a TP=2 rank of llama3-8b: 16)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1, untimed")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
