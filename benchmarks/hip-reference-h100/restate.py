"""Issue 46, on a CPU: why kvpot's InfiniteHiP and hip-attn 1.2.9 keep different keys.

`kvpot.bench.hip_rule` re-states hip-attn's selection in PyTorch with each difference from kvpot's search a switch.
This script runs it on random q/k at the `llama3-8b` head layout (32 query heads, 8 KV heads, d 128, RoPE theta 5e5)
at the `paper` case's settings, and prints, per stage, the recall of the re-stated hip-attn rule's keys by: kvpot's
search (`reference.prune`, checked identical to the rule with every switch off), each switch alone, and all switches
but one. Usage: python benchmarks/hip-reference-h100/restate.py OUT.json [n] [queries]
"""

import json
import math
import sys
import time

import torch

from kvpot.bench.hip_mapping import range_mask
from kvpot.bench.hip_rule import HIP, KVPOT, Rule, select
from kvpot.methods.infinitehip.reference import LayerPlan, Stage, prune
from kvpot.rope import rotate_half


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    out_path, n, q = argv[0], int(argv[1]) if len(argv) > 1 else 16384, int(argv[2]) if len(argv) > 2 else 1024
    torch.manual_seed(0)
    h, kv, d = 32, 8, 128
    chunks, keep, sink, window, block = (256, 32, 8), (32768, 8192, 2048), 256, 1024, 64
    query, keys = torch.randn(h, q, d), torch.randn(kv, n, d)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.outer(torch.arange(n + 4096).float(), inv)
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos(), emb.sin()
    blocks = math.ceil(q / block)
    pos = n - q + torch.arange(blocks * block).view(blocks, block)
    w0 = (pos[:, 0] + 1 - window).clamp(min=sink)
    region_end = torch.minimum(w0, pos[:, 0] + 1 - (window + chunks[0] + block)).clamp(min=sink)
    column = torch.arange(n)
    region = (column >= sink) & (column < region_end.view(-1, 1))

    def recall(mine, theirs):
        out = []
        for (ms, me), (ts, te) in zip(mine, theirs):
            a, b = range_mask(ms, me, n) & region, range_mask(ts, te, n) & region
            out.append(round(float((a & b).sum() / b.sum()), 4))
        return out

    def rule(**switches):
        return select(Rule(chunks, keep, sink, window, block, **switches), query, keys, cos, sin)

    plan = LayerPlan(tuple(Stage(c, k) for c, k in zip(chunks, keep)), sink, window, block, "relative", "streaming", True)
    ref = prune(query.view(kv, h // kv, blocks, block, d), pos < n, keys, plan, keep[-1], pos, w0,
                lambda x, p: x * cos[p] + rotate_half(x) * sin[p])
    start = time.time()
    paper = rule(**KVPOT)
    identical = all(torch.equal(range_mask(r.starts[0], r.ends[0], n), range_mask(*m, n)) for r, m in zip(ref, paper))
    hip = rule(**HIP)
    result = {"n": n, "queries": q, "heads": [h, kv, d], "chunks": chunks, "keep": keep, "sink": sink, "window": window,
              "query_block": block, "kvpot_prune_equals_rule_with_switches_off": identical,
              "recall_of_hip_rule_keys_per_stage": {"kvpot (paper search)": recall(paper, hip)}}
    for name in HIP:
        result["recall_of_hip_rule_keys_per_stage"][f"only {name}"] = recall(rule(**{**KVPOT, name: True}), hip)
        result["recall_of_hip_rule_keys_per_stage"][f"all but {name}"] = recall(rule(**{**HIP, name: False}), hip)
    result["recall_of_hip_rule_keys_per_stage"]["kvpot scan='hip' (per_head + path_max)"] = recall(
        rule(per_head=True, path_max=True), hip)
    result["seconds"] = round(time.time() - start, 1)
    result["torch"] = torch.__version__
    json.dump(result, open(out_path, "w"), indent=1)
    print(json.dumps(result, indent=1))



if __name__ == "__main__":
    main(sys.argv[1:])
