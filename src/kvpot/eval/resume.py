"""`kvpot eval --resume`: continue a stopped run in its own folder, and say what a run left out.

Every sample of a run is seeded by its cell (`sample_seed`: length, depth, template, chat flag, key format, index;
a RULER item by its task, id, length, template, chat flag), so a sample answered again gives the same
row. A resumed run therefore reads the rows already in `results.jsonl`, skips each (method, sample)
that has one, and appends the rest: the union is the rows one uninterrupted run would have written.
That holds only if the folder was run with the same options, so `--resume` refuses a folder whose
`config.json` differs in anything but how the run was executed (`EXECUTION_ONLY`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from kvpot.errors import KvpotError

#: options that change how a run goes, not which rows it writes (batching gives the same greedy answers)
EXECUTION_ONLY = ("out", "time_limit", "resume", "batch_size", "mix", "kvpress_path")

TASK_KEY = ("length", "depth", "template", "chat", "sample", "seed")
SUITE_KEY = ("subtask", "id", "group", "sample", "template", "chat")  # a suite row's length is its token count


def case_key(fields: dict, suite: bool) -> str:
    """The sample a row (or a case about to be built) answers, as a string (the kvpress files carry it).

    A task row's key format (`--key-formats`) ends its key; rows without one (the task's own format, as
    every run before key formats were a dimension) keep the key they had."""
    key = [fields.get(name) for name in (SUITE_KEY if suite else TASK_KEY)]
    if not suite and fields.get("key_format") is not None:
        key.append(fields["key_format"])
    return json.dumps(key)


class Done:
    """The rows of this run's folder so far, and which (method label, sample) they answer."""

    def __init__(self, rows: list[dict], suite: bool):
        self.rows, self.suite = rows, suite
        self.keys = {(r["method"], case_key(r, suite)) for r in rows}

    def has(self, label: str, key: str) -> bool:
        return (label, key) in self.keys

    def missing(self, labels, key: str) -> list[str]:
        return [label for label in labels if (label, key) not in self.keys]

    def add(self, row: dict) -> None:
        self.keys.add((row["method"], case_key(row, self.suite)))

    def count(self, label: str) -> int:
        return sum(1 for method, _ in self.keys if method == label)

    def skip(self, labels):
        """Whether a sample needs nothing more: every method and press has its row."""
        return lambda key: not self.missing(labels, key)


def load(config, suite: bool) -> Done:
    """The rows already in `config.out` when resuming a run of the same options (none otherwise)."""
    from kvpot.eval.limits import read_jsonl

    path = config.out / "config.json"
    if not config.resume or not path.exists():
        return Done([], suite)
    check_same(json.loads(path.read_text(encoding="utf-8")).get("config", {}), config)
    return Done(read_jsonl(config.out / "results.jsonl", repair=True), suite)


def check_same(before: dict, config) -> None:
    """Refuse to resume a folder run with other options (its rows would be other samples or methods)."""
    now = json.loads(json.dumps(config.to_dict()))
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    for name in now:
        if name in EXECUTION_ONLY:
            continue
        then = before.get(name, defaults.get(name))  # an option added since that run had its default
        if then != now[name]:
            raise KvpotError(f"--resume: {config.out} was run with {name} = {json.dumps(then)}, not "
                             f"{json.dumps(now[name])}; give the same options to continue it, or another --out "
                             "(without --resume the folder is started over).")


def completion(done: Done, planned: int, labels, stopped: str | None, time_limit: float | None,
               resumed: int) -> dict:
    """What the run left out: rows planned (samples x methods and presses) against rows in the folder."""
    missing = {label: max(0, planned - done.count(label)) for label in labels}
    return {"samples_planned": planned, "rows_planned": planned * len(labels), "rows": sum(
        done.count(label) for label in labels), "rows_not_run": sum(missing.values()),
        "not_run_by_method": {k: v for k, v in missing.items() if v}, "stopped_by": stopped,
        "time_limit": time_limit, "rows_from_before": resumed}


def completion_lines(summary: dict) -> list[str]:
    """The line of summary.md saying how many rows a stopped run left out ([] when none)."""
    info = summary.get("completion") or {}
    if not info.get("rows_not_run"):
        return []
    why = {"time limit": f"stopped at the time limit ({info.get('time_limit') or 0:g} s)",
           "SIGTERM": "stopped by SIGTERM"}.get(info.get("stopped_by"), "incomplete")
    return [f"- **{why}: {info['rows_not_run']} of {info['rows_planned']} planned rows not run** "
            f"({', '.join(f'{k}: {v}' for k, v in info['not_run_by_method'].items())}); "
            "the same command with --resume continues it"]


def remove_stale(out: Path, presses) -> None:
    """A fresh run in an old folder: kvpress answers left there belong to the old run."""
    for press in {p.press for p in presses}:
        (out / f"kvpress-{press}-answers.jsonl").unlink(missing_ok=True)
