"""Recorded `kvpot eval` results read back for reports: every run folder's rows, one answer per sample.

A run folder holds `config.json` and `results.jsonl` (`kvpot eval`, or `kvpress_eval.py answer`); a
stopped run still counts for the rows it wrote. A method is named by its `--method` spec as written
(with ` [dtype]` when a dtype was asked for explicitly: a variant of its own, never pooled with
`auto`). When several runs answered the same sample (same spec, task, task options, length, depth,
template, chat flag, index and seed), the answer of the latest run counts, once: re-runs of one
prompt are not new samples, and code changed between runs (`duplicates()` says how many answers
differed). Rows written before prompt templates existed (no `template` field) are the `legacy`
protocol: one wording, filler cut mid-sentence; they are never pooled with templated rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpot.errors import KvpotError
from kvpot.eval import recorded

LEGACY, TEMPLATED = "legacy", "templated"


@dataclass
class Records:
    """The rows of some run folders, deduplicated; `runs` names each folder (relative to the root) and its date."""

    rows: list[dict]
    runs: dict[str, str] = field(default_factory=dict)  # folder -> date (ISO) or ""
    meta: dict[str, dict] = field(default_factory=dict)  # folder -> model, device, dtype, versions
    repeated: int = 0  # samples answered in more than one run
    changed: int = 0  # ... of which the answers' correctness differed
    outcomes: dict = field(default_factory=dict, repr=False)  # sample key -> correctness of every answer

    def repeats(self, rows: Sequence[dict]) -> tuple[int, int]:
        """(how many of `rows`' samples were answered by more than one run, how many of those changed outcome)."""
        seen = [self.outcomes.get(sample_key(r), []) for r in rows]
        return sum(1 for s in seen if len(s) > 1), sum(1 for s in seen if len(set(s)) > 1)

    def select(self, spec: str, task: str | None = None, length: int | None = None,
               depths: Sequence[float] | None = None, group: str | None = None, ratio: float | None = None,
               options: dict | None = None) -> list[dict]:
        """The rows of `spec` (a `--method` spec as written: a method at a compression ratio is its spec and
        `ratio`), optionally of one task, length, length group, depths and task options."""
        return [r for r in self.rows if r["spec"] == spec and (task is None or r["task"] == task)
                and (length is None or r["length"] == length)
                # a length group is RULER's; other tasks' rows are grouped by their length
                and (group is None or (r.get("group") or str(r["length"])) == group)
                and r.get("compression_ratio") == ratio
                and (options is None or all((r.get("task_options") or {}).get(k) == v for k, v in options.items()))
                and (depths is None or r["depth"] is None or any(abs(r["depth"] - d) < 1e-9 for d in depths))]


def read(root: Path, folders: Iterable[str] | None = None) -> Records:
    """Every run folder under `root` (or under each of `folders`, relative to it), deduplicated."""
    root = Path(root)
    bases = [root / f for f in folders] if folders else [root]
    missing = [str(b) for b in bases if not recorded.is_dir(b)]
    if missing:
        raise KvpotError(f"no recorded results at {missing[0]}.")
    rows, runs, meta = [], {}, {}
    for base in bases:
        for config_path in recorded.files(base, "config.json"):  # plain, .gz or packed (kvpot.eval.recorded)
            folder = config_path.parent
            if "merged" in folder.relative_to(root).parts or not recorded.exists(folder / "results.jsonl"):
                continue
            name = folder.relative_to(root).as_posix()
            config = recorded.read_json(config_path)
            runs[name] = config.get("date") or ""
            meta[name] = {k: config.get(k) for k in ("model", "device", "dtype", "versions")}
            rows += _rows(folder, config, name)
    records = _latest(rows, runs)
    records.meta = meta
    return records


def _rows(folder: Path, config: dict, name: str) -> list[dict]:
    cfg = config.get("config", {})
    dtype = f" [{cfg['dtype']}]" if cfg.get("dtype", "auto") not in ("auto", None) else ""
    specs = {label: m.get("spec", label) + dtype for label, m in config.get("methods", {}).items()}
    out = []
    for row in recorded.read_jsonl(folder / "results.jsonl"):
        row.update(spec=specs.get(row["method"], row["method"]), run=name,
                   protocol=TEMPLATED if "template" in row else LEGACY)
        out.append(row)
    return out


def sample_key(row: dict) -> tuple:
    options = json.dumps(row.get("task_options") or {}, sort_keys=True)
    return (row["spec"], row.get("compression_ratio"), row["task"], row.get("subtask"), options, row["length"],
            row.get("depth"), row.get("template", 0), bool(row.get("chat")), row.get("sample"), row.get("seed"),
            row["protocol"])


def _latest(rows: list[dict], runs: dict[str, str]) -> Records:
    chosen: dict[tuple, dict] = {}
    outcomes: dict[tuple, list] = {}
    for row in rows:
        key = sample_key(row)
        outcomes.setdefault(key, []).append(bool(row["correct"]))
        held = chosen.get(key)
        if held is None or (runs[row["run"]], row["run"]) > (runs[held["run"]], held["run"]):
            chosen[key] = row
    repeated = sum(1 for seen in outcomes.values() if len(seen) > 1)
    changed = sum(1 for seen in outcomes.values() if len(set(seen)) > 1)
    return Records(list(chosen.values()), runs, repeated=repeated, changed=changed, outcomes=outcomes)


def protocol_of(rows: Sequence[dict]) -> str:
    """`legacy` or `templated`; rows of both in one cell are an error (different samples, different prompts)."""
    kinds = {r["protocol"] for r in rows}
    if len(kinds) > 1:
        raise KvpotError("a cell mixes rows from before and after prompt templates; name folders of one protocol.")
    return kinds.pop() if kinds else LEGACY


def describe_protocol(rows: Sequence[dict]) -> str:
    """How the rows' prompts were made: wordings, chat flags, keys (for a table's caption)."""
    if protocol_of(rows) == LEGACY:
        return "one wording, plain text, filler cut at the exact length (before prompt templates)"
    templates = sorted({r.get("template", 0) for r in rows})
    chats = sorted({bool(r.get("chat")) for r in rows})
    chat = {(False,): "plain text", (True,): "inside the chat template",
            (False, True): "plain and inside the chat template"}[tuple(chats)]
    from kvpot.eval.stats import key_format_of

    formats = sorted({key_format_of(r) for r in rows} - {None})
    keys = f"; key formats {', '.join(formats)}" if len(formats) > 1 else ""  # one format: as before formats varied
    return f"templates {', '.join(map(str, templates))}{keys}; {chat}; filler cut at sentence ends"
