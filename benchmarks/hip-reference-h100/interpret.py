"""Issue 46, on a CPU: what `kvpot bench hip-reference` sends hip-attn 1.2.9 for a decoding step, run through
hip-attn's own kernels under Triton's interpreter (`kvpot.bench.hip_shim.load_hip_interpreted`), tiny shape.

Run:  PYTHONPATH=src:/tmp/hip-site:<triton> python benchmarks/hip-reference-h100/interpret.py [N] [--case paper]
(N keys, default 2048; Triton from any wheel, a CPU machine is enough; TRITON_INTERPRET=1 is set here.)

One step (the query at N - 1) is sent four ways; every output is compared with the first:

- `extend-plain`: hip-attn's prefill path on plain k/v (two query rows, `disable_flashdecode=True`): the
  reference, what the harness sent before;
- `extend-paged`: the same on the paged cache (`kvpot.bench.hip_reference.paged_cache`, k = v = None): reads the
  same keys only if the layout is right;
- `decode-paged`: the harness's step (`HipDecoder`): one query row to hip-attn's decoding kernel, the paged
  cache, the scan's two rows as `q_mask`;
- `decode-paged-1-split`: the same with `SA_DECODE_MAX_PROGRAM=1` (one split per section of the decoding
  kernel): equal to `extend-plain`. With its default splits the decoding kernel counts a sparse block once per
  split that reads it: a split steps through BLOCK_BK blocks without masking at its own end, so where
  ceil(blocks / splits) is not a multiple of BLOCK_BK, some blocks weigh 2 or 3 in its softmax (hip-attn's
  behaviour, on a GPU too: the split sizes are host arithmetic). It prints both.

Then a forward of five query rows (a short question) as the `hipattn` method sends it (`question_rows`: causal
inside the chunk), and a few `HipDecoder` steps with the mask refresh, each checked for finite output. Exit status
1 if `extend-paged` or `decode-paged-1-split` differ from `extend-plain`, the selections differ, or the question's
earlier rows see its last key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace



def small_case():
    """A scaled-down paper case: the interpreter runs a kernel program at a time."""
    from kvpot.bench.hip_mapping import CASES

    return replace(CASES["paper"], name="paper-small", chunks=(64, 16, 4), keep=(1024, 512, 256), early_keep=256,
                   sink=64, window=256, refresh=(4, 2, 1))


def question_rows(hip, case, inputs, rows: int = 5) -> dict:
    """A forward of a few query rows (a short question) through `kvpot.bench.hip_method.HipAttnRuntime`, as the
    `hipattn` method sends it (hip-attn's prefill kernel, `disable_flashdecode`): causal inside the chunk, so
    changing the last key's value must change the last row's output only."""
    from types import SimpleNamespace

    from kvpot.bench.hip_method import HipAttnRuntime

    runtime = HipAttnRuntime(hip, case, inputs.rope, inputs.max_positions, 0, 1)
    layer = SimpleNamespace(layer_idx=0)  # no early layers: the case's later-layer settings
    query, keys, values = (x.unsqueeze(0) for x in (inputs.query[:, -rows:], inputs.keys, inputs.values))
    changed = values.clone()
    changed[:, :, -1] += 10.0
    out = runtime(layer, query, keys, values, inputs.scaling)
    other = runtime(layer, query, keys, changed, inputs.scaling)
    return {"rows": rows, "earlier_rows_moved": float((out - other)[:, :, :-1].abs().max()),
            "last_row_moved": float((out - other)[:, :, -1].abs().max()), "finite": bool(out.isfinite().all())}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int, nargs="?", default=2048)
    parser.add_argument("--case", default=None, help="a case of kvpot.bench.hip_mapping.CASES (default: paper-small)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    # the interpreter for the kernels of this process only (set before Triton is imported, not at import of this
    # file: the benchmark-scripts test imports every script into the test session)
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from kvpot.bench import hip_reference as ref
    from kvpot.bench.hip_inputs import random_inputs
    from kvpot.bench.hip_mapping import CASES
    from kvpot.bench.hip_shim import load_hip_interpreted

    hip = load_hip_interpreted()
    case = CASES[args.case] if args.case else small_case()
    n = args.n
    inputs = random_inputs("tiny", n, 16, "cpu", torch.float32, 0)
    query = inputs.query[:, -1:]
    q = ref.hip_query(query, inputs.scaling)
    two = ref._bthd(torch.cat([q, q], dim=1))
    positions = torch.full((2,), n - 1)
    paged = ref.paged_cache(inputs.keys, inputs.values, n, n)

    def call(q_sent, k, v, **extra):
        fields = ref.hip_args(hip, case, inputs, False, positions, True, **extra)
        out, metadata = hip.attention(q_sent, k, v, fields)
        return out[0, :1].transpose(0, 1), metadata

    outs = {"extend-plain": call(two, ref._bthd(inputs.keys), ref._bthd(inputs.values), disable_flashdecode=True),
            "extend-paged": call(two, None, None, disable_flashdecode=True, **paged),
            "decode-paged": call(ref._bthd(q), None, None, q_mask=two, **paged)}
    os.environ["SA_DECODE_MAX_PROGRAM"] = "1"
    try:
        outs["decode-paged-1-split"] = call(ref._bthd(q), None, None, q_mask=two, **paged)
    finally:
        del os.environ["SA_DECODE_MAX_PROGRAM"]
    base, chosen = outs["extend-plain"]
    dense = ref.dense(inputs, query, n)
    report = {"n": n, "case": case.name, "replaced": sorted(hip.replaced), "calls": {}}
    for name, (out, metadata) in outs.items():
        report["calls"][name] = {"max_vs_extend_plain": float((out - base).abs().max()),
                                 "same_selection": bool(torch.equal(metadata.indices, chosen.indices)
                                                        and torch.equal(metadata.ks, chosen.ks)),
                                 "max_vs_dense": float((out - dense).abs().max())}
    report["question"] = question_rows(hip, case, inputs)
    decoder = ref.HipDecoder(hip, case, inputs, False, True)
    steps = []
    for s in range(args.steps):
        length = n - args.steps + s + 1
        out, recomputed = decoder(s, inputs.query[:, inputs.query.shape[1] - args.steps + s:][:, :1], length)
        steps.append({"step": s, "keys": length, "recomputed": recomputed, "finite": bool(out.isfinite().all())})
    report["decoder_steps"] = steps
    print(json.dumps(report, indent=2))
    calls = report["calls"]
    ok = all(calls[name]["max_vs_extend_plain"] < 1e-5 for name in ("extend-paged", "decode-paged-1-split"))
    ok = ok and all(call["same_selection"] for call in calls.values()) and all(s["finite"] for s in steps)
    question = report["question"]
    ok = ok and question["earlier_rows_moved"] == 0.0 and question["last_row_moved"] > 0 and question["finite"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
