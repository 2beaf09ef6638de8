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
    """Evaluate every method (and kvpress press) on the same samples; write results, summary, tables and figures.

    With `config.time_limit`, no sample starts that would not finish before the limit (kvpot.eval.limits);
    a SIGTERM ends the answering the same way; either way the rows written so far (and the kvpress
    answers given) are reported. With `config.resume`, samples already in the folder are skipped."""
    from kvpot.eval import limits

    deadline, stop = limits.Deadline(config.time_limit, limits.FINISH_SECONDS), limits.Terminate()
    with stop.installed():
        return _run_task_eval(config, progress, show, deadline, stop)


def _run_task_eval(config: EvalConfig, progress: bool, show: bool, deadline, stop) -> dict:
    from tqdm.auto import tqdm

    from kvpot.eval import resume
    from kvpot.eval.limits import Interrupted
    from kvpot.eval.prompting import resolve_chat
    from kvpot.eval.suite import suite_cases
    from kvpot.tasks.suites import is_suite

    suite = is_suite(config.task)
    runs = make_runs(config)  # here: kvpot.methods loads torch; a bad spec fails before the model loads
    done = resume.load(config, suite)  # a folder run with other options fails here, before the model loads
    model, tokenizer, path, device = load_model(config.model, config.device, config.dtype, config.device_map,
                                                config.max_memory, config.gguf)
    prefix = special_prefix(tokenizer)
    presses = _press_runs(config)
    header = {"model": path, **environment(device, model), "config": config.to_dict(),
              "methods": {run.label: _describe(run, config) for run in [*runs, *presses]},
              "prompt_prefix_ids": prefix,
              "chat_flags": None if config.chat is None else resolve_chat(config.chat, tokenizer)}
    labels, press_labels = [run.label for run in [*runs, *presses]], [p.label for p in presses]
    skip = done.skip(labels)
    count, cases = (suite_cases(config, tokenizer, model, prefix, skip) if suite  # data errors before any output
                    else task_cases(config, tokenizer, prefix, skip))
    config.out.mkdir(exist_ok=True)
    previous = _previous_kvpress(config) if done.rows else {}
    write_json(config.out / "config.json", header)
    if not config.resume:
        resume.remove_stale(config.out, presses)
    case_file = _case_file(config, tokenizer) if presses else None
    rows, resumed, stopped = list(done.rows), len(done.rows), None
    answer = _Answerer(model, tokenizer, config.batch_size, config.mix, config.batch_invariant)
    with open(config.out / "results.jsonl", "a" if done.rows else "w", encoding="utf-8") as results:
        left = count * len(runs) - sum(done.count(run.label) for run in runs)
        try:
            with tqdm(total=left, unit="run", desc=f"eval {config.task}", disable=not progress) as bar:
                for group in _groups(cases, config.batch_size, deadline.allows):
                    with deadline.step():  # a step: answering a group and writing its rows
                        answers = _answer_missing(answer, runs, group, done)
                        with stop.held():  # a SIGTERM waits for the rows: a cut line would spoil the file
                            for row in _write_group(group, runs, answers, tokenizer, results, done, case_file,
                                                    press_labels):
                                rows.append(row)
                                bar.set_postfix_str(f"{row['method']} @ {row['stats']['context_tokens']} tokens")
                                bar.update()
        except Interrupted:
            stopped = "SIGTERM"
        stopped = stopped or ("time limit" if deadline.reached else None)
        if presses:
            from kvpot.eval.kvpress import run_presses
            from kvpot.models import resolve_model, resolve_source

            source = resolve_source(resolve_model(config.model, config.gguf), config.gguf)
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            press_rows, info, stopped = run_presses(presses, case_file, tokenizer, config, source,
                                                    str(next(model.parameters()).device), dtype, results, show,
                                                    done, deadline, stop, stopped)
            header["kvpress"] = {p: {**previous.get(p, {}), **i} if "not_started" in i else i for p, i in info.items()}
            rows += press_rows
            answered = {r["method"] for r in rows}
            runs += [p for p in presses if p.label in answered]  # a press that could not run has no column
            header["methods"] = {k: v for k, v in header["methods"].items() if k in {r.label for r in runs}}
    header["completion"] = resume.completion(done, count, labels, stopped, config.time_limit, resumed)
    write_json(config.out / "config.json", header)
    if show and stopped:
        print(f"stopped ({stopped}): {header['completion']['rows_not_run']} of "
              f"{header['completion']['rows_planned']} rows not run; --resume continues", flush=True)
    return _report(config, header, rows, runs, suite, show)


def _write_group(group, runs, answers: dict, tokenizer, results, done, case_file, press_labels):
    """Each case's rows (in the order of `runs`), written to `results` and yielded; a case some press has no
    row for goes to the kvpress cases file."""
    for index, case in enumerate(group):
        if case_file is not None and done.missing(press_labels, case.key):
            case_file.add(case)
        for run in runs:
            if (run.label, index) in answers:
                row = _row(run, case, *answers[run.label, index], tokenizer)
                results.write(json.dumps(row) + "\n")
                results.flush()
                done.add(row)
                yield row


def _answer_missing(answer, runs, group, done) -> dict:
    """(run label, index in group) -> (token ids, stats, method), for each run's cases without a row."""
    out = {}
    for run in runs:
        todo = [i for i, case in enumerate(group) if not done.has(run.label, case.key)]
        for index, result in zip(todo, answer(run, [group[i] for i in todo])):
            out[run.label, index] = result
    return out


def _previous_kvpress(config: EvalConfig) -> dict:
    """What the kvpress processes of the run being resumed reported (kept for presses with nothing left)."""
    path = config.out / "summary.json"
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("kvpress") or {}
    except (OSError, ValueError):
        return {}


def _report(config: EvalConfig, header: dict, rows: list[dict], runs, suite: bool, show: bool) -> dict:
    from kvpot.eval import report
    from kvpot.eval.suite import suite_rich_table, summarize_suite, write_suite_reports
    from kvpot.reporting import slug

    if suite:
        summary = {**header, **summarize_suite(rows, runs, config, _cost)}
        written = write_suite_reports(summary, config.out)
    else:
        summary = {**header, **summarize(rows, runs, config)}
        write_task_reports(summary, config.out)
        written = ["results.jsonl", "summary.json", "summary.md", "accuracy.png",
                   *(f"heatmap_{slug(run.label)}.png" for run in runs)]
        written += ["key_formats.png"] if len(config.key_formats or []) > 1 else []
    if config.compression_ratios:
        from kvpot.eval.ratio_report import ratio_png

        ratio_png(config.out / "ratios.png", summary)
        written.append("ratios.png")
    if show:
        print_rich(suite_rich_table(summary) if suite else report.eval_rich_table(summary))
        print(f"wrote {config.out}/: " + ", ".join(written))
    return summary


def make_runs(config: EvalConfig) -> list:
    """kvpot's methods as evaluated: once each, or once per compression ratio (kvpot.eval.ratios)."""
    from kvpot.eval.ratios import ratio_runs
    from kvpot.methods.spec import MethodSpec, build_methods

    specs = [MethodSpec.parse(m) for m in config.methods]
    if not specs and config.baselines:
        return []  # the presses are the columns
    if config.compression_ratios:
        return ratio_runs(specs, config.compression_ratios, config.settings, config.budget, min(config.lengths))
    return build_methods(specs, config.budget, config.settings)


def _press_runs(config: EvalConfig) -> list:
    from kvpot.eval.kvpress import press_runs

    return press_runs(config.presses, config.compression_ratios) if "kvpress" in config.baselines else []


def _describe(run, config: EvalConfig) -> dict:
    from kvpot.eval.ratios import RatioRun

    return run.describe(min(config.lengths)) if isinstance(run, RatioRun) else run.describe()


def _case_file(config: EvalConfig, tokenizer):
    from kvpot.eval.kvpress import CASES_FILE, CaseFile

    eos = getattr(tokenizer, "eos_token_id", None)
    return CaseFile(config.out / CASES_FILE, [] if eos is None else [eos])


def _row(run, case, token_ids, stats, method, tokenizer) -> dict:
    """One results.jsonl row: the method as it ran (its config at this case's budget), the case, the answer."""
    prediction = tokenizer.decode(token_ids, skip_special_tokens=True)
    value = case.score(prediction)
    row = {"method": run.label, "method_name": run.spec.name, "method_config": method.config(), **case.row}
    if getattr(run, "ratio", None) is not None:
        row["compression_ratio"] = run.ratio
    row.update(answers=case.answers, prediction=prediction, score=value, correct=value == 1.0,
               max_new_tokens=case.max_new_tokens, stats=stats.to_dict())
    return row


class _Answerer:
    """(token ids, stats, method) of each case of a group for one run; engines made once per method built."""

    def __init__(self, model, tokenizer, batch_size: int, mix: str = "auto", batch_invariant: bool = False):
        self.model, self.tokenizer, self.batch_size, self.mix = model, tokenizer, batch_size, mix
        self.batch_invariant = batch_invariant
        self.engines: dict[int, object] = {}

    def engine(self, method):
        from kvpot.engine import Engine

        if id(method) not in self.engines:
            self.engines[id(method)] = Engine(self.model, self.tokenizer, method=method,
                                              batch_invariant=self.batch_invariant)
        return self.engines[id(method)]

    def __call__(self, run, group) -> list[tuple]:
        from kvpot.eval.ratios import RatioRun

        methods = [run.method_for(len(c.context_ids)) if isinstance(run, RatioRun) else run.method for c in group]
        out: list = [None] * len(group)
        for method in {id(m): m for m in methods}.values():  # cases of one budget decode together
            where = [i for i, m in enumerate(methods) if m is method]
            answered = _answer(self.engine(method), [group[i] for i in where], self.batch_size, self.mix)
            for i, (token_ids, stats) in zip(where, answered):
                out[i] = (token_ids, stats, method)
        return out


def _groups(cases, size: int, allows=lambda: True):
    """The cases, `size` at a time (they are built lazily: a long context is made when its group runs), while
    `allows()` (the time limit) lets another group start."""
    cases = iter(cases)
    while allows():
        group = [case for _, case in zip(range(size), cases)]
        if not group:
            return
        yield group


def _answer(engine, group, batch_size: int, mix: str = "auto") -> list[tuple[list[int], object]]:
    """(token ids, stats) of each case: one at a time, or decoded together (`--batch-size`)."""
    if batch_size == 1:
        return [(r.token_ids, r.stats) for r in (engine.generate_ids(case.context_ids, case.question_ids,
                                                                     max_new_tokens=case.max_new_tokens)
                                                 for case in group)]
    from kvpot.engine.offline import generate_many
    from kvpot.engine.requests import Request
    from kvpot.errors import KvpotError

    requests = [Request(case.context_ids, case.question_ids, max_new_tokens=case.max_new_tokens) for case in group]
    generate_many(engine, requests, batch_size, mix=mix)
    failed = [r for r in requests if r.status == "failed"]
    if failed:
        raise KvpotError(f"a sample failed in a batch: {failed[0].error}")
    return [(r.tokens, r.stats) for r in requests]


def task_cases(config: EvalConfig, tokenizer, prefix: list[int], skip=None):
    """(number of cases, the cases) of a synthetic task: every length x depth x template x chat x key format x sample,
    built when run (`chat`: inside the model's chat template, kvpot.eval.prompting); `skip(key)` true
    (`--resume`: every method has its row) leaves a case out unbuilt; the count is of them all."""
    from kvpot.eval.resume import case_key

    from kvpot.eval.prompting import CHAT_SLACK_TOKENS, Wrapper, resolve_chat
    from kvpot.eval.suite import Case
    from kvpot.tasks import make_sample, score
    from kvpot.eval.stats import answer_format
    from kvpot.tasks.keys import FORMAT_OPTION

    wrap = Wrapper(tokenizer, prefix)
    own = answer_format(config.task, config.task_options)
    cells = [(n, d, t, c, f, i) for n in config.lengths for d in config.depths for t in config.templates
             for c in resolve_chat(config.chat or "both", tokenizer) for f in config.key_formats or [None]
             for i in range(config.samples)]

    def cases():
        for length, depth, template, chat, fmt, index in cells:
            # the task's own format keeps its seeds: its samples are those of a run without --key-formats
            seed = sample_seed(config.seed, index, length, depth, template, chat, None if fmt == own else fmt)
            fields = {"length": length, "depth": depth, "template": template, "chat": chat, "sample": index,
                      "seed": seed, **({} if fmt is None else {"key_format": fmt})}
            key = case_key(fields, suite=False)
            if skip is not None and skip(key):
                continue
            options = config.task_options if fmt is None else {**config.task_options, FORMAT_OPTION[config.task]: fmt}
            sample = make_sample(config.task, tokenizer, length, depth, seed, config.haystack, template, **options)
            row = {"task": config.task, "task_options": sample.options, "length": length, "depth": depth,
                   "template": template, "chat": chat, **({} if fmt is None else {"key_format": fmt}),
                   "sample": index, "seed": seed, "needle_spans": sample.needle_spans}
            budget = config.max_new_tokens or (default_max_new_tokens(tokenizer, sample.answers)
                                               + (CHAT_SLACK_TOKENS if chat else 0))
            yield Case(*wrap(sample.context_ids, sample.question_ids, chat), sample.answers, budget, row,
                       lambda prediction, answers=sample.answers: score(config.task, prediction, answers), key)

    return len(cells), cases()


def summarize(rows: Sequence[dict], runs: Sequence[MethodRun], config: EvalConfig) -> dict:
    """Accuracy per method x length and x length x depth (means, and with intervals), cost per method and x length.

    `accuracy`, `accuracy_by_depth` and `overall` keep plain means (older readers); `intervals`,
    `intervals_by_depth` and `intervals_overall` hold correct/total, the 95% Wilson interval and the
    spread over templates (and key formats) of the same cells (kvpot.eval.stats.accuracy_stats);
    with `--key-formats`, `intervals_by_key_format` holds each method's rows per format, all cells pooled.
    """
    from kvpot.eval.stats import accuracy_stats
    from kvpot.reporting import depth_key

    accuracy, by_depth, overall, cost = {}, {}, {}, {}
    intervals, intervals_by_depth, intervals_overall, by_format = {}, {}, {}, {}
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
        by_format[run.label] = {f: accuracy_stats([r for r in mine if r.get("key_format") == f])
                                for f in config.key_formats or []}
        cost[run.label] = {**_cost(mine), "by_length": {str(n): _cost(at[n]) for n in config.lengths}}
    return {"runs": len(rows), "accuracy": accuracy, "accuracy_by_depth": by_depth, "overall": overall,
            "intervals": intervals, "intervals_by_depth": intervals_by_depth, "intervals_overall": intervals_overall,
            **({"intervals_by_key_format": by_format} if config.key_formats else {}), "cost": cost}


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

    write_json(out / "summary.json", summary)
    text = report.eval_markdown(summary)
    if summary["config"].get("compression_ratios"):
        from kvpot.eval.ratio_report import ratio_markdown

        head, sep, rest = text.partition("\n## ")  # the ratio table right after the main one
        first, sep2, others = rest.partition("\n## ")
        text = head + sep + first + "\n".join(ratio_markdown(summary)) + "\n" + sep2 + others
    (out / "summary.md").write_text(text, encoding="utf-8")
    write_task_plots(summary, out)


def write_task_plots(summary: dict, out: Path) -> list[Path]:
    """One heatmap per method, accuracy.png (key_formats.png with several formats), from summary.json alone."""
    from kvpot.eval import report
    from kvpot.reporting import depth_key, method_params, slug

    written = []
    lengths, depths = summary["config"]["lengths"], summary["config"]["depths"]
    for label, method in summary["methods"].items():
        grid = [[summary["accuracy_by_depth"][label][str(n)][depth_key(d)] for n in lengths] for d in depths]
        formats = summary["config"].get("key_formats") or []
        title = (f"{summary['config']['task']} - {label}\n{method_params(method['config'])}\n"
                 f"{summary['config']['samples']} samples x {len(summary['config'].get('templates') or [0])} "
                 f"templates{f' x {len(formats)} key formats' if formats else ''} per cell")
        written.append(report.heatmap_png(out / f"heatmap_{slug(label)}.png", grid, lengths, depths, title))
    written.append(report.accuracy_png(out / "accuracy.png", summary))
    if len(summary["config"].get("key_formats") or []) > 1:
        written.append(report.key_formats_png(out / "key_formats.png", summary))
    return written
