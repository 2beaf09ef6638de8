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

Each case carries its key (`kvpot.eval.resume.case_key`), and the answers file
`kvpress-PRESS-answers.jsonl` is kept: answers become rows whenever the process ends (at its
`--deadline`, from `--time-limit`; killed at SIGTERM; or done), and `--resume` neither asks again for
an answer that is there nor writes a row twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpot.errors import KvpotError
from kvpot.eval.limits import FINISH_SECONDS

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
    """The cases kvpot's methods read, written as token ids (and each one's key) for the kvpress process."""

    def __init__(self, path: Path, eos_ids: list[int]):
        self.path = path
        self.eos_ids = eos_ids
        self.cases: dict[str, _Kept] = {}  # case key (kvpot.eval.resume.case_key) -> what scoring needs
        self._handle = open(path, "w", encoding="utf-8")  # noqa: SIM115 - written by add(), closed by close()

    def add(self, case) -> None:
        self._handle.write(json.dumps({"case": len(self.cases), "key": case.key, "context_ids": list(case.context_ids),
                                       "question_ids": list(case.question_ids), "max_new_tokens": case.max_new_tokens,
                                       "eos_ids": self.eos_ids}) + "\n")
        self._handle.flush()
        self.cases[case.key] = _Kept(case.row, case.answers, case.max_new_tokens, len(case.context_ids), case.score)

    def close(self) -> None:
        self._handle.close()


def worker_command(press: str, ratios: list[float], cases: Path, model_dir: str, device: str, dtype: str,
                   out: Path, deadline: float | None = None) -> list[str]:
    return [sys.executable, "-m", "kvpot.eval.kvpress_worker", "--cases", str(cases), "--model-dir", model_dir,
            "--press", press, "--ratios", ",".join(f"{r:g}" for r in ratios), "--device", device, "--dtype", dtype,
            "--out", str(out), *([] if deadline is None else ["--deadline", f"{deadline:.1f}"])]


def run_press(press: str, ratios: list[float], case_file: CaseFile, kvpress_path, model_dir: str, device: str,
              dtype: str, out_dir: Path, seconds: float | None = None) -> dict:
    """Start the process answering `press` at every ratio into `kvpress-PRESS-answers.jsonl` (kept: a resumed
    run's process skips the answers there), `seconds` at most; what it reported: counts, versions, or why it failed.
    SIGTERM here (`Interrupted`) kills the process and reaches the caller; its flushed answers stay."""
    src = Path(__file__).resolve().parents[2]  # the folder holding the `kvpot` package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(kvpress_path).resolve()), str(src)])}
    command = worker_command(press, ratios, case_file.path, model_dir, device, dtype, answers_path(out_dir, press),
                             seconds)
    try:  # the worker stops itself at its deadline; the timeout is for an answer that overruns it
        done = subprocess.run(command, capture_output=True, text=True, env=env,
                              timeout=None if seconds is None else seconds + FINISH_SECONDS / 2)
        stdout, stderr, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        stdout, stderr, code = _text(err.stdout), _text(err.stderr), None
    (out_dir / f"kvpress-{press}.log").write_text(stdout + stderr, encoding="utf-8")
    info = _last_json(stdout)
    if info is None:
        tail = (stderr.strip().splitlines() or [f"exit status {code}, no output"])[-1][:300]
        info = {"error": "kvpress worker stopped at the time limit" if code is None else
                f"kvpress worker failed: {tail}"}
        if code is None:
            info["stopped"] = "deadline"
    if info.get("import_error"):
        info["skipped"] = f"{info.pop('error')} (from {kvpress_path})"
    return {"returncode": code, **info}


def answers_path(out_dir: Path, press: str) -> Path:
    return out_dir / f"kvpress-{press}-answers.jsonl"


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
                dtype: str, results, show: bool = True, done=None, deadline=None, stop=None,
                stopped: str | None = None) -> tuple[list[dict], dict, str | None]:
    """Every press (one process each, all its ratios) over the written cases, in the time `deadline` leaves;
    then each answer in the press's answers file without a row in `done` becomes one (a stopped process's
    answers too, and an earlier run's); rows go to `results` as well. A run already `stopped` (why: time
    limit, SIGTERM) only converts. Returns the rows, what each process reported, and why the run stopped."""
    from kvpot.eval.limits import Deadline, Interrupted, Terminate
    from kvpot.eval.resume import Done

    done, deadline, stop = done or Done([], False), deadline or Deadline(None), stop or Terminate()
    case_file.close()
    rows, info = [], {}
    try:
        for press in dict.fromkeys(r.press for r in runs):
            mine = {r.ratio: r for r in runs if r.press == press}
            try:
                info[press], why = _launch(press, mine, case_file, config, model_dir, device, dtype, done, deadline,
                                           stopped, show)
            except Interrupted:
                info[press], why = {"stopped": "SIGTERM"}, "SIGTERM"
            stopped = stopped or why
            try:
                with stop.held():
                    rows += _convert(press, mine, case_file, tokenizer, config.out, done, results)
            except Interrupted:  # deferred to the end of the rows: they are written
                stopped = "SIGTERM"
    finally:
        case_file.path.unlink(missing_ok=True)
    return rows, info, stopped


def _launch(press, mine: dict, case_file: CaseFile, config, model_dir, device, dtype, done, deadline, stopped,
            show) -> tuple[dict, str | None]:
    """Run the press's process if it has cases left and time; (what it reported, why it stopped or None)."""
    left = sum(1 for key in case_file.cases for run in mine.values() if not done.has(run.label, key))
    if not left:
        return {"not_started": "every case already answered"}, None
    if stopped:
        return {"not_started": stopped, "left": left}, None
    seconds = None if deadline.end is None else deadline.remaining() - FINISH_SECONDS
    if seconds is not None and seconds <= 0:
        return {"not_started": "time limit", "left": left}, "time limit"
    if show:
        print(f"kvpress {press}: {len(case_file.cases)} cases x {len(mine)} ratios ({left} answers left)"
              + ("" if seconds is None else f", {seconds:.0f} s"), flush=True)
    info = run_press(press, list(mine), case_file, config.kvpress_path, model_dir, device, dtype, config.out,
                     seconds)
    if show and (info.get("skipped") or info.get("error")):
        print(f"kvpress {press}: {info.get('skipped') or info.get('error')}", flush=True)
    return info, {"deadline": "time limit", "SIGTERM": "SIGTERM"}.get(info.get("stopped"))


def _convert(press, mine: dict, case_file: CaseFile, tokenizer, out: Path, done, results) -> list[dict]:
    """Rows of the press's answers (by case key and ratio) that have none yet."""
    from kvpot.eval.limits import read_jsonl

    rows = []
    for answer in read_jsonl(answers_path(out, press)):
        run, kept = mine.get(answer.get("ratio")), case_file.cases.get(answer.get("key"))
        if run is None or kept is None or done.has(run.label, answer["key"]):
            continue  # another ratio or case (an earlier run's), or a row already written
        row = press_row(run, answer, kept, tokenizer)
        results.write(json.dumps(row) + "\n")
        results.flush()
        rows.append(row)
        done.add(row)
    return rows


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _last_json(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.strip().startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None
