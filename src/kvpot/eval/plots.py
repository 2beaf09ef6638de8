"""`kvpot report --plots RUN`: a recorded run's figures, redrawn from what the run wrote (issue 44).

Figures are not committed with the records (records/): each is made again from the run's own results with
the code that drew it when the run happened. A run folder is recognized by what it holds:

- `results.json` of `kvpot bench` (prefill, decode, throughput, attention: `kvpot.bench.report`) or of
  `kvpot bench serve` (`kvpot.bench.serve_report`);
- `summary.json` of `kvpot eval`: a task (passkey, niah...; one heatmap per method and accuracy.png, with
  ratios.png for compression ratios), a benchmark suite (scores.png) or perplexity (perplexity.png).

RUN may also be a folder of runs: every run below it is drawn, each into its own folder, or into the same
relative folder under `out`.
"""

from __future__ import annotations

from pathlib import Path

from kvpot.errors import KvpotError
from kvpot.eval import recorded


def _read(path: Path) -> dict:
    try:
        data = recorded.read_json(path)  # plain, .gz or packed
    except OSError as error:
        raise KvpotError(f"{path} is not readable JSON ({error}).") from None
    if not isinstance(data, dict):
        raise KvpotError(f"{path} holds no object.")
    return data


def kind_of(folder: Path) -> str | None:
    """'bench', 'serve', 'task', 'suite', 'perplexity' or None (not a run folder kvpot can draw)."""
    from kvpot.bench.report import _PLOTS

    if recorded.exists(folder / "results.json"):
        mode = _read(folder / "results.json").get("mode")
        if mode == "serve":
            return "serve"
        if mode in _PLOTS:
            return "bench"
    if recorded.exists(folder / "summary.json"):
        summary = _read(folder / "summary.json")
        if "accuracy_by_depth" in summary:
            return "task"
        if "scores" in summary and "by_group" in summary:
            return "suite"
        methods = summary.get("methods") or {}
        if methods and all(isinstance(m, dict) and "windows" in m for m in methods.values()):
            return "perplexity"
    return None


def plot_run(folder: Path, out: Path | None = None) -> list[Path]:
    """Draw one run's figures into `out` (default: the run folder); the files written."""
    kind = kind_of(folder)
    if kind is None:
        raise KvpotError(f"{folder} holds no results.json of kvpot bench nor summary.json of kvpot eval to draw.")
    out = folder if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    if kind == "bench":
        from kvpot.bench.report import write_plots

        return write_plots(_read(folder / "results.json"), out)
    if kind == "serve":
        from kvpot.bench.serve_report import write_plots

        return write_plots(_read(folder / "results.json"), out)
    summary = _read(folder / "summary.json")
    if kind == "perplexity":
        from kvpot.eval.report import perplexity_png

        return [perplexity_png(out / "perplexity.png", summary)]
    if kind == "suite":
        from kvpot.eval.suite import write_suite_plots

        written = write_suite_plots(summary, out)
    else:
        from kvpot.eval.runner import write_task_plots

        written = write_task_plots(summary, out)
    if summary.get("config", {}).get("compression_ratios"):
        from kvpot.eval.ratio_report import ratio_png

        written.append(ratio_png(out / "ratios.png", summary))
    return written


def plot_runs(root: Path, out: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Draw `root` if it is a run, else every run below it; (files written, run folders drawn)."""
    if not recorded.is_dir(root):
        raise KvpotError(f"--plots {root} is not a folder.")
    if kind_of(root) is not None:
        return plot_run(root, out), [root]
    found = sorted({p.parent for name in ("results.json", "summary.json") for p in recorded.files(root, name)})
    runs = [r for r in found if kind_of(r) is not None]
    if not runs:
        raise KvpotError(f"{root} holds no run kvpot can draw (results.json of kvpot bench, summary.json of "
                         "kvpot eval).")
    written = []
    for run in runs:
        written += plot_run(run, None if out is None else out / run.relative_to(root))
    return written, runs
