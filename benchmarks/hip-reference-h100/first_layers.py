"""Issue 46, on a GPU: how far the first layers' selection is set by arithmetic precision, beside how far kvpot's
`scan="hip"` is from hip-attn 1.2.9 there.

Run:  PYTHONPATH=src:/tmp/hip-site python benchmarks/hip-reference-h100/first_layers.py OUT.json
(random q/k in the `llama3-8b` layout, 1,024 queries, 16K and 128K keys, the paper-hipscan case, layer 0 and, for
contrast, a later layer at 16K; a few minutes on an H200.)

Five selections of the same bf16-rounded q/k: hip-attn and kvpot computing in bf16 and in float32, and hip-attn's
rule re-stated in plain float32 PyTorch (`kvpot.bench.hip_rule`, which equals hip-attn's kernels under Triton's
interpreter and kvpot's `scan="hip"` on a CPU, tests/test_hip_reference.py). Writes, per stage, the recall of one
selection's keys by another (pooled over query blocks, before each block's window, as `kvpot bench hip-reference`):
if hip-attn in bf16 keeps no more of its own float32 selection than kvpot keeps of hip-attn's, the gap is the
arithmetic, not the rule.
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import torch

    from kvpot.bench import hip_reference as ref
    from kvpot.bench.hip_inputs import random_inputs
    from kvpot.bench.hip_mapping import CASES
    from kvpot.bench.hip_rule import HIP, Rule, select
    from kvpot.bench.hip_shim import load_hip

    hip, case = load_hip(), CASES["paper-hipscan"]
    pairs = [("kvpot bf16", "hip bf16"), ("hip f32", "hip bf16"), ("kvpot f32", "kvpot bf16"),
             ("rule", "hip bf16"), ("rule", "kvpot bf16"), ("rule", "hip f32"), ("rule", "kvpot f32"),
             ("kvpot f32", "hip f32")]
    rows = []
    for n, early in ((16384, True), (16384, False), (131072, True)):
        start = time.time()
        bf16 = random_inputs("llama3-8b", n, 1024, "cuda", torch.bfloat16, 0)
        f32 = random_inputs("llama3-8b", n, 1024, "cuda", torch.bfloat16, 0)
        f32.query, f32.keys, f32.values = bf16.query.float(), bf16.keys.float(), bf16.values.float()
        sides = {"hip bf16": ref.hip_prefill(hip, case, bf16, early, "cuda", 1),
                 "kvpot bf16": ref.kvpot_prefill(case, bf16, early, "cuda", 1),
                 "hip f32": ref.hip_prefill(hip, case, f32, early, "cuda", 1),
                 "kvpot f32": ref.kvpot_prefill(case, f32, early, "cuda", 1)}
        keep = case.early_keep if early else case.keep[-1]
        rule = Rule(case.chunks, (*case.keep[:-1], keep), case.sink, case.window, case.query_block, **HIP,
                    streaming=early)
        table = torch.arange(n + case.window + 2, device="cuda")
        cos, sin = f32.rope.cos_sin(table, f32.keys, table.numel())  # [P, d]
        sides["rule"] = ref.Side(None, select(rule, f32.query, f32.keys, cos.float(), sin.float()))
        for mine, theirs in pairs:
            stages = ref.compare_stages(sides[mine], sides[theirs], case, n, 1024)
            rows.append({"n": n, "layer": "early" if early else "late", "selection": mine, "of": theirs,
                         "recall": [s["recall"] for s in stages],
                         "block_recall_min": [s["block_recall_min"] for s in stages]})
            print(json.dumps(rows[-1]), flush=True)
        print(f"{n} {'early' if early else 'late'}: {time.time() - start:.0f} s", flush=True)
        torch.cuda.empty_cache()
    with open(argv[0], "w") as out:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
