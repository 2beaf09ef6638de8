"""The varlen attention kernel's half-precision launch (`kvpot.kernels.varlen.HALF_LAUNCH`) swept at the 8B mixed
step's shapes, beside the attention a chunk read apart runs (`kvpot.kernels.sdpa.split_attention`: cuDNN, its keys rotated
beforehand) as the floor to aim at.

    python benchmarks/engine-core-h100/varlen_sweep.py --out DIR

Shapes (`llama3-8b`: 32 query heads, 8 KV heads, head dim 128, bf16, a pool of 4,096 + 1,024 entries a slot):
- `mixed-1024`: 32 decoding rows (2,000-4,000 entries cached) and one 1,024-token chunk over 3,072 cached entries;
- `chunk-1024`: one 1,024-token chunk over 3,072 cached entries (what a packed step's varlen launch reads at a budget
  of 1,024: its decoding rows go to the decode kernel);
- `chunk-2048`: one 2,048-token chunk over 2,048 cached entries (InfiniPot's chunk with a pot of 4,096).
`--forms rope,rotated`: keys rotated on load from their RoPE positions (what ranked positions run: InfiniPot, H2O,
StreamingLLM), or stored rotated (`cos=None`: absolute positions), to see what the rotation on load costs.
`--prefix off,on` also sweeps `varlen.UNMASKED_PREFIX` (the blocks every token of a tile sees read without the causal
mask). Every launch's output is checked against the default launch's (max abs difference). Writes DIR/varlen_sweep.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

SHAPES = {
    "mixed-1024": [(s, 4000 - 62 * s, 1) for s in range(32)] + [(32, 3072, 1024)],
    "chunk-1024": [(0, 3072, 1024)],
    "chunk-2048": [(0, 2048, 2048)],
}


def timed(fn, repeats: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / repeats  # us


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rows", default="64,128")
    p.add_argument("--block-n", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--forms", default="rope", help="rope (rotated on load), rotated (keys stored rotated), or both")
    p.add_argument("--prefix", default="off", help="off, on or off,on: varlen.UNMASKED_PREFIX")
    args = p.parse_args(argv)
    import torch

    import kvpot.kernels.varlen as varlen
    from kvpot.kernels.sdpa import split_attention
    from kvpot.kernels.decode_reference import _rotate_at

    dev, dtype, heads, kv, d, capacity = "cuda", torch.bfloat16, 32, 8, 128, 5120
    gen = torch.Generator(device=dev).manual_seed(0)
    default = dict(varlen.HALF_LAUNCH)
    report = {"args": vars(args) | {"out": str(args.out)}, "device": torch.cuda.get_device_name(),
              "default": default, "shapes": {}}
    for (shape, rows), form in itertools.product(SHAPES.items(), args.forms.split(",")):
        name = shape if form == "rope" else f"{shape}-{form}"
        slots = max(r[0] for r in rows) + 1
        keys = torch.randn(slots, kv, capacity, d, device=dev, dtype=dtype, generator=gen)
        values = torch.randn(slots, kv, capacity, d, device=dev, dtype=dtype, generator=gen)
        positions = torch.arange(capacity, device=dev).expand(slots, kv, capacity).contiguous()
        counts = [c for _, _, c in rows]
        starts = torch.tensor([0] + counts, device=dev).cumsum(0)
        query = torch.randn(int(starts[-1]), heads, d, device=dev, dtype=dtype, generator=gen)
        slot_ids = torch.tensor([r[0] for r in rows], device=dev)
        cached = torch.tensor([r[1] for r in rows], device=dev)
        angles = torch.arange(2 * capacity, device=dev)[:, None] / 10000 ** (torch.arange(0, d, 2, device=dev) / d)
        cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
        sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
        longest = max(counts)

        tables = (cos, sin, positions) if form == "rope" else ()

        def run():
            return varlen.varlen_attention(query, keys, values, slot_ids, starts, cached, d ** -0.5, longest, *tables)

        varlen.HALF_LAUNCH.update(default)
        reference = run()[0].float()
        results = []
        launches = itertools.product(*(map(int, x.split(",")) for x in (args.rows, args.block_n, args.warps,
                                                                         args.stages)), args.prefix.split(","))
        for r, n, w, s, prefix in launches:
            varlen.HALF_LAUNCH.update(rows=r, block_n=n, warps=w, stages=s)
            varlen.UNMASKED_PREFIX = prefix == "on"
            launch = {"rows": r, "block_n": n, "warps": w, "stages": s, "prefix": prefix}
            try:
                diff = (run()[0].float() - reference).abs().max().item()
                us = timed(run)
            except Exception as error:  # noqa: BLE001 (a launch the chip cannot take: shared memory, registers)
                results.append({**launch, "error": str(error)[:200]})
                continue
            results.append({**launch, "us": us, "max_diff": diff})
            print(name, results[-1], flush=True)
        varlen.HALF_LAUNCH.update(default)
        varlen.UNMASKED_PREFIX = False
        # the floor: cuDNN / flash attention of the chunk alone over its slot, keys rotated beforehand
        slot, before, count = rows[-1]
        k = _rotate_at(keys[slot : slot + 1, :, : before + count].float(), cos.float(), sin.float(),
                       positions[slot : slot + 1, :, : before + count]).to(dtype)
        v = values[slot : slot + 1, :, : before + count]
        q = query[-count:].transpose(0, 1)[None]
        sdpa = timed(lambda: split_attention(q, k, v, d ** -0.5))  # what a chunk read apart runs (cuDNN)
        ok = [x for x in results if "us" in x]
        best = min(ok, key=lambda x: x["us"]) if ok else None
        report["shapes"][name] = {"rows": len(rows), "chunk": rows[-1], "sweep": results, "best": best,
                                  "default_us": next((x["us"] for x in ok if all(x[k] == default[k] for k in default)
                                                      and x["prefix"] == "off"), None), "sdpa_chunk_alone_us": sdpa}
        print(name, "best", best, "default", report["shapes"][name]["default_us"], "sdpa (chunk alone)", sdpa,
              flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "varlen_sweep.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
