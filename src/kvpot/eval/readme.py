"""The documentation's result tables, rankings and figures, made from recorded results (`kvpot report`).

A manifest (`benchmarks/readme.json`) lists the tables: which run folders, which task, which methods as
rows (their `--method` spec, a display label), which lengths as columns (or, `"kind": "ratios"`,
length groups x compression ratios, RULER beside kvpress; `"kind": "key_formats"`, lengths x key formats).
Each table is rendered between the marker comments `<!-- kvpot-readme:NAME -->` and
`<!-- /kvpot-readme:NAME -->` of whichever markdown file holds them (README.md, docs/evaluation.md:
`placed`), so no number in it is typed by hand, and `kvpot report --check` (a test) fails when a file and
the records differ. A figure's link is written relative to the file that holds its block, so it resolves
wherever the block lives.

A cell is correct/total whole answers with the 95% Wilson interval (`kvpot.eval.stats`), plus the
range of per-template accuracy, of per-key-format accuracy and plain/chat accuracy where the rows have
them; rows written before prompt templates render as one wording, and the caption says which protocol
each table used. Ranking
statements are generated per column: the highest cell, the cells whose intervals do not separate from
it, and those below it with separated intervals; nothing else is claimed. A table whose folders do not
exist yet renders its `pending` text (the command that will record it).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from kvpot.errors import KvpotError
from kvpot.eval import recorded

BEGIN, END = "<!-- kvpot-readme:{} -->", "<!-- /kvpot-readme:{} -->"


def load_manifest(path: Path) -> list[dict]:
    try:
        tables = json.loads(Path(path).read_text(encoding="utf-8"))["tables"]
    except (OSError, json.JSONDecodeError, KeyError) as err:
        raise KvpotError(f"cannot read the README manifest {path}: {err}".splitlines()[0]) from None
    names = [t["name"] for t in tables]
    if len(set(names)) != len(names):
        raise KvpotError(f"{path}: a table name is given twice.")
    return tables


# ---------------------------------------------------------------------------- cells


def _fmt_stats(stats: dict) -> str:
    """`28/30 [0.79, 0.98]`, then `tpl 0.80-1.00`, `fmt 0.60-1.00` and `plain 0.90, chat 0.97` where they exist."""
    if not stats or not stats["total"]:
        return "-"
    low, high = stats["wilson95"]
    text = f"{stats['correct']}/{stats['total']} [{low:.2f}, {high:.2f}]"
    if stats.get("template_spread"):
        text += f" tpl {stats['template_spread'][0]:.2f}-{stats['template_spread'][1]:.2f}"
    if stats.get("key_format_spread"):
        text += f" fmt {stats['key_format_spread'][0]:.2f}-{stats['key_format_spread'][1]:.2f}"
    if stats.get("chat_spread"):
        text += " " + ", ".join(f"{k} {v:.2f}" for k, v in stats["by_chat"].items())
    return text


def _columns(table: dict) -> list[tuple[str, dict]]:
    """(header, selection) of each column: a length, a length group at a compression ratio, or (`"kind":
    "key_formats"`) a length in each of `key_formats` and all of them pooled."""
    from kvpot.reporting import format_length

    if table.get("kind", "lengths") == "lengths":
        return [(format_length(n), {"length": n}) for n in table["lengths"]]
    if table["kind"] == "key_formats":  # each format's rows (passkey's key / niah's value option), then all pooled
        from kvpot.tasks.keys import FORMAT_OPTION

        option = FORMAT_OPTION[table["task"]]
        return [(f"{format_length(n)} {head}", {"length": n, **({"options": {option: fmt}} if fmt else {})})
                for n in table["lengths"] for head, fmt in [*((f, f) for f in table["key_formats"]), ("all", None)]]
    cols = []
    for group in table["groups"]:
        for ratio in table["ratios"]:
            head = format_length(int(group)) if str(group).isdigit() else str(group)
            cols.append((f"{head} @ {ratio:g}", {"group": str(group), "ratio": ratio or None}))
    return cols


def cells(table: dict, records) -> tuple[dict[str, dict[str, dict]], list[dict]]:
    """(label -> column header -> accuracy_stats, every row used) of the rows the table's folders recorded.
    A method without a budget (`full`) has no compression ratio: in a ratios table it fills the @ 0 columns."""
    from kvpot.eval.records import protocol_of
    from kvpot.eval.stats import accuracy_stats

    out, used = {}, []
    for row in table["rows"]:
        out[row["label"]] = {}
        for head, where in _columns(table):
            where = dict(where)
            options = {**(table.get("options") or {}), **where.pop("options", {})} or None
            picked = records.select(row["spec"], task=table.get("task"), depths=table.get("depths"),
                                    options=options, **where)
            protocol_of(picked)
            out[row["label"]][head] = accuracy_stats(picked) if picked else None
            used += picked
    protocol_of(used)  # one table, one protocol
    return out, used


# ---------------------------------------------------------------------------- rankings


def ranking(column: str, entries: list[tuple[str, dict]]) -> str | None:
    """One column's statement: the highest cell, those not separated from it, those separated below it."""
    from kvpot.eval.stats import separated

    entries = [(label, s) for label, s in entries if s and s["total"]]
    if len(entries) < 2:
        return None
    entries.sort(key=lambda e: -e[1]["correct"] / e[1]["total"])  # stable: manifest order breaks ties

    def named(label, stats):
        return f"{label} {_fmt_stats(stats)}"

    best_label, best = entries[0]
    if best["correct"] == 0:
        return f"{column}: none answered any ({'; '.join(named(*e) for e in entries)})."
    tied = [e for e in entries[1:] if not separated(best, e[1])]
    below = [e for e in entries[1:] if separated(best, e[1])]
    text = f"{column}: highest {named(best_label, best)}"
    if tied:
        text += f"; not separated from it: {'; '.join(named(*e) for e in tied)}"
    if below:
        text += f"; below it, intervals separate: {'; '.join(named(*e) for e in below)}"
    else:
        text += " (no interval separates from it: no ranking can be claimed)"
    return text + "."


def rankings(table: dict, stats: dict) -> list[str]:
    lines = []
    for spec in table.get("rankings", []):
        labels = [r["label"] for r in table["rows"]] if spec["rows"] == "all" else spec["rows"]
        unknown = [label for label in labels if label not in stats]
        if unknown:
            raise KvpotError(f"table {table['name']}: ranking row {unknown[0]!r} is not a row of the table.")
        short = {r["label"]: r.get("short", r["label"]) for r in table["rows"]}  # rankings name rows briefly
        said = [ranking(head, [(short[label], stats[label].get(head)) for label in labels])
                for head, _ in _columns(table)]
        said = [s for s in said if s]
        if said:
            lines += [f"{spec['title']} (95% Wilson intervals; a ranking only where they separate):", ""]
            lines += [f"- {s}" for s in said] + [""]
    return lines


# ---------------------------------------------------------------------------- a table


def render(table: dict, base: Path, where: Path | None = None) -> str:
    """The markdown between a table's markers (without the markers). `where`: the folder of the file that
    holds the block (default `base`); the figure's link is relative to it."""
    from kvpot.eval.records import describe_protocol, read
    from kvpot.reporting import markdown_table

    root = base / table["root"]
    if not all(recorded.is_dir(root / f) for f in table["folders"]):
        return table["pending"].strip()
    records = read(root, table["folders"])
    stats, chosen = cells(table, records)
    columns = [head for head, _ in _columns(table)]
    body = [[row["label"], *(_fmt_stats(stats[row["label"]].get(head)) for head in columns)] for row in table["rows"]]
    used = sorted({r["run"] for r in chosen})
    repeated, changed = records.repeats(chosen)
    lines = [table.get("intro", "").strip(), ""] if table.get("intro") else []
    lines += [
        f"*{table['title']}* Protocol: {describe_protocol(chosen)}. {_hardware(records, used)} "
        f"Runs: {_folders(used)} under `{table['root']}/`"
        + (f"; {repeated} of these samples were answered by more than one run and count once (the latest answer; "
           f"{changed} of them changed outcome between runs)" if repeated else "") + ".",
        "",
        "Each cell: correct/total whole answers and the 95% Wilson interval"
        + ("; tpl: the range of per-template accuracy" if any(s and s.get("template_spread") for v in stats.values()
                                                          for s in v.values()) else "")
        + ("; fmt: the range of per-key-format accuracy" if any(
            s and s.get("key_format_spread") for v in stats.values() for s in v.values()) else "")
        + ("; plain/chat: accuracy without and with the chat template" if any(
            s and s.get("chat_spread") for v in stats.values() for s in v.values()) else "") + ".",
        "",
        markdown_table(["method", *columns], body),
        "",
    ]
    if table.get("figure"):
        lines += [f"![{table['title']}]({_link(base / table['figure'], where or base)})", ""]
    lines += rankings(table, stats)
    return "\n".join(lines).strip()


def _link(target: Path, where: Path) -> str:
    """`target` relative to the folder `where`, with forward slashes (a markdown link)."""
    return Path(os.path.relpath(Path(target).resolve(), Path(where).resolve())).as_posix()


def _folders(used: list[str]) -> str:
    """Run folders grouped by their top folder: `` `gpu/` (12 runs), `gpu-rest/` (1 run) ``."""
    tops: dict[str, int] = {}
    for name in used:
        top = name.split("/")[0]
        tops[top] = tops.get(top, 0) + 1
    return ", ".join(f"`{top}/` ({count} run{'s' if count > 1 else ''})" for top, count in tops.items())


def _hardware(records, used: list[str]) -> str:
    devices = sorted({str(records.meta[u].get("device")) for u in used if records.meta[u].get("device")})
    dtypes = sorted({str(records.meta[u].get("dtype")) for u in used if records.meta[u].get("dtype")})
    dates = sorted({records.runs[u][:10] for u in used if records.runs.get(u)})
    parts = []
    if devices:
        parts.append(", ".join(devices))
    if dtypes:
        parts.append(", ".join(dtypes))
    if dates:
        parts.append(dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}")
    return ("Recorded on " + "; ".join(parts) + ".") if parts else ""


# ---------------------------------------------------------------------------- the files that hold the blocks


def blocks(manifest: Path, base: Path, where: Path | None = None) -> dict[str, str]:
    return {table["name"]: render(table, base, where) for table in load_manifest(manifest)}


def holds(text: str, name: str) -> bool:
    return BEGIN.format(name) in text


def doc_files(base: Path) -> list[Path]:
    """The files `kvpot report` writes and checks by default: README.md and docs/*.md under `base`."""
    return [p for p in [base / "README.md", *sorted((base / "docs").glob("*.md"))] if p.is_file()]


def placed(manifest: Path, base: Path, files: list[Path]) -> dict[Path, dict[str, str]]:
    """file -> {name: rendered block} for every table whose markers the file holds, each rendered with its
    figure linked relative to that file. A table that no file holds is an error (it would go unchecked)."""
    tables = load_manifest(manifest)
    texts = {Path(f): Path(f).read_text(encoding="utf-8") for f in files}
    out: dict[Path, dict[str, str]] = {f: {} for f in texts}
    cache: dict[tuple[str, Path], str] = {}
    for table in tables:
        homes = [f for f, text in texts.items() if holds(text, table["name"])]
        if not homes:
            raise KvpotError(f"no file of {', '.join(str(f) for f in texts)} holds the "
                             f"{BEGIN.format(table['name'])} ... {END.format(table['name'])} block (with no file named, "
                             f"kvpot report reads README.md and docs/*.md).")
        for f in homes:
            key = (table["name"], f.resolve().parent)
            if key not in cache:
                cache[key] = render(table, base, f.resolve().parent)
            out[f][table["name"]] = cache[key]
    return out


def replace_blocks(text: str, rendered: dict[str, str]) -> str:
    """`text` with every named block's content replaced; a block without its markers is an error."""
    for name, content in rendered.items():
        pattern = re.compile(re.escape(BEGIN.format(name)) + r"\n.*?" + re.escape(END.format(name)), re.S)
        if not pattern.search(text):
            raise KvpotError(f"the README has no {BEGIN.format(name)} ... {END.format(name)} block.")
        text = pattern.sub(lambda m: f"{BEGIN.format(name)}\n{content}\n{END.format(name)}", text, count=1)
    return text


def stale(text: str, rendered: dict[str, str]) -> list[str]:
    """The names of blocks whose content in `text` differs from `rendered` (or that are missing)."""
    return [name for name in rendered if replace_blocks_safe(text, {name: rendered[name]}) != text]


def replace_blocks_safe(text: str, rendered: dict[str, str]) -> str | None:
    try:
        return replace_blocks(text, rendered)
    except KvpotError:
        return None


def figures(manifest: Path, base: Path) -> list[Path]:
    """Accuracy against length (Wilson bars) of every table with a `figure`, from the same records."""
    import matplotlib

    from kvpot.eval.records import read
    from kvpot.reporting import LINE_STYLES, format_length, length_axis, new_figure

    written = []
    for table in load_manifest(manifest):
        root = base / table["root"]
        if not table.get("figure") or table.get("kind", "lengths") != "lengths" or not all(
                recorded.is_dir(root / f) for f in table["folders"]):
            continue
        stats, _ = cells(table, read(root, table["folders"]))
        colors = matplotlib.colormaps["tab20"]  # up to 20 rows stay distinguishable
        figure = new_figure(7.0, 4.2)
        axes = figure.add_subplot()
        for k, row in enumerate(table["rows"]):
            points = [(n, stats[row["label"]].get(format_length(n))) for n in table["lengths"]]
            points = [(n, s) for n, s in points if s and s["total"]]
            if not points:
                continue
            xs, acc = [n for n, _ in points], [s["correct"] / s["total"] for _, s in points]
            bars = [[a - s["wilson95"][0] for a, (_, s) in zip(acc, points)],
                    [s["wilson95"][1] - a for a, (_, s) in zip(acc, points)]]
            axes.errorbar(xs, acc, yerr=bars, label=row.get("short", row["label"]), capsize=3,
                          color=colors(k % 20), **LINE_STYLES[k % len(LINE_STYLES)])
        length_axis(axes, table["lengths"])
        axes.set_ylim(-0.03, 1.03)
        axes.set_ylabel("correct / total (bars: 95% Wilson interval)")
        axes.set_title(table["title"], fontsize=9, wrap=True)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
        figure.tight_layout()
        path = base / table["figure"]
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, metadata={"Software": None})
        written.append(path)
    return written

