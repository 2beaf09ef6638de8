"""The result tables of README.md and docs/ are generated (`kvpot report`): they must equal what the records give, the
rankings must claim only what the intervals allow, and old and new protocols must not be pooled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run
from kvpot.errors import KvpotError
from kvpot.eval.readme import doc_files, placed, ranking, render, replace_blocks, stale
from kvpot.eval.stats import stats_of

ROOT = Path(__file__).resolve().parents[1]


def test_the_documentation_tables_equal_what_the_records_give():
    """Every file that holds blocks (README.md, docs/*.md) equals what the records give; every table of the
    manifest lives in one of them (placed raises otherwise), its figure linked from where it lives."""
    files = doc_files(ROOT)
    rendered = placed(ROOT / "benchmarks" / "readme.json", ROOT, files)
    for path, mine in rendered.items():
        text = path.read_text(encoding="utf-8")
        assert stale(text, mine) == [], f"run: kvpot report --write ({path.relative_to(ROOT)})"
    every = {name: text for mine in rendered.values() for name, text in mine.items()}
    assert len(every) >= 5 and any("[0.89, 1.00]" in t for t in every.values())  # real tables, not empty blocks


def test_ranking_claims_only_separated_intervals():
    said = ranking("16K", [("A", stats_of(18, 30)), ("B", stats_of(30, 30)), ("C", stats_of(28, 30)),
                           ("D", None), ("E", stats_of(0, 0))])
    assert said.startswith("16K: highest B 30/30 [0.89, 1.00]")
    assert "not separated from it: C 28/30" in said and "below it, intervals separate: A 18/30" in said
    assert " D " not in said and " E " not in said  # nothing ran: no claim
    tied = ranking("4K", [("A", stats_of(3, 3)), ("B", stats_of(0, 3))])
    assert "no ranking can be claimed" in tied and "below it" not in tied
    assert ranking("8K", [("A", stats_of(0, 5)), ("B", stats_of(0, 9))]).startswith("8K: none answered any")
    assert ranking("8K", [("A", stats_of(2, 5))]) is None


def _run_folder(path: Path, spec: str, rows: list[dict], date: str = "2026-01-01T00:00:00+00:00") -> None:
    path.mkdir(parents=True)
    config = {"date": date, "device": "cpu", "dtype": "float32", "config": {"task": "passkey"},
              "methods": {spec: {"spec": spec}}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "results.jsonl").write_text("".join(json.dumps({"method": spec, "task": "passkey", **r}) + "\n"
                                                for r in rows))


def _rows(correct: list[bool], length: int = 1024, templated: bool = True, seed0: int = 0) -> list[dict]:
    out = []
    for i, ok in enumerate(correct):
        row = {"length": length, "depth": 0.5, "sample": i, "seed": seed0 + i, "correct": ok, "score": float(ok)}
        if templated:
            row.update(template=i % 3, chat=bool(i % 2))
        out.append(row)
    return out


def _table(**extra) -> dict:
    table = {"name": "t", "title": "A test table.", "root": "runs", "folders": ["a"], "task": "passkey",
             "lengths": [1024], "rows": [{"label": "Full", "spec": "full"}, {"label": "Pot", "spec": "pot"}],
             "rankings": [{"title": "Both", "rows": "all"}], "pending": "not run yet: `make it`"}
    table.update(extra)
    return table


def test_render_reports_the_protocol_spreads_and_repeats(tmp_path):
    _run_folder(tmp_path / "runs/a/one", "full", _rows([True] * 12))
    _run_folder(tmp_path / "runs/a/two", "pot", _rows([False] * 12))
    # a later run of the same samples: its answers count, once
    _run_folder(tmp_path / "runs/a/three", "pot", _rows([True] * 6), date="2026-02-01T00:00:00+00:00")
    text = render(_table(), tmp_path)
    assert "Protocol: templates 0, 1, 2; plain and inside the chat template" in text
    assert "| Full | 12/12 [0.76, 1.00] tpl 1.00-1.00 plain 1.00, chat 1.00 |" in text
    assert "| Pot | 6/12 [0.25, 0.75] tpl 0.50-0.50 plain 0.50, chat 0.50 |" in text
    assert "6 of these samples were answered by more than one run" in text and "6 of them changed" in text
    assert "- 1K: highest Full 12/12" in text and "below it, intervals separate: Pot 6/12" in text
    assert render(_table(folders=["missing"]), tmp_path) == "not run yet: `make it`"


def test_old_and_new_protocols_are_never_pooled(tmp_path):
    _run_folder(tmp_path / "runs/a/old", "full", _rows([True] * 3, templated=False))
    _run_folder(tmp_path / "runs/a/new", "full", _rows([True] * 3, seed0=100))
    with pytest.raises(KvpotError, match="mixes rows from before and after prompt templates"):
        render(_table(), tmp_path)
    (tmp_path / "runs/a/new/results.jsonl").unlink()
    assert "one wording, plain text" in render(_table(), tmp_path)


def test_report_writes_and_checks_the_blocks(capsys, tmp_path):
    _run_folder(tmp_path / "runs/a/one", "full", _rows([True, False, True]))
    manifest = tmp_path / "benchmarks" / "readme.json"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"tables": [_table(figure="records/readme/t.png")]}))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- kvpot-readme:t -->\nold 3/3\n<!-- /kvpot-readme:t -->\noutro\n")
    code, out, _ = run(capsys, "report", "--manifest", str(manifest), "--check", str(readme))
    assert code == 1 and "stale blocks: t" in out
    code, _, _ = run(capsys, "report", "--manifest", str(manifest), "--write", str(readme))
    text = readme.read_text()
    assert code == 0 and text.startswith("intro\n<!-- kvpot-readme:t -->\n") and text.endswith("outro\n")
    assert "| Full | 2/3 [0.21, 0.94]" in text and "old 3/3" not in text
    assert (tmp_path / "records/readme/t.png").stat().st_size > 1000
    code, out, _ = run(capsys, "report", "--manifest", str(manifest), "--check", str(readme))
    assert code == 0 and "1 blocks match" in out
    with pytest.raises(KvpotError, match="has no <!-- kvpot-readme:u -->"):
        replace_blocks(text, {"u": "x"})


def test_report_writes_blocks_wherever_they_live(capsys, tmp_path):
    """A block in docs/ is written and checked there, its figure linked relative to docs/; a table that no
    file holds is an error; with no file named, README.md and docs/*.md are the files."""
    _run_folder(tmp_path / "runs/a/one", "full", _rows([True, False, True]))
    manifest = tmp_path / "benchmarks" / "readme.json"
    manifest.parent.mkdir()
    manifest.write_text(json.dumps({"tables": [_table(figure="benchmarks/readme/t.png")]}))
    (tmp_path / "README.md").write_text("no blocks here\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "evaluation.md"
    page.write_text("<!-- kvpot-readme:t -->\nold\n<!-- /kvpot-readme:t -->\n")
    code, out, _ = run(capsys, "report", "--manifest", str(manifest), "--check")
    assert code == 1 and "evaluation.md: stale blocks: t" in out
    code, _, _ = run(capsys, "report", "--manifest", str(manifest), "--write")
    assert code == 0 and "](../benchmarks/readme/t.png)" in page.read_text()
    assert (tmp_path / "README.md").read_text() == "no blocks here\n"
    code, out, _ = run(capsys, "report", "--manifest", str(manifest), "--check",
                       str(tmp_path / "README.md"), str(page))
    assert code == 0 and "1 blocks match" in out
    with pytest.raises(KvpotError, match="holds the <!-- kvpot-readme:t -->"):
        placed(manifest, tmp_path, [tmp_path / "README.md"])
