"""Tables and plots of `kvpot bench serve` results, from the plain dict in results.json."""

from __future__ import annotations

import json
from pathlib import Path

from kvpot.bench.report import _COLUMNS as _BENCH_COLUMNS
from kvpot.bench.report import OPTIONAL, _cell, load_line

_THROUGHPUT = {key: column for column in _BENCH_COLUMNS["throughput"] for key in [column[1]]}
_COUNT = lambda v: f"{v:,}"  # noqa: E731
_COLUMNS = [
    *(_THROUGHPUT[k] for k in ("users", "completed")),
    ("429", "rejected", _COUNT),
    ("failed", "failed", _COUNT),
    *(_THROUGHPUT[k] for k in ("output_tokens_per_second", "prompt_tokens_per_second", "ttft_p50_seconds",
                               "ttft_p95_seconds", "ttft_p99_seconds", "itl_p50_ms", "itl_p95_ms", "itl_p99_ms",
                               "itl_reading_p99_ms", "e2e_p50_seconds", "e2e_p95_seconds", "e2e_p99_seconds",
                               "slo_met_share", "goodput_tokens_per_second")),  # as `bench throughput` shows them
    ("ITL p99 upload ms", "itl_p99_ms_during_upload", lambda v: f"{v:.1f}"),
    ("http / engine", "http_vs_engine", lambda v: f"{v:.2f}"),
]

# shown only where some row has them (a terminal table is narrow)
_OPTIONAL = {"rejected", "failed", "itl_p99_ms_during_upload", "http_vs_engine", "slo_met_share",
             "goodput_tokens_per_second", "itl_reading_p99_ms"}

NOTES = (
    "Each user's streaming chat request is sent at its arrival (`load` above: all together, or Poisson arrivals; "
    "openai's AsyncOpenAI, `stream=True`, usage in the last chunk); tok/s = completion tokens (usage) / the "
    "workload's wall time; TTFT = first non-empty content chunk, E2E = the stream's end, both from the request's "
    "arrival (queueing counts); prompt tok/s = prompt tokens (usage) / the wall time; SLO met and goodput as in "
    "`bench throughput` (TTFT and each request's p99 gap within the SLOs); ITL = gaps between a stream's content "
    "chunks (a chunk may hold more "
    "than one token: see `tokens_per_chunk`), ITL reading = those that overlap some request's wait for its first "
    "chunk. 429 = rejected requests, counted apart from failed ones. "
    "`[http]` = through the server, `[engine]` = the same token ids through kvpot's scheduler in this process "
    "(`bench throughput`'s `[batch]` row); http / engine = the ratio of their tok/s. ITL p99 upload = gaps that "
    "overlap the `--upload-during` document's upload."
)


def ordered(results: dict) -> list[dict]:
    """Rows as they are compared: per method and length, `[http]` beside `[engine]` (results.json keeps
    the order they ran in: a method's server rows first, then its engine rows)."""
    methods = list(dict.fromkeys(r["method"].rsplit(" [", 1)[0] for r in results["rows"]))
    return sorted(results["rows"], key=lambda r: (methods.index(r["method"].rsplit(" [", 1)[0]), r["length"],
                                                  r.get("kind") != "http"))


def table_rows(results: dict, compact: bool = False) -> tuple[list[str], list[list[str]]]:
    from kvpot.bench.report import COMPACT_SKIP, length_cell

    rows = results["rows"]
    columns = [c for c in _COLUMNS if c[1] not in _OPTIONAL or any(r.get(c[1]) for r in rows)
               or (c[1] in OPTIONAL and any(r.get(c[1]) is not None for r in rows))]  # an SLO met by none: 0%
    columns = [c for c in columns if not (compact and c[1] in COMPACT_SKIP)]
    headers = ["method", "length"] + [c[0] for c in columns]
    rows = [[row["method"], length_cell(row)] + [_cell(row, key, fmt) for _, key, fmt in columns]
            for row in ordered(results)]
    return headers, rows


def _title(results: dict) -> str:
    if results["config"]["url"]:
        server = results.get("server") or {}
        model = server.get("model") or results["config"]["served_model"] or "server"
        return f"kvpot bench serve: {model} at {results['config']['url']}"
    shape = results.get("shape")
    what = f"{shape['name']} (random weights)" if shape else results["config"]["model"]
    return f"kvpot bench serve: {what}, {results.get('dtype', '?')}, {results['machine']['device']}"


def _setup_lines(results: dict) -> list[str]:
    from kvpot.bench.shapes import format_params

    config, m = results["config"], results["machine"]
    lines = []
    if config["url"]:
        server = results.get("server") or {}
        lines.append(f"- server: {config['url']}, model `{server.get('model', '?')}`"
                     f"{' (kvpot)' if server.get('kvpot') else ''}; this machine is the client")
    elif results.get("shape"):
        shape = results["shape"]
        lines.append(f"- launched kvpot server on shape `{shape['name']}` ({shape['mirrors']}), "
                     f"{format_params(shape['parameters'])} parameters, random weights, {results['dtype']}, "
                     "word-level tokenizer (exact lengths)")
    else:
        lines.append(f"- launched kvpot server on `{config['model']}`, {results['dtype']} (lengths in words: approximate)")
    lines += [
        _workload_line(config),
        load_line(config),
        f"- machine: {m['device']}; GPU {m['gpu'] or 'none'}; CPU {m['cpu']} ({m['cpu_count']} cores)",
        f"- kvpot {m['versions']['kvpot']}, torch {m['versions']['torch']}, transformers "
        f"{m['versions']['transformers']}; commit {m['git_commit'] or 'unknown'}"
        f"{' (modified)' if m.get('git_dirty') else ''}; {m['date']}",
        f"- command: `{' '.join(results['command'])}`",
    ]
    return lines


def _workload_line(config: dict) -> str:
    line = (f"- workload: {config['users']} users, {config['new_tokens']} new tokens each (temperature 0), "
            f"{config['question_tokens']} question tokens")
    if config["document"]:
        line += ", one shared document (the lengths)"
    if config["upload_during"]:
        line += f", a {config['upload_during']:,}-token document uploaded while they decode"
    return line


def summary_markdown(results: dict) -> str:
    from kvpot.reporting import markdown_table, method_params

    parts = [f"# {_title(results)}", "", *_setup_lines(results), "", NOTES, "", markdown_table(*table_rows(results))]
    errors = [r for r in results["rows"] if r.get("error")]
    if errors:
        parts += ["", "## Errors", ""] + [f"- {r['method']} @ {r['length']:,}: {r['error']}" for r in errors]
    if results.get("methods"):
        parts += ["", "## Methods", ""]
        parts += [f"- `{label}`: `{method_params(d['config']) or 'no parameters'}` (bound: {d['max_entries']})"
                  for label, d in results["methods"].items()]
    return "\n".join(parts) + "\n"


def rich_table(results: dict):
    from kvpot.reporting import rich_table as table_of

    return table_of(_title(results), *table_rows(results, compact=True))


def plot_names() -> list[str]:
    return ["throughput.png", "itl.png"]


def _label(row: dict) -> str:
    from kvpot.reporting import format_length

    return f"{row['method']} @ {format_length(row['length'])}"


def throughput_png(path: Path, results: dict) -> Path:
    """Output tokens/s, one bar per row (a row that failed: an empty slot, its label marked)."""
    from kvpot.reporting import new_figure

    rows = ordered(results)
    figure = new_figure(max(6.5, 0.9 * len(rows) + 2), 4.2)
    axes = figure.add_subplot()
    values = [r.get("output_tokens_per_second") or 0.0 for r in rows]
    colors = ["tab:blue" if r.get("kind") == "http" else "tab:orange" for r in rows]
    axes.bar(range(len(rows)), values, color=colors)
    axes.set_xticks(range(len(rows)), [_label(r) + (" (error)" if r.get("error") else "") for r in rows],
                    rotation=30, ha="right", fontsize=7)
    axes.set_ylabel("output tokens per second")
    axes.set_title(_title(results), fontsize=9)
    axes.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    figure.savefig(path)
    return path


def itl_png(path: Path, results: dict) -> Path:
    """Distribution (CDF) of the gaps between a stream's chunks, one line per `[http]` row."""
    from kvpot.reporting import LINE_STYLES, new_figure

    figure = new_figure(6.5, 4.2)
    axes = figure.add_subplot()
    plotted = 0
    for index, row in enumerate(r for r in ordered(results) if r.get("records")):
        gaps = sorted(1000 * (b - a) for rec in row["records"] for a, b in zip(rec["chunk_seconds"],
                                                                                rec["chunk_seconds"][1:]))
        gaps = [max(g, 1e-3) for g in gaps]  # a log axis: two chunks in one read are 0 ms apart
        if gaps:
            style = {k: v for k, v in LINE_STYLES[index % len(LINE_STYLES)].items() if k == "linestyle"}
            axes.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=_label(row), **style)
            plotted += 1
    if plotted:
        axes.set_xscale("log")
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no inter-token gaps (no stream had two chunks)", ha="center", va="center",
                  transform=axes.transAxes)
    axes.set_xlabel("gap between a stream's content chunks (ms)")
    axes.set_ylabel("fraction of gaps")
    axes.set_title(_title(results), fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    return path


def write_reports(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(summary_markdown(results), encoding="utf-8")
    write_plots(results, out)


def write_plots(results: dict, out: Path) -> list[Path]:
    """throughput.png and itl.png from the results alone (`kvpot report --plots` too)."""
    return [throughput_png(out / "throughput.png", results), itl_png(out / "itl.png", results)]


__all__ = ["ordered", "plot_names", "rich_table", "summary_markdown", "table_rows", "write_plots", "write_reports"]
