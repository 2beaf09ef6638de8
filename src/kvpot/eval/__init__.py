"""Evaluation (library): accuracy of methods on synthetic long-context tasks, and perplexity over long text.

Every method reads the SAME samples: for each (length, depth, sample index) the sample is built
once, from a seed derived from those three and the base seed, and every method answers it.
Results go to `config.out` as they finish (`results.jsonl`, one row per method and sample, so a
crash keeps the finished rows), then `summary.json`, `summary.md`, one heatmap per method
(`heatmap_*.png`) and `accuracy.png`. `config.json`, written first, records the resolved
configuration, the method configs, model and versions; every row repeats its method config.

The published benchmarks (`task="longbench"`, `"ruler"` or `"infinitebench"`, with `data_dir` and
`subtasks`) run through the same runner, one case per benchmark item (`suite`), and report a score
per method and task.

Perplexity reads one long text (the tasks' haystack, one length) with each method through
`Engine.score_ids` and reports mean NLL / perplexity overall and per window.

    from kvpot.eval import EvalConfig, run
    summary = run(EvalConfig(task="passkey", methods=["streaming", "infinipot"], budget=1024, out="runs/p"))

Modules: `config` (EvalConfig, length/depth parsing), `common` (model loading, prompt prefix,
environment), `runner` (task evaluation), `suite` (benchmark items as cases, their summaries), `perplexity`,
`report` (tables and figures), `demo`
(what `kvpot demo` runs). Heavy modules (torch, transformers, matplotlib) are imported inside
functions, so importing this package stays cheap.
"""

from __future__ import annotations

from kvpot.eval.config import PERPLEXITY, EvalConfig, parse_depths, parse_length, parse_lengths
from kvpot.eval.perplexity import run_perplexity
from kvpot.eval.runner import run_task_eval


def run(config: EvalConfig, progress: bool = True, show: bool = True) -> dict:
    """Run `config.task` (a task, or perplexity) and return its summary."""
    if config.task == PERPLEXITY:
        return run_perplexity(config, progress=progress, show=show)
    return run_task_eval(config, progress=progress, show=show)


__all__ = ["EvalConfig", "parse_depths", "parse_length", "parse_lengths", "run", "run_perplexity", "run_task_eval"]
