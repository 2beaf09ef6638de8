"""Issue 32: how many cuDNN attention plans each kvpress answer of ruler/ needed, against its seconds.

torch 2.11 on an H100 runs SDPA on cuDNN, which builds one execution plan per new attention problem; its plan
cache (aten/src/ATen/native/cudnn/MHA.cpp) is keyed by the query and key lengths. For each answer in
ruler/kvpress-*/kvpress-*-answers.jsonl (one file per worker; a case number not above the last one starts a
new call, i.e. a new process with an empty cache) this counts the problems met for the first time: the
context's causal forward, the question (one masked forward, or token by token when the layers differ in
length, as kvpot.bench.kvpress_runner.prefill feeds it), and one query per decoding step against each layer's
length. Prints each answer (folder, case, new plans, seconds, layers differ) and a least-squares line over all.

    python benchmarks/protocol-smollm2-gpu/plan_counts.py     (from the repository root)
"""
import fnmatch
import gzip
import json
from pathlib import Path

import numpy as np

from kvpot.eval import recorded

RULER = Path(__file__).resolve().parents[2] / "records" / "protocol-smollm2-gpu" / "ruler"  # the recorded runs


def problems(context: int, question: int, kept: list[int], steps: int) -> set:
    found = {(context, context, True)}
    if len(set(kept)) == 1:
        found.add((question, kept[0] + question, False))
    else:
        found |= {(1, k + j, False) for k in kept for j in range(1, question + 1)}
    return found | {(1, k + question + t, False) for k in kept for t in range(1, steps + 1)}


def main() -> None:
    cases = {}
    with gzip.open(RULER / "kvpress-cases.jsonl.gz", "rt") as handle:
        for line in handle:
            case = json.loads(line)
            cases[case["case"]] = (len(case["context_ids"]), len(case["question_ids"]))
    rows = []
    # the answers are packed into ruler/results.jsonl.gz (records/README.md, Layout): listed by their former paths
    answer_files = [p for p in recorded.paths(RULER) if fnmatch.fnmatch(p.relative_to(RULER).as_posix(),
                                                                         "kvpress-*-0.*/kvpress-*-answers.jsonl")]
    for path in answer_files:
        seen, last = set(), None
        for answer in recorded.read_jsonl(path):
            if last is not None and answer["case"] <= last:
                seen = set()
            last = answer["case"]
            context, question = cases[answer["case"]]
            met = problems(context, question, answer["kept"], len(answer["tokens"]) - 1)
            new, seen = len(met - seen), seen | met
            seconds = answer["prefill_seconds"] + answer["decode_seconds"]
            rows.append((Path(path).parent.name, answer["case"], new, seconds, len(set(answer["kept"])) > 1))
            print(*rows[-1][:2], new, f"{seconds:.1f}", rows[-1][4])
    x = np.array([r[2] for r in rows], dtype=float)
    y = np.array([r[3] for r in rows])
    slope, intercept = np.polyfit(x, y, 1)
    print(f"{len(rows)} answers: seconds = {intercept:.1f} + {1000 * slope:.0f} ms x new plans "
          f"(correlation {np.corrcoef(x, y)[0, 1]:.2f})")


if __name__ == "__main__":
    main()
