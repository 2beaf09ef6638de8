"""The recorded runs (records/) apart from the suite (benchmarks/), issue 44: every folder is indexed in
records/README.md, the index's folders exist, no console logs or undocumented figures are kept, and
`kvpot report --plots RUN` redraws a run's figures from its results."""

from __future__ import annotations

import glob
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "records"
INDEX = RECORDS / "README.md"


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows[1:]  # the header


def unindexed(records: Path) -> list[str]:
    """Folders of `records` that no row of its README.md's Folders table names (by `FOLDER/...`)."""
    named = {re.match(r"`([^/`]+)/", row[0]).group(1) for row in _rows(_section((records / "README.md").read_text(
        encoding="utf-8"), "Folders")) if re.match(r"`([^/`]+)/", row[0])}
    return sorted(p.name for p in records.iterdir() if p.is_dir() and p.name not in named)


def test_every_records_folder_is_in_the_index():
    assert unindexed(RECORDS) == [], "add a row to the Folders table of records/README.md"


def test_an_unindexed_folder_fails(tmp_path):
    (tmp_path / "indexed").mkdir()
    (tmp_path / "forgotten").mkdir()
    (tmp_path / "README.md").write_text("# x\n\n## Folders\n\n| folder | what |\n| --- | --- |\n"
                                        "| `indexed/` | a run |\n")
    assert unindexed(tmp_path) == ["forgotten"]


def test_every_folder_the_figure_table_names_exists():
    missing = []
    for row in _rows(_section(INDEX.read_text(encoding="utf-8"), "Where each figure in README.md comes from")):
        cited = re.findall(r"`([^`]+)`", row[2])
        assert cited, row[2]
        first = cited[0].split(" ")[0].rstrip("/")
        if not (glob.glob(str(RECORDS / first)) or (ROOT / first).exists()):
            missing.append(first)
    assert missing == []


def _kept(pattern: str) -> list[Path]:
    """The files of records/ and benchmarks/ matching `pattern` that git tracks (all of them outside a checkout)."""
    done = subprocess.run(["git", "ls-files", "--", f"records/{pattern}", f"benchmarks/{pattern}"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return [Path(line) for line in done.stdout.splitlines()]
    return [p.relative_to(ROOT) for d in (RECORDS, ROOT / "benchmarks") for p in d.rglob(pattern)]


def test_no_console_logs_and_only_the_figures_documents_show():
    assert _kept("*.log") == []
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *RECORDS.rglob("*.md")]
    shown = "\n".join(p.read_text(encoding="utf-8") for p in docs if p.is_file())
    pngs = _kept("*.png")
    assert len(pngs) <= 60
    for png in pngs:
        own = png.relative_to(png.parts[0]).as_posix()  # relative to records/
        assert png.as_posix() in shown or f"({png.relative_to(png.parents[1]).as_posix()})" in shown or \
            own.split("/", 1)[1] in shown, f"{png}: no document shows it; kvpot report --plots draws it"


def test_report_plots_redraws_a_bench_run_and_a_folder_of_eval_runs(capsys, tmp_path):
    started = time.time()
    code, out, _ = run(capsys, "report", "--plots", str(RECORDS / "bench-cpu-smoke"), "--out", str(tmp_path / "b"))
    assert code == 0 and "of 3 runs" in out
    for name in ("prefill/ttft.png", "decode/ms_per_token.png", "attention/attention_decode.png"):
        assert (tmp_path / "b" / name).stat().st_size > 1000
    code, out, _ = run(capsys, "report", "--plots", str(RECORDS / "standard-fixtures-cpu"), "--out",
                       str(tmp_path / "s"))
    assert code == 0 and (tmp_path / "s/longbench/scores.png").stat().st_size > 1000
    assert not [p for p in (RECORDS / "bench-cpu-smoke").rglob("*.png") if p.stat().st_mtime >= started]  # --out


@pytest.mark.parametrize("argv, fragment", [
    (["--plots", "nowhere"], "is not a folder"),
    (["--plots", "docs"], "holds no run kvpot can draw"),
    (["--check", "README.md", "--out", "x"], "--out is for --plots"),
])
def test_report_plots_errors_are_one_line(capsys, argv, fragment, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, _, err = run(capsys, "report", *argv)
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
