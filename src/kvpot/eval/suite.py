"""`kvpot eval longbench|ruler|infinitebench`: benchmark items as cases of the eval runner, and their reports.

:func:`kvpot.eval.runner.run_task_eval` runs every method on every case; this module supplies the cases
of a benchmark suite (:mod:`kvpot.tasks.suites`), summarises the rows (a score per method and
task, the benchmarks' own averages) and writes ``summary.json``, ``summary.md`` and
``scores.png`` (plus ``accuracy.png`` against length for RULER).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path



@dataclass
class Case:
    """One prompt every method answers: ids (BOS included), references, budget, row fields, scorer."""

    context_ids: list[int]
    question_ids: list[int]
    answers: list[str]
    max_new_tokens: int
    row: dict = field(default_factory=dict)  # task-specific fields of its results.jsonl rows
    score: Callable[[str], float] = lambda prediction: 0.0
    key: str = ""  # the sample it is (kvpot.eval.resume.case_key): what --resume and kvpress' files match on


def suite_cases(config, tokenizer, model, prefix: list[int], skip=None) -> tuple[int, Iterator]:
    """(number of cases, the cases) of the suite ``config.task``; loading errors surface here. ``skip(key)``
    true (``--resume``: every method has its row) leaves an item out unencoded; the count is of them all.

    RULER's items come in every template and chat flag asked for (``config.templates``, ``config.chat``);
    a chat item's ids are wrapped in the model's chat template (kvpot.eval.prompting)."""
    from kvpot.engine import Engine
    from kvpot.eval.prompting import Wrapper, resolve_chat
    from kvpot.eval.resume import case_key
    from kvpot.tasks.suites import load_items, score_item

    variants = {}
    if config.task == "ruler":
        variants = {"templates": config.templates, "chats": resolve_chat(config.chat or "both", tokenizer)}
    items = load_items(config.task, data_dir=config.data_dir, tasks=config.subtasks, samples=config.samples,
                       tokenizer=tokenizer, lengths=config.lengths, seed=config.seed, **variants)
    # Encoding only: the method is irrelevant. As LongBench does, some tasks skip the chat template.
    encoders = {True: Engine(model, tokenizer, chat_template="auto"), False: Engine(model, tokenizer, chat_template=False)}
    wrap = Wrapper(tokenizer, prefix)

    def cases():
        for item in items:
            key = case_key({"subtask": item.task, "id": item.id, "group": item.group, "sample": item.index,
                            "template": item.extra.get("template"), "chat": item.extra.get("chat")}, suite=True)
            if skip is not None and skip(key):
                continue
            if item.make_ids is not None:
                context_ids, question_ids = wrap(*item.make_ids(), item.chat)
            else:
                context_ids, question_ids = encoders[item.chat].encode(item.context, item.question)
            tokens = len(context_ids) + len(question_ids)
            row = {"task": config.task, "subtask": item.task, "id": item.id, "group": item.group,
                   "length": tokens, "depth": None, "sample": item.index, "extra": _jsonable(item.extra)}
            if "template" in item.extra:
                row.update(template=item.extra["template"], chat=item.extra["chat"])
            yield Case(context_ids, list(question_ids), item.answers, config.max_new_tokens or item.max_new_tokens, row,
                       lambda prediction, item=item: score_item(item, prediction), key)

    return len(items), cases()


def _jsonable(extra: dict) -> dict:
    return {k: v for k, v in extra.items() if isinstance(v, (str, int, float, list, type(None)))}


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def summarize_suite(rows: Sequence[dict], runs: Sequence, config, _cost: Callable[[list], dict]) -> dict:
    """Scores per method x task (and x group); overall = the mean over tasks, as the benchmarks average.

    ``_cost`` summarises the cost of a list of rows (the task runner's, so both report alike).
    """
    tasks = list(dict.fromkeys(r["subtask"] for r in rows))
    groups = list(dict.fromkeys(r["group"] for r in rows))
    if config.task == "ruler":
        groups = [str(n) for n in config.lengths if str(n) in groups]
    from kvpot.eval.stats import accuracy_stats

    scores, by_group, by_task_group, overall, cost = {}, {}, {}, {}, {}
    intervals, intervals_by_group = {}, {}
    for run in runs:
        mine = [r for r in rows if r["method"] == run.label]
        intervals[run.label] = {t: accuracy_stats([r for r in mine if r["subtask"] == t]) for t in tasks}
        intervals_by_group[run.label] = {g: accuracy_stats([r for r in mine if r["group"] == g]) for g in groups}
        scores[run.label] = {t: _mean(r["score"] for r in mine if r["subtask"] == t) for t in tasks}
        by_task_group[run.label] = {
            t: {g: _mean(r["score"] for r in mine if r["subtask"] == t and r["group"] == g) for g in groups}
            for t in tasks
        }
        by_group[run.label] = {g: _mean(v for v in (by_task_group[run.label][t][g] for t in tasks) if v is not None)
                               for g in groups}
        overall[run.label] = _mean(v for v in scores[run.label].values() if v is not None)
        cost[run.label] = {**_cost(mine), "by_task": {t: _cost([r for r in mine if r["subtask"] == t]) for t in tasks}}
    first = runs[0].label if runs else None
    counts = {t: {g: sum(1 for r in rows if r["subtask"] == t and r["group"] == g and r["method"] == first)
                  for g in groups} for t in tasks}
    return {"runs": len(rows), "tasks": tasks, "groups": groups, "counts": counts, "scores": scores,
            "scores_by_group": by_task_group, "by_group": by_group, "overall": overall, "cost": cost,
            "intervals": intervals, "intervals_by_group": intervals_by_group}


# ---------------------------------------------------------------------------- reports


def _fmt(value: float | None, scale: float = 100.0) -> str:
    return "-" if value is None else f"{scale * value:.1f}"


def _score_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    from kvpot.reporting import format_number

    headers = ["method", *summary["tasks"], "mean", "peak KV entries", "prefill s", "decode s"]
    rows = []
    for label in summary["methods"]:
        cost = summary["cost"][label]
        rows.append([label, *(_fmt(summary["scores"][label][t]) for t in summary["tasks"]),
                     _fmt(summary["overall"][label]), format_number(cost["peak_kv_entries"]),
                     format_number(cost["prefill_seconds"]), format_number(cost["decode_seconds"])])
    return headers, rows


def _interval_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    from kvpot.eval.report import format_accuracy

    groups = summary["groups"]
    rows = [[label, *(format_accuracy(summary["intervals_by_group"][label][g]["accuracy"],
                                      summary["intervals_by_group"][label][g]) for g in groups)]
            for label in summary["methods"]]
    return ["method", *groups], rows


def _group_rows(summary: dict, label: str) -> tuple[list[str], list[list[str]]]:
    groups = summary["groups"]
    grid = summary["scores_by_group"][label]
    rows = [[t, *(_fmt(grid[t][g]) for g in groups)] for t in summary["tasks"]]
    rows.append(["mean", *(_fmt(summary["by_group"][label][g]) for g in groups)])
    return ["task", *groups], rows


def suite_markdown(summary: dict) -> str:
    from kvpot.eval.resume import completion_lines
    from kvpot.reporting import markdown_table, method_params

    config = summary["config"]
    counts = ", ".join(f"{t}: {sum(c.values())}" for t, c in summary["counts"].items())
    parts = [
        f"# kvpot eval: {config['task']}",
        "",
        f"- model: `{summary['model']}` ({summary['dtype']}, {summary['device']})",
        f"- items per task: {counts}" + (f"; data: `{config['data_dir']}`" if config.get("data_dir") else ""),
        f"- kvpot {summary['versions']['kvpot']}, torch {summary['versions']['torch']}, "
        f"transformers {summary['versions']['transformers']}; {summary['date']}",
        *completion_lines(summary),
        "",
        "## Score by method and task",
        "",
        "Scores x 100 with each benchmark's metric; mean = the mean over tasks. "
        "KV entries are per layer and KV head; seconds per item.",
        "",
        markdown_table(*_score_rows(summary)),
    ]
    if summary.get("intervals_by_group"):
        what = "context length" if config["task"] == "ruler" else "length range"
        parts += ["", f"## Whole answers by method and {what}", "",
                  "Items answered entirely right (score 1) out of all, every task pooled, with the 95% Wilson "
                  "interval, the range of per-template accuracy and, where both ran, plain vs chat-templated "
                  "accuracy (mean scores); claim a ranking only where intervals separate.", "",
                  markdown_table(*_interval_rows(summary))]
    if config.get("compression_ratios"):
        from kvpot.eval.ratio_report import ratio_markdown

        parts += ratio_markdown(summary)
    if len(summary["groups"]) > 1:
        for label, method in summary["methods"].items():
            what = "context length" if config["task"] == "ruler" else "length range"
            parts += ["", f"## {label} by {what}", "", f"`{method_params(method['config']) or 'no parameters'}`",
                      "", markdown_table(*_group_rows(summary, label))]
    return "\n".join(parts) + "\n"


def suite_rich_table(summary: dict):
    from kvpot.reporting import rich_table

    return rich_table(f"kvpot eval {summary['config']['task']}: score x 100 by task", *_score_rows(summary))


def scores_png(path: Path, summary: dict) -> Path:
    """Grouped bars: one group per task (and the mean), one bar per method."""
    from kvpot.reporting import new_figure

    tasks = [*summary["tasks"], "mean"]
    labels = list(summary["methods"])
    width = 0.8 / max(1, len(labels))
    figure = new_figure(max(6.0, 0.7 * len(tasks) * max(1, len(labels)) ** 0.5 + 2), 4.0)
    axes = figure.add_subplot()
    for index, label in enumerate(labels):
        values = [summary["scores"][label][t] for t in summary["tasks"]] + [summary["overall"][label]]
        xs = [i + (index - (len(labels) - 1) / 2) * width for i in range(len(tasks))]
        axes.bar(xs, [math.nan if v is None else 100 * v for v in values], width, label=label)
    axes.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right", fontsize=8)
    axes.set_ylim(0, 100)
    axes.set_ylabel("score x 100")
    axes.set_title(f"kvpot eval {summary['config']['task']}: score by task", fontsize=10)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return path


def write_suite_reports(summary: dict, out: Path) -> list[str]:
    """summary.json, summary.md, scores.png (and accuracy.png against length for RULER); the names written."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(suite_markdown(summary), encoding="utf-8")
    return ["results.jsonl", "summary.json", "summary.md", *(p.name for p in write_suite_plots(summary, out))]


def write_suite_plots(summary: dict, out: Path) -> list[Path]:
    """scores.png (and accuracy.png against length for RULER) from summary.json alone."""
    from kvpot.eval.report import accuracy_png

    written = [scores_png(out / "scores.png", summary)]
    if summary["config"]["task"] == "ruler":
        lengths = [int(g) for g in summary["groups"]]
        curve = {"config": {**summary["config"], "lengths": lengths}, "methods": summary["methods"],
                 "accuracy": summary["by_group"]}
        written.append(accuracy_png(out / "accuracy.png", curve))
    return written
