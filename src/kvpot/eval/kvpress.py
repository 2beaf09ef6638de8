"""kvpress presses on `kvpot eval`'s own samples (`--baseline kvpress --press P --compression-ratios R`).

NVIDIA's kvpress keeps a public leaderboard of its presses on RULER (score against compression ratio).
`kvpot eval` puts those presses in the same table as kvpot's methods, on the same cases: while kvpot's
methods answer, each case's token ids (special prefix or chat template, context, question, answer
length) go to `kvpress-cases.jsonl`; then, per press, a second Python process
(`python -m kvpot.eval.kvpress_worker`, PYTHONPATH = `--kvpress-path` then kvpot's `src/`, because
kvpress 0.5.x needs transformers < 5.3; `benchmarks/kvpress-env/`) answers every case at every ratio
through kvpress' pipeline protocol. This process decodes each answer with the same tokenizer and scores
it with the case's own metric, so a press's row is exactly a method's row: same fields in
`results.jsonl`, same intervals in the tables. The cases file is deleted afterwards (it is rebuilt
from the seeds). A press whose process cannot import kvpress, or fails, is recorded with the reason in
`summary.json` (`kvpress`) and has no rows; the kvpot rows of the run stand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpot.errors import KvpotError

DEFAULT_PRESSES = ("snapkv", "expected_attention", "streaming_llm", "tova", "knorm")
CASES_FILE = "kvpress-cases.jsonl"


@dataclass
class PressRun:
    """One press at one compression ratio, as a column of the results (label `kvpress:NAME@RATIO`)."""

    label: str
    press: str
    ratio: float

    def describe(self) -> dict:
        from kvpot.eval.kvpress_worker import PRESSES

        return {"spec": f"kvpress:{self.press}", "family": f"kvpress:{self.press}", "compression_ratio": self.ratio,
                "config": {"press": PRESSES[self.press], "compression_ratio": self.ratio}, "max_entries": None,
                "baseline": "kvpress"}


def press_runs(presses: list[str], ratios: list[float]) -> list[PressRun]:
    from kvpot.eval.kvpress_worker import PRESSES
    from kvpot.eval.ratios import ratio_label

    unknown = [p for p in presses if p not in PRESSES]
    if unknown:
        raise KvpotError(f"unknown kvpress press {unknown[0]!r}; choose from: {', '.join(PRESSES)}.")
    return [PressRun(ratio_label(f"kvpress:{p}", r), p, r) for p in presses for r in ratios]


@dataclass
class _Kept:
    """What scoring a press's answer needs of a case (its ids went to the file)."""

    row: dict
    answers: list
    max_new_tokens: int
    context_tokens: int
    score: object


class CaseFile:
    """The cases kvpot's methods read, written as token ids for the kvpress process."""

    def __init__(self, path: Path, eos_ids: list[int]):
        self.path = path
        self.eos_ids = eos_ids
        self.cases: list[_Kept] = []
        self._handle = open(path, "w", encoding="utf-8")

    def add(self, case) -> None:
        self._handle.write(json.dumps({"case": len(self.cases), "context_ids": list(case.context_ids),
                                       "question_ids": list(case.question_ids), "max_new_tokens": case.max_new_tokens,
                                       "eos_ids": self.eos_ids}) + "\n")
        self.cases.append(_Kept(case.row, case.answers, case.max_new_tokens, len(case.context_ids), case.score))

    def close(self) -> None:
        self._handle.close()


def worker_command(press: str, ratios: list[float], cases: Path, model_dir: str, device: str, dtype: str,
                   out: Path) -> list[str]:
    return [sys.executable, "-m", "kvpot.eval.kvpress_worker", "--cases", str(cases), "--model-dir", model_dir,
            "--press", press, "--ratios", ",".join(f"{r:g}" for r in ratios), "--device", device, "--dtype", dtype,
            "--out", str(out)]


def run_press(press: str, ratios: list[float], case_file: CaseFile, kvpress_path, model_dir: str, device: str,
              dtype: str, out_dir: Path) -> tuple[list[dict], dict]:
    """(the answers of `press` at every ratio, what its process reported: versions, settings, or why it failed)."""
    src = Path(__file__).resolve().parents[2]  # the folder holding the `kvpot` package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(kvpress_path).resolve()), str(src)])}
    answers = out_dir / f"kvpress-{press}-answers.jsonl"
    done = subprocess.run(worker_command(press, ratios, case_file.path, model_dir, device, dtype, answers),
                          capture_output=True, text=True, env=env)
    (out_dir / f"kvpress-{press}.log").write_text(done.stdout + done.stderr, encoding="utf-8")
    info = _last_json(done.stdout)
    if info is None:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}, no output"])[-1][:300]
        info = {"error": f"kvpress worker failed: {tail}"}
    if info.get("import_error"):
        info["skipped"] = f"{info.pop('error')} (from {kvpress_path})"
    rows = [json.loads(line) for line in answers.read_text().splitlines() if line.strip()] if answers.exists() else []
    answers.unlink(missing_ok=True)
    return rows, {"returncode": done.returncode, **info}


def press_row(run: PressRun, answer: dict, kept: _Kept, tokenizer) -> dict:
    """A results.jsonl row for one press answer, as a kvpot method's row (the case's own metric)."""
    prediction = tokenizer.decode(answer["tokens"], skip_special_tokens=True)
    value = kept.score(prediction)
    return {
        "method": run.label, "method_name": "kvpress", "method_config": run.describe()["config"], **kept.row,
        "compression_ratio": run.ratio, "answers": kept.answers, "prediction": prediction, "score": value,
        "correct": value == 1.0, "max_new_tokens": kept.max_new_tokens,
        "stats": {  # the press reads the whole context before pruning it: that is its peak
            "max_kv_entries": kept.context_tokens, "kept_entries": max(answer["kept"]),
            "kv_entries_per_layer": answer["kept"], "context_tokens": kept.context_tokens,
            "new_tokens": len(answer["tokens"]), "prefill_seconds": answer["prefill_seconds"],
            "decode_seconds": answer["decode_seconds"], "peak_memory_bytes": None,
        },
    }


def run_presses(runs: list[PressRun], case_file: CaseFile, tokenizer, config, model_dir: str, device: str,
                dtype: str, results, show: bool = True) -> tuple[list[dict], dict]:
    """Every press (one process each, all its ratios) over the written cases; rows go to `results` as well."""
    case_file.close()
    rows, info = [], {}
    by_key = {(r.press, r.ratio): r for r in runs}
    for press in dict.fromkeys(r.press for r in runs):
        ratios = [r.ratio for r in runs if r.press == press]
        if show:
            print(f"kvpress {press}: {len(case_file.cases)} cases x {len(ratios)} ratios", flush=True)
        answers, info[press] = run_press(press, ratios, case_file, config.kvpress_path, model_dir, device, dtype,
                                         config.out)
        for answer in answers:
            row = press_row(by_key[press, answer["ratio"]], answer, case_file.cases[answer["case"]], tokenizer)
            results.write(json.dumps(row) + "\n")
            results.flush()
            rows.append(row)
        if show and (info[press].get("skipped") or info[press].get("error")):
            print(f"kvpress {press}: {info[press].get('skipped') or info[press].get('error')}", flush=True)
    case_file.path.unlink(missing_ok=True)
    return rows, info


def _last_json(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.strip().startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None
