"""Score against compression ratio (kvpress' leaderboard view), for runs with `--compression-ratios`.

Every method or press run at a ratio has `compression_ratio` and `family` (its spec) in
`summary["methods"]`; methods that take no budget (`full`) are the uncompressed reference, ratio 0.
Cells are the same as the main table's: the mean score with correct/total, the 95% Wilson interval and
the template (and chat) spread, per context length (tasks) or length group (RULER).
"""

from __future__ import annotations

import math
from pathlib import Path


def families(summary: dict) -> dict[str, dict[float, str]]:
    """family -> {ratio: label}; a run without a ratio is its own family at ratio 0."""
    out: dict[str, dict[float, str]] = {}
    for label, method in summary["methods"].items():
        ratio = method.get("compression_ratio")
        out.setdefault(method.get("family") or label if ratio is not None else label, {})[ratio or 0.0] = label
    return out


def _columns(summary: dict) -> list[str]:
    return summary["groups"] if "groups" in summary else [str(n) for n in summary["config"]["lengths"]]


def cell(summary: dict, label: str, column: str) -> tuple[float | None, dict | None]:
    """(mean score, interval stats) of `label` at a length (tasks) or length group (suites)."""
    if "groups" in summary:
        return summary["by_group"][label].get(column), summary.get("intervals_by_group", {}).get(label, {}).get(column)
    return summary["accuracy"][label].get(column), summary.get("intervals", {}).get(label, {}).get(column)


def ratio_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """family x (length, ratio) cells, ratios ascending within each length."""
    from kvpot.eval.report import format_accuracy
    from kvpot.reporting import format_length

    groups = families(summary)
    ratios = sorted({r for f in groups.values() for r in f})
    headers = ["method"] + [f"{format_length(int(c)) if c.isdigit() else c} @ {r:g}" for c in _columns(summary)
                            for r in ratios]
    rows = []
    for family, labels in groups.items():
        row = [family]
        for column in _columns(summary):
            for ratio in ratios:
                label = labels.get(ratio)
                row.append("-" if label is None else format_accuracy(*cell(summary, label, column)))
        rows.append(row)
    return headers, rows


def ratio_markdown(summary: dict) -> list[str]:
    """The section `summary.md` gets for a run at compression ratios."""
    from kvpot.reporting import markdown_table

    return ["", "## Score by compression ratio", "",
            "kvpress' leaderboard view: each method and press at each ratio r keeps int(n (1 - r)) of a prompt's n "
            "context entries per layer and KV head (@ 0: no compression). Mean score, correct/total with its 95% "
            "Wilson interval and the template spread; a ranking holds only where intervals separate.", "",
            markdown_table(*ratio_rows(summary))]


def ratio_png(path: Path, summary: dict) -> Path:
    """One panel per length: score against compression ratio, a line per method or press, Wilson bars."""
    from kvpot.reporting import LINE_STYLES, format_length, new_figure

    columns = _columns(summary)
    figure = new_figure(4.2 * len(columns) + 1.5, 4.0)
    for index, column in enumerate(columns):
        axes = figure.add_subplot(1, len(columns), index + 1)
        for k, (family, labels) in enumerate(families(summary).items()):
            ratios = sorted(labels)
            points = [cell(summary, labels[r], column) for r in ratios]
            means = [math.nan if m is None else m for m, _ in points]
            bars = [[max(0.0, m - s["wilson95"][0]) if s and s.get("wilson95") and not math.isnan(m) else 0.0
                     for m, (_, s) in zip(means, points)],
                    [max(0.0, s["wilson95"][1] - m) if s and s.get("wilson95") and not math.isnan(m) else 0.0
                     for m, (_, s) in zip(means, points)]]
            axes.errorbar(ratios, means, yerr=bars, label=family, capsize=3, **LINE_STYLES[k % len(LINE_STYLES)])
        axes.set_xlabel("compression ratio")
        axes.set_ylim(-0.03, 1.03)
        axes.set_title(format_length(int(column)) if column.isdigit() else column, fontsize=10)
        axes.grid(alpha=0.3)
        if index == 0:
            axes.set_ylabel("score (bars: 95% Wilson interval)")
    figure.axes[-1].legend(fontsize=7, loc="best")
    figure.suptitle(f"kvpot eval {summary['config']['task']}: score against compression ratio", fontsize=10)
    figure.tight_layout()
    figure.savefig(path)
    return path
