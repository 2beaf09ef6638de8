"""Task evaluation: every method answers the same samples; results, summary, tables and figures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvpot.eval.common import default_max_new_tokens, environment, load_model, print_rich, special_prefix, write_json
from kvpot.eval.config import EvalConfig, sample_seed

if TYPE_CHECKING:
    from kvpot.methods.spec import MethodRun


def run_task_eval(config: EvalConfig, progress: bool = True, show: bool = True) -> dict:
    """Evaluate every method on the same samples; write results, summary, tables and figures."""
    from tqdm.auto import tqdm

    from kvpot.engine import Engine
    from kvpot.eval import report
    from kvpot.eval.prompting import resolve_chat
    from kvpot.eval.suite import suite_cases, suite_rich_table, summarize_suite, write_suite_reports
    from kvpot.methods.spec import MethodSpec, build_methods  # here: kvpot.methods loads torch
    from kvpot.reporting import slug
    from kvpot.tasks.suites import is_suite

    suite = is_suite(config.task)
    runs = build_methods([MethodSpec.parse(m) for m in config.methods], config.budget, config.settings)
    model, tokenizer, path, device = load_model(config.model, config.device, config.dtype, config.device_map,
                                                config.max_memory, config.gguf)
    engines = {run.label: Engine(model, tokenizer, method=run.method) for run in runs}
    prefix = special_prefix(tokenizer)
    header = {"model": path, **environment(device, model), "config": config.to_dict(),
              "methods": {run.label: run.describe() for run in runs}, "prompt_prefix_ids": prefix,
              "chat_flags": None if config.chat is None else resolve_chat(config.chat, tokenizer)}
    count, cases = (suite_cases(config, tokenizer, model, prefix) if suite  # data errors before any output
                    else task_cases(config, tokenizer, prefix))
    config.out.mkdir(exist_ok=True)
    write_json(config.out / "config.json", header)
    rows: list[dict] = []
    with open(config.out / "results.jsonl", "w", encoding="utf-8") as results, tqdm(
        total=count * len(runs), unit="run", desc=f"eval {config.task}", disable=not progress
    ) as bar:
        for group in _groups(cases, config.batch_size):
            answers = {run.label: _answer(engines[run.label], group, config.batch_size) for run in runs}
            for index, case in enumerate(group):
                for run in runs:
                    token_ids, stats = answers[run.label][index]
                    prediction = tokenizer.decode(token_ids, skip_special_tokens=True)
                    value = case.score(prediction)
                    row = {
                        "method": run.label, "method_name": run.spec.name, "method_config": run.method.config(),
                        **case.row, "answers": case.answers, "prediction": prediction,
                        "score": value, "correct": value == 1.0, "max_new_tokens": case.max_new_tokens,
                        "stats": stats.to_dict(),
                    }
                    results.write(json.dumps(row) + "\n")
                    results.flush()
                    rows.append(row)
                    bar.set_postfix_str(f"{run.label} @ {len(case.context_ids)} tokens")
                    bar.update()
    if suite:
        summary = {**header, **summarize_suite(rows, runs, config, _cost)}
        written = write_suite_reports(summary, config.out)
    else:
        summary = {**header, **summarize(rows, runs, config)}
        write_task_reports(summary, config.out)
        written = ["results.jsonl", "summary.json", "summary.md", "accuracy.png",
                   *(f"heatmap_{slug(run.label)}.png" for run in runs)]
    if show:
        print_rich(suite_rich_table(summary) if suite else report.eval_rich_table(summary))
        print(f"wrote {config.out}/: " + ", ".join(written))
    return summary


def _groups(cases, size: int):
    """The cases, `size` at a time (they are built lazily: a long context is made when its group runs)."""
    group = []
    for case in cases:
        group.append(case)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


def _answer(engine, group, batch_size: int) -> list[tuple[list[int], object]]:
    """(token ids, stats) of each case: one at a time, or decoded together (`--batch-size`)."""
    if batch_size == 1:
        return [(r.token_ids, r.stats) for r in (engine.generate_ids(case.context_ids, case.question_ids,
                                                                     max_new_tokens=case.max_new_tokens)
                                                 for case in group)]
    from kvpot.engine.offline import generate_many
    from kvpot.engine.requests import Request
    from kvpot.errors import KvpotError

    requests = [Request(case.context_ids, case.question_ids, max_new_tokens=case.max_new_tokens) for case in group]
    generate_many(engine, requests, batch_size)
    failed = [r for r in requests if r.status == "failed"]
    if failed:
        raise KvpotError(f"a sample failed in a batch: {failed[0].error}")
    return [(r.tokens, r.stats) for r in requests]


def task_cases(config: EvalConfig, tokenizer, prefix: list[int]):
    """(number of cases, the cases) of a synthetic task: every length x depth x template x chat x sample,
    built when run (`chat`: inside the model's chat template, kvpot.eval.prompting)."""
    from kvpot.eval.prompting import CHAT_SLACK_TOKENS, Wrapper, resolve_chat
    from kvpot.eval.suite import Case
    from kvpot.tasks import make_sample, score

    wrap = Wrapper(tokenizer, prefix)
    cells = [(n, d, t, c, i) for n in config.lengths for d in config.depths for t in config.templates
             for c in resolve_chat(config.chat or "both", tokenizer) for i in range(config.samples)]

    def cases():
        for length, depth, template, chat, index in cells:
            seed = sample_seed(config.seed, index, length, depth, template, chat)
            sample = make_sample(config.task, tokenizer, length, depth, seed, config.haystack, template,
                                 **config.task_options)
            row = {"task": config.task, "task_options": sample.options, "length": length, "depth": depth,
                   "template": template, "chat": chat, "sample": index, "seed": seed,
                   "needle_spans": sample.needle_spans}
            budget = config.max_new_tokens or (default_max_new_tokens(tokenizer, sample.answers)
                                               + (CHAT_SLACK_TOKENS if chat else 0))
            yield Case(*wrap(sample.context_ids, sample.question_ids, chat), sample.answers, budget, row,
                       lambda prediction, sample=sample: score(sample, prediction))

    return len(cells), cases()


def summarize(rows: Sequence[dict], runs: Sequence[MethodRun], config: EvalConfig) -> dict:
    """Accuracy per method x length and x length x depth (means, and with intervals), cost per method and x length.

    `accuracy`, `accuracy_by_depth` and `overall` keep plain means (older readers); `intervals`,
    `intervals_by_depth` and `intervals_overall` hold correct/total, the 95% Wilson interval and the
    spread over templates of the same cells (kvpot.eval.stats.accuracy_stats).
    """
    from kvpot.eval.stats import accuracy_stats
    from kvpot.reporting import depth_key

    accuracy, by_depth, overall, cost = {}, {}, {}, {}
    intervals, intervals_by_depth, intervals_overall = {}, {}, {}
    for run in runs:
        mine = [r for r in rows if r["method"] == run.label]
        at = {n: [r for r in mine if r["length"] == n] for n in config.lengths}
        cell = {(n, d): [r for r in at[n] if r["depth"] == d] for n in config.lengths for d in config.depths}
        accuracy[run.label] = {str(n): _mean(r["score"] for r in at[n]) for n in config.lengths}
        by_depth[run.label] = {str(n): {depth_key(d): _mean(r["score"] for r in cell[n, d]) for d in config.depths}
                               for n in config.lengths}
        overall[run.label] = _mean(r["score"] for r in mine)
        intervals[run.label] = {str(n): accuracy_stats(at[n]) for n in config.lengths}
        intervals_by_depth[run.label] = {str(n): {depth_key(d): accuracy_stats(cell[n, d]) for d in config.depths}
                                         for n in config.lengths}
        intervals_overall[run.label] = accuracy_stats(mine)
        cost[run.label] = {**_cost(mine), "by_length": {str(n): _cost(at[n]) for n in config.lengths}}
    return {"runs": len(rows), "accuracy": accuracy, "accuracy_by_depth": by_depth, "overall": overall,
            "intervals": intervals, "intervals_by_depth": intervals_by_depth, "intervals_overall": intervals_overall,
            "cost": cost}


def _cost(rows: Sequence[dict]) -> dict:
    stats = [r["stats"] for r in rows]
    memory = [s["peak_memory_bytes"] for s in stats if s.get("peak_memory_bytes") is not None]
    return {
        "max_kv_entries": _mean(s["max_kv_entries"] for s in stats),
        "peak_kv_entries": max((s["max_kv_entries"] for s in stats), default=None),
        "prefill_seconds": _mean(s["prefill_seconds"] for s in stats),
        "decode_seconds": _mean(s["decode_seconds"] for s in stats),
        "peak_memory_bytes": max(memory, default=None),
    }


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def write_task_reports(summary: dict, out: Path) -> None:
    """summary.json, summary.md, one heatmap per method, accuracy.png."""
    from kvpot.eval import report
    from kvpot.reporting import depth_key, method_params, slug

    write_json(out / "summary.json", summary)
    (out / "summary.md").write_text(report.eval_markdown(summary), encoding="utf-8")
    lengths, depths = summary["config"]["lengths"], summary["config"]["depths"]
    for label, method in summary["methods"].items():
        grid = [[summary["accuracy_by_depth"][label][str(n)][depth_key(d)] for n in lengths] for d in depths]
        title = (f"{summary['config']['task']} - {label}\n{method_params(method['config'])}\n"
                 f"{summary['config']['samples']} samples x {len(summary['config'].get('templates') or [0])} "
                 "templates per cell")
        report.heatmap_png(out / f"heatmap_{slug(label)}.png", grid, lengths, depths, title)
    report.accuracy_png(out / "accuracy.png", summary)
