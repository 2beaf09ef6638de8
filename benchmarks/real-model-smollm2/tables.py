"""Merge `kvpot eval` folders (one per process of run_gpu.sh / run_cpu.sh) into one summary.

Every folder's `results.jsonl` is read row by row, so a process stopped by its time limit still
counts for the samples it finished. Variants are named by their `--method` spec as written
(`infinipot:catalyst=question`), per task; a `--dtype` given explicitly is added (`... [float32]`). Folders
written by `kvpress_eval.py answer` merge the same way (variant `kvpress:PRESS:kept=K`). Writes summary.md, summary.json and one heatmap per
task and variant (`heatmap_<task>_<variant>.png`, depth x length, `-` = not run) to --out.

    python benchmarks/real-model-smollm2/tables.py RUNS_DIR [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from kvpot.eval import recorded


def load(root: Path) -> tuple[list[dict], dict]:
    """Every row under `root` (its `spec` added from the folder's config.json) and each folder's planned cells."""
    rows, planned = [], {}
    for config_path in recorded.files(root, "config.json"):  # plain, .gz or packed (records/README.md, Layout)
        folder = config_path.parent
        results = folder / "results.jsonl"
        if not recorded.exists(results):
            continue
        config = recorded.read_json(config_path)
        cfg = config["config"]
        # a dtype asked for explicitly (--dtype float32 on the GPU) is a variant of its own, not pooled
        dtype = f" [{cfg['dtype']}]" if cfg.get("dtype", "auto") != "auto" else ""
        specs = {label: m["spec"] + dtype for label, m in config.get("methods", {}).items()}
        for spec in specs.values():
            planned[(cfg["task"], spec, folder.name)] = {
                "lengths": cfg["lengths"], "depths": cfg["depths"], "samples": cfg["samples"]}
        for row in recorded.read_jsonl(results):
            row["spec"] = specs.get(row["method"], row["method"])
            row["folder"] = folder.name
            rows.append(row)
    return rows, planned


def summarize(rows: list[dict], planned: dict) -> dict:
    cells: dict = defaultdict(lambda: defaultdict(list))  # (task, spec) -> (length, depth) -> scores
    cost: dict = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[(r["task"], r["spec"])][(r["length"], r["depth"])].append(r["score"])
        cost[(r["task"], r["spec"])][r["length"]].append(r["stats"])
    expected: dict = defaultdict(int)
    for (task, spec, _), p in planned.items():
        for n in p["lengths"]:
            for d in p["depths"]:
                expected[(task, spec, n, d)] += p["samples"]
    out = {}
    for (task, spec), by_cell in cells.items():
        lengths = sorted({n for n, _ in by_cell} | {n for (t, s, n, _) in expected if (t, s) == (task, spec)})
        depths = sorted({d for _, d in by_cell} | {d for (t, s, _, d) in expected if (t, s) == (task, spec)})
        entry = {"lengths": lengths, "depths": depths, "cells": {}, "cost": {}}
        for n in lengths:
            for d in depths:
                scores = by_cell.get((n, d), [])
                entry["cells"][f"{n}/{d:g}"] = {"correct": sum(scores), "run": len(scores),
                                                "planned": expected.get((task, spec, n, d), 0)}
            stats = cost[(task, spec)].get(n, [])
            if stats:
                entry["cost"][str(n)] = {
                    "peak_kv_entries": max(s["max_kv_entries"] for s in stats),
                    "mean_prefill_seconds": sum(s["prefill_seconds"] for s in stats) / len(stats)}
        out.setdefault(task, {})[spec] = entry
    return out


def _length(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def markdown(summary: dict) -> str:
    lines = []
    for task, variants in summary.items():
        lengths = sorted({n for v in variants.values() for n in v["lengths"]})
        lines += [f"## {task}", "", "Correct / run per length (depths pooled); `(of P)` when fewer ran than "
                  "planned (a process stopped by its time limit); peak KV entries and mean prefill seconds "
                  "at the longest length run.", "",
                  "| method | " + " | ".join(_length(n) for n in lengths) + " | peak KV | prefill s |",
                  "| --- |" + " ---: |" * (len(lengths) + 2)]
        for spec, v in variants.items():
            cols = []
            for n in lengths:
                cs = [c for key, c in v["cells"].items() if key.startswith(f"{n}/")]
                run, correct, plan = sum(c["run"] for c in cs), sum(c["correct"] for c in cs), sum(c["planned"] for c in cs)
                cols.append("-" if not run and not plan else f"{correct:g}/{run}" + (f" (of {plan})" if plan > run else ""))
            longest = max((int(n) for n in v["cost"]), default=None)
            c = v["cost"].get(str(longest), {}) if longest else {}
            lines.append(f"| `{spec}` | " + " | ".join(cols) + f" | {c.get('peak_kv_entries', '-'):,} | "
                         f"{c.get('mean_prefill_seconds', float('nan')):.2f} |" if c else
                         f"| `{spec}` | " + " | ".join(cols) + " | - | - |")
        lines += ["", "By depth (correct / run at depths " + ", ".join(
            f"{d:g}" for d in sorted({d for v in variants.values() for d in v["depths"]})) + "):", "",
                  "| method | " + " | ".join(_length(n) for n in lengths) + " |", "| --- |" + " --- |" * len(lengths)]
        for spec, v in variants.items():
            cols = []
            for n in lengths:
                parts = [f"{v['cells'][f'{n}/{d:g}']['correct']:g}/{v['cells'][f'{n}/{d:g}']['run']}"
                         for d in v["depths"] if f"{n}/{d:g}" in v["cells"]]
                cols.append(" ".join(parts) if any(not p.endswith("/0") for p in parts) else "-")
            lines.append(f"| `{spec}` | " + " | ".join(cols) + " |")
        lines.append("")
    return "\n".join(lines)


def heatmaps(summary: dict, out: Path) -> None:
    from kvpot.eval.report import heatmap_png
    from kvpot.reporting import slug

    for task, variants in summary.items():
        for spec, v in variants.items():
            grid = []
            for d in v["depths"]:
                row = []
                for n in v["lengths"]:
                    c = v["cells"][f"{n}/{d:g}"]
                    row.append(c["correct"] / c["run"] if c["run"] else None)
                grid.append(row)
            runs = sorted({c["run"] for c in v["cells"].values() if c["run"]})
            title = f"{task} - {spec}\nsamples per cell: {'/'.join(map(str, runs))}"
            heatmap_png(out / f"heatmap_{task}_{slug(spec)}.png", grid, v["lengths"], v["depths"], title)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path)
    p.add_argument("--out", type=Path, default=None, help="default: ROOT")
    p.add_argument("--no-heatmaps", dest="heatmaps", action="store_false")
    args = p.parse_args(argv)
    out = args.out or args.root
    out.mkdir(parents=True, exist_ok=True)
    rows, planned = load(args.root)
    if not rows:
        print(f"no results under {args.root}", file=sys.stderr)
        return 1
    summary = summarize(rows, planned)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    if args.heatmaps:
        heatmaps(summary, out)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
