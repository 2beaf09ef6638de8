"""Tables and figures of `kvpot eval` results: markdown, rich, heatmaps and line plots.

Everything here works on the plain dicts `kvpot.eval` writes to `summary.json`, so a figure can be
redrawn from a finished run without re-running a model. Figures use matplotlib's object API with
the Agg canvas (`Figure` + `FigureCanvasAgg`): nothing touches pyplot's global state or needs a
display, so plotting is safe in tests, on servers and from several threads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path

# ---------------------------------------------------------------------------- formatting


def format_length(tokens: int) -> str:
    """`2048` -> `2K`, `131072` -> `128K`, `1048576` -> `1M`, `3000` -> `3000` (as --lengths reads)."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if tokens >= size and tokens % size == 0:
            return f"{tokens // size}{unit}"
    return str(tokens)


def format_depth(depth: float) -> str:
    """`0.1` -> `10%` (heatmap rows and table headers)."""
    return f"{depth * 100:g}%"


def format_bytes(n: float) -> str:
    """`268435456` -> `256.0 MiB`: memory in binary units, as GPUs report it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_number(value: float | None, digits: int = 2) -> str:
    """A table cell: `-` for missing values (a run that has not finished)."""
    if value is None:
        return "-"
    if isinstance(value, int) or digits == 0:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def slug(label: str) -> str:
    """A file-name-safe form of a method label: `streaming[window=1020]` -> `streaming_window=1020`."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", label).strip("_") or "method"


def method_params(config: dict) -> str:
    """`window=1020, chunk_size=256, ...` of a method config, for titles."""
    return ", ".join(f"{k}={v}" for k, v in config.items() if k != "method")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; the first column left-aligned, the others right."""
    align = [":--"] + ["--:"] * (len(headers) - 1)
    lines = ["| " + " | ".join(map(str, headers)) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- task tables


def _accuracy_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Method x length accuracy, the mean, and cost columns: the one comparison table."""
    lengths = summary["config"]["lengths"]
    headers = ["method"] + [format_length(n) for n in lengths]
    headers += ["mean", "peak KV entries", "mean KV entries", "prefill s", "decode s"]
    rows = []
    for label, method in summary["methods"].items():
        acc = summary["accuracy"][label]
        cost = summary["cost"][label]
        rows.append(
            [label]
            + [format_number(acc[str(n)]) for n in lengths]
            + [
                format_number(summary["overall"][label]),
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
    headers = ["depth"] + [format_length(n) for n in lengths]
    rows = [
        [format_depth(d)] + [format_number(grid[str(n)][depth_key(d)]) for n in lengths] for d in depths
    ]
    return headers, rows


def depth_key(depth: float) -> str:
    """The JSON key of a depth (`0.1` -> `"0.1"`), stable across writes and reads."""
    return f"{depth:g}"


def eval_markdown(summary: dict) -> str:
    """`summary.md`: what ran, the comparison table, then each method's depth x length grid."""
    config = summary["config"]
    options = ", ".join(f"{k}={v}" for k, v in config["task_options"].items()) or "defaults"
    parts = [
        f"# kvpot eval: {config['task']}",
        "",
        f"- model: `{summary['model']}` ({summary['dtype']}, {summary['device']})",
        f"- task options: {options}; haystack: {config['haystack']}; "
        f"{config['samples']} samples per cell; seed {config['seed']}",
        f"- kvpot {summary['versions']['kvpot']}, torch {summary['versions']['torch']}, "
        f"transformers {summary['versions']['transformers']}; {summary['date']}",
        "",
        "## Accuracy by method and context length",
        "",
        "Mean score (1 = every answer right); KV entries are per layer and KV head; seconds per sample.",
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


def rich_table(title: str, headers: list[str], rows: list[list[str]]):
    """A terminal table: first column left-aligned, the rest right-aligned; cells printed literally."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    for index, header in enumerate(headers):
        table.add_column(header, justify="left" if index == 0 else "right", overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))  # labels hold [k=v]: not rich markup
    return table


def eval_rich_table(summary: dict):
    """The comparison table for the terminal (every method in ONE table)."""
    config = summary["config"]
    return rich_table(f"kvpot eval {config['task']}: accuracy by context length ({config['samples']} samples x "
                      f"{len(config['depths'])} depths per cell)", *_accuracy_rows(summary))


# ---------------------------------------------------------------------------- figures


def _figure(width: float, height: float):
    """A matplotlib Figure on an Agg canvas, independent of pyplot's global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(figure)
    return figure


def heatmap_png(
    path: Path, grid: Sequence[Sequence[float | None]], lengths: Sequence[int], depths: Sequence[float], title: str
) -> Path:
    """A needle-in-a-haystack figure: context length across, depth down, accuracy in each cell.

    `grid[i][j]` is the accuracy at `depths[i]` and `lengths[j]` (None: not run); cells are
    annotated so the figure reads without the colour bar.
    """
    import numpy as np

    values = np.array([[math.nan if v is None else v for v in row] for row in grid], dtype=float)
    figure = _figure(max(4.0, 1.1 * len(lengths) + 2.5), max(3.0, 0.55 * len(depths) + 2.0))
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
    """Accuracy against context length, one line per method (log-2 length axis)."""
    lengths = summary["config"]["lengths"]
    figure = _figure(6.0, 4.0)
    axes = figure.add_subplot()
    for index, label in enumerate(summary["methods"]):
        acc = [summary["accuracy"][label][str(n)] for n in lengths]
        style = _LINE_STYLES[index % len(_LINE_STYLES)]  # lines that coincide stay distinguishable
        axes.plot(lengths, [math.nan if a is None else a for a in acc], label=label, **style)
    _length_axis(axes, lengths)
    axes.set_ylim(-0.03, 1.03)
    axes.set_ylabel("accuracy")
    axes.set_title(f"kvpot eval {summary['config']['task']}: accuracy vs context length", fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    return path


_LINE_STYLES = [
    {"marker": m, "linestyle": ls, "markersize": 8 - 1.5 * (i % 3)}
    for i, (m, ls) in enumerate(zip("osD^v", ["-", "--", ":", "-.", "-"]))
]


def _length_axis(axes, lengths: Sequence[int]) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(lengths), [format_length(n) for n in lengths])
    axes.minorticks_off()
    axes.set_xlabel("context length (tokens)")


# ---------------------------------------------------------------------------- perplexity


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
        [f"{w['start']:,}-{w['end'] - 1:,}"] + [format_number(summary["methods"][l]["windows"][i]["mean_nll"], 4)
                                              for l in labels]
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
    figure = _figure(7.0, 4.0)
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
