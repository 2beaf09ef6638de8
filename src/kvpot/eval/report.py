"""Tables and figures of `kvpot eval` results: markdown, rich, heatmaps and line plots.

Everything here works on the plain dicts the runners write to `summary.json`, so a figure can be
redrawn from a finished run without re-running a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from kvpot.reporting import (
    LINE_STYLES,
    depth_key,
    new_figure,
    format_depth,
    format_length,
    format_number,
    length_axis,
    markdown_table,
    method_params,
    rich_table,
)


def format_accuracy(mean: float | None, stats: dict | None, terminal: bool = False) -> str:
    """A cell: `0.60 (6/10, 95% 0.31-0.83; templates 0.40-0.80; key formats 0.20-0.90; plain 0.80, chat 0.40)`,
    or the bare mean for an older summary (the key-format and chat parts only where several ran).

    The interval is part of the cell, not a footnote, so no one reads 0.60 against 0.50 as a ranking
    when both intervals overlap (issue 32). `terminal`: one part per line (`[low, high]` for the
    interval, "tpl" for the template range, "fmt" for the key formats'), so a table of several lengths still
    fits 120 columns.
    """
    if not stats or stats.get("wilson95") is None:
        return format_number(mean)
    low, high = stats["wilson95"]
    spread = stats.get("template_spread")
    interval = f"[{low:.2f}, {high:.2f}]" if terminal else f"95% {low:.2f}-{high:.2f}"
    parts = [format_number(mean), f"{stats['correct']}/{stats['total']}", interval]
    if spread:
        parts.append(f"{'tpl' if terminal else 'templates'} {spread[0]:.2f}-{spread[1]:.2f}")
    formats = stats.get("key_format_spread")
    if formats:
        parts.append(f"{'fmt' if terminal else 'key formats'} {formats[0]:.2f}-{formats[1]:.2f}")
    if stats.get("chat_spread"):
        parts.append(", ".join(f"{k} {v:.2f}" for k, v in stats["by_chat"].items()))
    if terminal:
        return "\n".join(parts)
    return f"{parts[0]} ({parts[1]}, {'; '.join(parts[2:])})"


def _accuracy_rows(summary: dict, terminal: bool = False) -> tuple[list[str], list[list[str]]]:
    """Method x length accuracy (with intervals), the mean, and cost columns: the one comparison table."""
    lengths = summary["config"]["lengths"]
    headers = ["method"] + [format_length(n) for n in lengths]
    headers += ["mean", "peak KV entries", "mean KV entries", "prefill s", "decode s"]
    rows = []
    for label, method in summary["methods"].items():
        acc = summary["accuracy"][label]
        stats = summary.get("intervals", {}).get(label, {})
        cost = summary["cost"][label]
        rows.append(
            [label]
            + [format_accuracy(acc[str(n)], stats.get(str(n)), terminal) for n in lengths]
            + [
                format_accuracy(summary["overall"][label], summary.get("intervals_overall", {}).get(label), terminal),
                format_number(cost["peak_kv_entries"]),
                format_number(cost["max_kv_entries"], 0),
                format_number(cost["prefill_seconds"]),
                format_number(cost["decode_seconds"]),
            ]
        )
    return headers, rows


def _depth_rows(summary: dict, label: str) -> tuple[list[str], list[list[str]]]:
    """Depth x length accuracy of one method (the heatmap as numbers)."""
    lengths, depths = summary["config"]["lengths"], summary["config"]["depths"]
    grid = summary["accuracy_by_depth"][label]
    stats = summary.get("intervals_by_depth", {}).get(label, {})
    headers = ["depth"] + [format_length(n) for n in lengths]
    rows = [
        [format_depth(d)] + [format_accuracy(grid[str(n)][depth_key(d)], stats.get(str(n), {}).get(depth_key(d)))
                             for n in lengths]
        for d in depths
    ]
    return headers, rows


def eval_markdown(summary: dict) -> str:
    """`summary.md`: what ran, the comparison table, then each method's depth x length grid."""
    from kvpot.eval.resume import completion_lines

    config = summary["config"]
    options = ", ".join(f"{k}={v}" for k, v in config["task_options"].items()) or "defaults"
    parts = [
        f"# kvpot eval: {config['task']}",
        "",
        f"- model: `{summary['model']}` ({summary['dtype']}, {summary['device']})",
        f"- task options: {options}; haystack: {config['haystack']}; "
        f"{config['samples']} samples per cell, template{', key format' if config.get('key_formats') else ''} "
        f"and chat flag; templates {_templates(config)}; {_key_formats(config)}{_chat(summary)}; seed {config['seed']}",
        f"- kvpot {summary['versions']['kvpot']}, torch {summary['versions']['torch']}, "
        f"transformers {summary['versions']['transformers']}; {summary['date']}",
        *completion_lines(summary),
        "",
        "## Accuracy by method and context length",
        "",
        "Mean score (1 = every answer right), then correct/total with its 95% Wilson interval and, with "
        "several templates, the range of per-template accuracy (with several key formats, the range of "
        "per-format accuracy; with and without the chat template, each one's accuracy); claim a ranking only "
        "where intervals separate. KV entries are per layer and "
        "KV head; seconds per sample.",
        "",
        markdown_table(*_accuracy_rows(summary)),
    ]
    for label, method in summary["methods"].items():
        parts += [
            "",
            f"## {label}",
            "",
            f"`{method_params(method['config']) or 'no parameters'}`",
            "",
            markdown_table(*_depth_rows(summary, label)),
        ]
    return "\n".join(parts) + "\n"


def eval_rich_table(summary: dict):
    """The comparison table for the terminal (every method in ONE table)."""
    config = summary["config"]
    table = rich_table(f"kvpot eval {config['task']}: accuracy by context length ({config['samples']} samples x "
                       f"{len(config['depths'])} depths x templates {_templates(config)} per cell; correct/total, "
                       "[95% Wilson interval], tpl: min-max over templates"
                       + (f", fmt: over key formats {','.join(config['key_formats'])}" if _several_formats(config)
                          else "") + ")", *_accuracy_rows(summary, terminal=True))
    table.columns[0].no_wrap = True  # method labels are what a reader searches for; cells may wrap instead
    return table


def _chat(summary: dict) -> str:
    """How the samples were read: plain text, inside the model's chat template, or both ways."""
    flags = summary.get("chat_flags") or [False]
    return {(False,): "plain text (no chat template)", (True,): "inside the chat template",
            (False, True): "plain and inside the chat template"}[tuple(flags)]


def _templates(config: dict) -> str:
    return ",".join(map(str, config.get("templates") or [0]))


def _key_formats(config: dict) -> str:
    """`key formats digits,uuid; ` where `--key-formats` set them ('' for the task's own format)."""
    return f"key formats {','.join(config['key_formats'])}; " if config.get("key_formats") else ""


def _several_formats(config: dict) -> bool:
    return len(config.get("key_formats") or []) > 1


def key_formats_png(path: Path, summary: dict) -> Path:
    """Accuracy per key format, one group of bars per method (lengths, depths and templates pooled), each bar
    with its 95% Wilson interval (`intervals_by_key_format`): drawn where `--key-formats` named several."""
    import numpy as np

    formats, labels = summary["config"]["key_formats"], list(summary["methods"])
    figure = new_figure(max(5.0, 0.45 * len(labels) * len(formats) + 2.5), 4.0)
    axes = figure.add_subplot()
    width = 0.8 / len(formats)
    for k, fmt in enumerate(formats):
        cells = [summary["intervals_by_key_format"][label].get(fmt) or {"total": 0} for label in labels]
        acc = [c["correct"] / c["total"] if c["total"] else math.nan for c in cells]
        low = [a - c["wilson95"][0] if c["total"] else 0.0 for a, c in zip(acc, cells)]
        high = [c["wilson95"][1] - a if c["total"] else 0.0 for a, c in zip(acc, cells)]
        axes.bar(np.arange(len(labels)) + (k - (len(formats) - 1) / 2) * width, acc, width, yerr=[low, high],
                 capsize=2, label=fmt)
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    axes.set_ylim(0.0, 1.03)
    axes.set_ylabel("correct / total (bars: 95% Wilson interval)")
    axes.set_title(f"kvpot eval {summary['config']['task']}: accuracy by key format", fontsize=10)
    axes.grid(alpha=0.3, axis="y")
    axes.legend(fontsize=8, title="key format")
    figure.tight_layout()
    figure.savefig(path)
    return path


def heatmap_png(
    path: Path, grid: Sequence[Sequence[float | None]], lengths: Sequence[int], depths: Sequence[float], title: str
) -> Path:
    """A needle-in-a-haystack figure: context length across, depth down, accuracy in each cell.

    `grid[i][j]` is the accuracy at `depths[i]` and `lengths[j]` (None: not run); cells are
    annotated so the figure reads without the colour bar.
    """
    import numpy as np

    values = np.array([[math.nan if v is None else v for v in row] for row in grid], dtype=float)
    figure = new_figure(max(4.0, 1.1 * len(lengths) + 2.5), max(3.0, 0.55 * len(depths) + 2.0))
    axes = figure.add_subplot()
    image = axes.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    axes.set_xticks(range(len(lengths)), [format_length(n) for n in lengths])
    axes.set_yticks(range(len(depths)), [format_depth(d) for d in depths])
    axes.set_xlabel("context length (tokens)")
    axes.set_ylabel("needle depth")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            text = "-" if math.isnan(value) else f"{value:.2f}"
            dark = not math.isnan(value) and (value < 0.2 or value > 0.85)  # the colour map's dark ends
            axes.text(j, i, text, ha="center", va="center", fontsize=9, color="white" if dark else "black")
    figure.colorbar(image, ax=axes, label="accuracy")
    axes.set_title(title, fontsize=9, wrap=True)
    figure.tight_layout()
    figure.savefig(path)
    return path


def accuracy_png(path: Path, summary: dict) -> Path:
    """Accuracy against context length, one line per method (log-2 length axis), 95% Wilson error bars."""
    lengths = summary["config"]["lengths"]
    figure = new_figure(6.0, 4.0)
    axes = figure.add_subplot()
    for index, label in enumerate(summary["methods"]):
        acc = [math.nan if a is None else a for a in (summary["accuracy"][label][str(n)] for n in lengths)]
        style = LINE_STYLES[index % len(LINE_STYLES)]  # lines that coincide stay distinguishable
        axes.errorbar(lengths, acc, yerr=_error_bars(summary, label, acc), label=label, capsize=3, **style)
    length_axis(axes, lengths)
    axes.set_ylim(-0.03, 1.03)
    axes.set_ylabel("accuracy (bars: 95% Wilson interval)")
    axes.set_title(f"kvpot eval {summary['config']['task']}: accuracy vs context length", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return path


def _error_bars(summary: dict, label: str, acc: Sequence[float]) -> list[list[float]]:
    """[below, above] distances from each point to its Wilson bounds (0 where none is known)."""
    stats = summary.get("intervals", {}).get(label, {})
    bars: list[list[float]] = [[], []]
    for n, a in zip(summary["config"]["lengths"], acc):
        bounds = (stats.get(str(n)) or {}).get("wilson95")
        known = bounds is not None and not math.isnan(a)
        # the mean score (partial credit) may sit outside the interval of whole answers: no negative bar
        bars[0].append(max(0.0, a - bounds[0]) if known else 0.0)
        bars[1].append(max(0.0, bounds[1] - a) if known else 0.0)
    return bars


def _perplexity_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    headers = ["method", "tokens scored", "mean NLL", "perplexity", "peak KV entries", "seconds"]
    rows = []
    for label, result in summary["methods"].items():
        stats = result["stats"]
        rows.append([
            label, f"{result['tokens_scored']:,}", format_number(result["mean_nll"], 4),
            format_number(result["perplexity"], 3), format_number(stats.get("max_kv_entries")),
            format_number(result["seconds"]),
        ])
    return headers, rows


def perplexity_markdown(summary: dict) -> str:
    """`summary.md` of a perplexity run: overall table, then mean NLL per window and method."""
    config = summary["config"]
    window = config["window"]
    labels = list(summary["methods"])
    first = summary["methods"][labels[0]]["windows"] if labels else []
    window_rows = [
        [f"{w['start']:,}-{w['end'] - 1:,}"] + [format_number(summary["methods"][m]["windows"][i]["mean_nll"], 4)
                                              for m in labels]
        for i, w in enumerate(first)
    ]
    return "\n".join([
        "# kvpot eval perplexity",
        "",
        f"- model: `{summary['model']}` ({summary['dtype']}, {summary['device']})",
        f"- text: {config['lengths'][0]:,} tokens of the {config['haystack']} haystack, seed {config['seed']}",
        f"- kvpot {summary['versions']['kvpot']}, torch {summary['versions']['torch']}, "
        f"transformers {summary['versions']['transformers']}; {summary['date']}",
        "",
        markdown_table(*_perplexity_rows(summary)),
        "",
        f"## Mean NLL per window of {window:,} tokens (token indices)",
        "",
        markdown_table(["tokens"] + labels, window_rows),
    ]) + "\n"


def perplexity_rich_table(summary: dict):
    return rich_table(f"kvpot eval perplexity: {summary['config']['lengths'][0]:,} tokens", *_perplexity_rows(summary))


def perplexity_png(path: Path, summary: dict, trained_window: int | None = None) -> Path:
    """Mean NLL per window against position, one line per method; the trained window marked."""
    figure = new_figure(7.0, 4.0)
    axes = figure.add_subplot()
    for label, result in summary["methods"].items():
        windows = result["windows"]
        axes.plot([w["end"] for w in windows], [w["mean_nll"] for w in windows], marker=".", label=label)
    if trained_window:
        axes.axvline(trained_window, color="grey", linestyle="--", linewidth=1,
                     label=f"model window ({format_length(trained_window)})")
    axes.set_xlabel("position (tokens; end of each window)")
    axes.set_ylabel(f"mean NLL per {summary['config']['window']:,}-token window")
    axes.set_title("kvpot eval perplexity: loss along the text", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return path
