"""Answers batched against answers alone, on a real model (issue 43's exactness target: on SmolLM2-135M in bf16
on the GPU, >= 95% of answers identical texts, batched against alone).

`kvpot eval` answers the same samples twice, one at a time (`--batch-size 1`) and batched (`--batch-size N`),
and each sample's answer texts are compared. In float32 on a CPU they are equal by construction (the tests
check the tokens); in bf16 the batched step's kernels reduce in another order than the one-sequence step's, so a
near-tie between two tokens can go either way and the texts part from there. This counts how often.

    python benchmarks/engine-core-h100/agreement.py --out DIR [--model smollm2-135m] [--dtype bfloat16]
        [--method infinipot --method streaming ...] [--lengths 4k,8k] [--samples 8] [--batch-size 8]
        [--batch-invariant]

Writes DIR/agreement.json (per method: identical answers of samples, the 95% Wilson interval, each differing
sample's two texts) and prints a table; the two runs stay in DIR/alone/ and DIR/batched/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

METHODS = ["full", "infinipot", "citrus", "streaming", "h2o", "tova", "snapkv"]


def run_eval(args, batch_size: int, out: Path) -> list[dict]:
    command = [sys.executable, "-m", "kvpot", "eval", args.task, "--model", args.model, "--lengths", args.lengths,
               "--depths", args.depths, "--samples", str(args.samples), "--dtype", args.dtype,
               "--batch-size", str(batch_size), "--out", str(out)]
    if args.device:
        command += ["--device", args.device]
    if args.budget:
        command += ["--budget", str(args.budget)]
    if args.batch_invariant:  # both runs: alone's steps take the same fixed-tile kernels as the batch's
        command += ["--batch-invariant"]
    for method in args.method or METHODS:
        command += ["--method", method]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return read_rows(out)


def read_rows(out: Path) -> list[dict]:
    """The rows a `kvpot eval` run wrote to `out` (none if it wrote no results file yet)."""
    path = out / "results.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(alone: list[dict], batched: list[dict]) -> dict:
    """Per method: the samples both runs answered, how many answers are identical texts, and the others."""
    from kvpot.eval.stats import wilson_interval

    def key(row):  # a sample is its case: length, depth, prompt template, chat or plain, index (and its seed)
        return (row["method"], row["task"], row["length"], row.get("depth"), row.get("template"), row.get("chat"),
                row["sample"], row.get("seed"))

    theirs = {key(row): row for row in batched}
    by_method: dict[str, dict] = defaultdict(lambda: {"samples": 0, "identical": 0, "differ": []})
    for row in alone:
        other = theirs.get(key(row))
        if other is None or "prediction" not in row or "prediction" not in other:
            continue
        entry = by_method[row["method"]]
        entry["samples"] += 1
        if row["prediction"] == other["prediction"]:
            entry["identical"] += 1
        else:
            entry["differ"].append({"length": row["length"], "depth": row.get("depth"), "chat": row.get("chat"),
                                    "template": row.get("template"), "sample": row["sample"],
                                    "alone": row["prediction"], "batched": other["prediction"],
                                    "correct": [row.get("correct"), other.get("correct")]})
    for entry in by_method.values():
        entry["share"] = entry["identical"] / entry["samples"] if entry["samples"] else None
        entry["interval"] = wilson_interval(entry["identical"], entry["samples"])
    return dict(by_method)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--task", default="passkey")
    p.add_argument("--method", action="append", help=f"repeatable (default: {', '.join(METHODS)})")
    p.add_argument("--lengths", default="4k,8k")
    p.add_argument("--samples", type=int, default=8, help="samples per length and depth")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (kvpot eval --depths)")
    p.add_argument("--budget", type=int, default=1024, help="KV entries per layer for every bounded method")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--batch-invariant", action="store_true",
                   help="both runs with `kvpot eval --batch-invariant` (Engine(batch_invariant=True))")
    p.add_argument("--compare-only", action="store_true",
                   help="run no eval: compare the rows DIR/alone/ and DIR/batched/ hold (both runs' answers so far, "
                        "e.g. after a time limit stopped them)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare_only:
        alone, batched = (read_rows(args.out / name) for name in ("alone", "batched"))
    else:
        alone = run_eval(args, 1, args.out / "alone")
        batched = run_eval(args, args.batch_size, args.out / "batched")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "methods": compare(alone, batched)}
    (args.out / "agreement.json").write_text(json.dumps(result, indent=1))
    print(f"{'method':<12} {'identical':>10} {'share':>7}  95% interval")
    for method, entry in result["methods"].items():
        low, high = entry["interval"] or (float("nan"), float("nan"))
        print(f"{method:<12} {entry['identical']:>4} / {entry['samples']:<4} {entry['share']:>7.3f}  [{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
