"""Tables for README.md from the results.jsonl files of the grid (run.sh).

Usage: python benchmarks/passkey-grid-h100/tables.py [GRID_DIR]          (default: records/passkey-grid-h100)
       python benchmarks/passkey-grid-h100/tables.py --long [GRID_DIR]   (run_long.sh rows in long/, alone and
                                                                          with the seed-0 *-long-* folders)

Each cell counts the rows that are in results.jsonl: correct per depth 0.1 / 0.5 / 0.9 and the total.
A cell with fewer rows than the run asked for (samples x depths, from config.json) was cut short by the
time limit and is marked partial, with per-depth correct/finished counts.
"""

import sys
from pathlib import Path

from kvpot.eval import recorded

DEPTHS = (0.1, 0.5, 0.9)
LENGTHS = {32768: "32K", 131072: "128K", 524288: "512K", 1048576: "1M"}

TABLE4 = [  # (label, folder for 32K/128K, folder for 512K/1M or None)
    ("Full", "t4-0", None),
    ("Truncate", "t4-1", None),
    ("StreamingLLM", "t4-2", "t4-long-streaming"),
    ("CCD, absolute positions, no CaP/NuC", "t4-3", None),
    ("CCD + CR-RoPE, no CaP/NuC", "t4-4", None),
    ("+ CaP generic (NuC 0)", "t4-5", None),
    ("+ CaP question (NuC 0)", "t4-6", None),
    ("+ CaP question + NuC 0.5 (full method)", "t4-7", "t4-long-infinipot"),
    ("+ CaP generic + NuC 0.5", "t4-8", None),
]
FIG6 = [
    ("Standard CSE (`citrus:cache=none`)", "f6-0", None),
    ("CItruS shared cache", "f6-1", "f6-long-shared"),
    ("CItruS individual cache", "f6-2", None),
    ("StreamingLLM (4 + 1,020)", "f6-3", None),
    ("TOVA (1,024)", "f6-4", None),
    ("H2O (512 + 512)", "f6-5", None),
]


def load(grid: Path, folder: str):
    # plain, .gz or packed into the grid's results.jsonl.gz (records/README.md, Layout)
    rows = recorded.read_jsonl(grid / folder / "results.jsonl")
    config = recorded.read_json(grid / folder / "config.json")
    return rows, config["config"]["samples"], config["config"]["lengths"]


def cell(rows, length, samples):
    per = [[r for r in rows if r["length"] == length and r["depth"] == d] for d in DEPTHS]
    done = sum(len(p) for p in per)
    right = sum(sum(1 for r in p if r["correct"]) for p in per)
    want = samples * len(DEPTHS)
    if done == want:
        return " ".join(str(sum(1 for r in p if r["correct"])) for p in per) + f" = {right}/{done}"
    if done == 0:
        return f"not reached (0 of {want} run)"
    parts = []
    for p in per:
        c = sum(1 for r in p if r["correct"])
        parts.append(str(c) if len(p) == samples else f"{c}/{len(p)}")
    return " ".join(parts) + f" = {right}/{done} (partial: {done} of {want} run)"


def accuracy_table(grid, spec, title):
    out = [f"### {title}", "", "| variant | 32K | 128K | 512K | 1M |", "| --- | --- | --- | --- | --- |"]
    stats = []
    for label, short, long in spec:
        cells = {}
        for folder in (short, long):
            if folder is None:
                continue
            rows, samples, lengths = load(grid, folder)
            for length in lengths:
                cells[length] = cell(rows, length, samples)
                sel = [r for r in rows if r["length"] == length]
                if sel:
                    peak = max(r["stats"]["max_kv_entries"] for r in sel)
                    prefill = sum(r["stats"]["prefill_seconds"] for r in sel) / len(sel)
                    mem = max(r["stats"]["peak_memory_bytes"] for r in sel)
                    stats.append((label, folder, LENGTHS[length], len(sel), peak, prefill, mem))
        out.append(f"| {label} | " + " | ".join(cells.get(n, "-") for n in LENGTHS) + " |")
    out += ["", "| variant | folder | length | rows | peak KV entries | mean prefill s | peak memory MiB |",
            "| --- | --- | --- | --: | --: | --: | --: |"]
    for label, folder, length, n, peak, prefill, mem in stats:
        out.append(f"| {label} | `{folder}` | {length} | {n} | {peak:,} | {prefill:.2f} | {mem / 2**20:.1f} |")
    return "\n".join(out)


LONG = [  # (label, run_long.sh folder prefix in long/, earlier seed-0 folder from run.sh)
    ("InfiniPot full method (CaP question + NuC 0.5, 2,048 entries)", "infinipot-s", "t4-long-infinipot"),
    ("StreamingLLM (`window=1532,chunk_size=512`, 2,048 entries)", "streaming-s", "t4-long-streaming"),
    ("CItruS shared cache (1,318 entries)", "citrus", "f6-long-shared"),
]


def pooled_cell(groups, length):
    """groups: [(rows, samples per depth planned)] that planned `length`; counts only the rows present."""
    per = [[r for rows, _ in groups for r in rows if r["length"] == length and r["depth"] == d] for d in DEPTHS]
    want_per_depth = sum(samples for _, samples in groups)
    done = sum(len(p) for p in per)
    right = sum(sum(1 for r in p if r["correct"]) for p in per)
    want = want_per_depth * len(DEPTHS)
    parts = []
    for p in per:
        c = sum(1 for r in p if r["correct"])
        parts.append(f"{c}/{len(p)}")
    text = " ".join(parts) + f" = **{right}/{done}**"
    if done < want:
        text += f" (partial: {done} of {want} planned rows ran)"
    return text


def long_table(grid):
    out = ["| method | length | this run (seeds 100+) | earlier run (seed 0) | combined |",
           "| --- | --- | --- | --- | --- |"]
    for label, prefix, earlier in LONG:
        new = []
        for folder in sorted((grid / "long").iterdir()):
            if folder.is_dir() and folder.name.startswith(prefix):
                new.append(load(grid / "long", folder.name))
        old = [load(grid, earlier)]
        for length, name in LENGTHS.items():
            if length < 524288:
                continue
            a = [(rows, samples) for rows, samples, lengths in new if length in lengths]
            b = [(rows, samples) for rows, samples, lengths in old if length in lengths]
            out.append(f"| {label} | {name} | {pooled_cell(a, length)} | {pooled_cell(b, length)} | "
                       f"{pooled_cell(a + b, length)} |")
    return "\n".join(out)


RECORDS = Path(__file__).resolve().parents[2] / "records" / "passkey-grid-h100"  # the recorded runs


def main():
    if sys.argv[1:2] == ["--long"]:
        grid = Path(sys.argv[2]) if len(sys.argv) > 2 else RECORDS
        print(long_table(grid))
        return
    grid = Path(sys.argv[1]) if len(sys.argv) > 1 else RECORDS
    print(accuracy_table(grid, TABLE4, "Issue 4: InfiniPot Table 4 ablation"))
    print()
    print(accuracy_table(grid, FIG6, "Issue 5: CItruS Fig. 6"))


if __name__ == "__main__":
    main()
