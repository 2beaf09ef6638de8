"""Issue 46: does CUDA's `torch.topk(sorted=False)` leave its picks in the order `hipscan.topk_order` assumes
(above the k-th best in place order, then ties to it in place order)? hip-attn 1.2.9 passes a stage's picks on in
that order when a call has one query block, so kvpot's `scan="hip"` follows it. Run on the GPU machine:

    PYTHONPATH=src python benchmarks/hip-reference-h100/topk_order.py OUT.json

Shapes: hip-attn's scores [batch, blocks=1, heads, candidates] (a head reduction leaves heads=1), the candidate
counts of the paper's stages at 16K-1M, float32 scores with and without ties (hip-attn's -32000 for inactive).
"""

from __future__ import annotations

import json
import sys

import torch

from kvpot.methods.infinitehip.hipscan import topk_order


def main(out: str) -> int:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for heads in (1, 8, 32):
        for count in (59, 470, 1024, 2048, 4096, 16384):
            for k in sorted({1, 16, count // 2, 256, 1024, count} & set(range(1, count + 1))):
                for ties in (False, True):
                    score = torch.randn(1, heads, count, device="cuda", generator=gen)
                    if ties:  # bf16-like rounding and a tail of inactive chunks
                        score = score.round(decimals=1)
                        score[..., count - count // 8:] = -32000.0
                    cuda = score.topk(k, dim=-1, sorted=False).indices
                    ours = topk_order(score, k)
                    rows.append({"heads": heads, "candidates": count, "k": k, "ties": ties,
                                 "same_set": bool(torch.equal(cuda.sort(-1).values, ours.sort(-1).values)),
                                 "same_order": bool(torch.equal(cuda, ours))})
    same = sum(r["same_order"] for r in rows)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": len(rows),
              "same_order": same, "rows": rows}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{same} of {len(rows)} cases in the same order; differing:",
          [(r["heads"], r["candidates"], r["k"], r["ties"]) for r in rows if not r["same_order"]][:20])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
