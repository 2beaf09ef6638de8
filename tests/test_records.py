"""The recorded runs (records/) apart from the suite (benchmarks/), issue 44: every folder is indexed in
records/README.md, the index's folders exist, no console logs or undocumented figures are kept, records and
suite stay within the issue's size targets, packed and compressed records read back as the files they were
(`kvpot.eval.recorded`), and `kvpot report --plots RUN` redraws a run's figures from its results."""

from __future__ import annotations

import fnmatch
import gzip
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run

from kvpot.errors import KvpotError
from kvpot.eval import recorded
from kvpot.eval.plots import kind_of
from kvpot.eval.records import read

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


def _recorded_names() -> set[str]:
    """Every recorded file and folder below records/, plain or packed (kvpot.eval.recorded), relative to it."""
    names = set()
    for path in recorded.paths(RECORDS):
        rel = path.relative_to(RECORDS)
        names |= {rel.as_posix(), *(p.as_posix() for p in rel.parents if p != Path("."))}
    return names


def test_every_folder_the_figure_table_names_exists():
    names, missing = _recorded_names(), []
    for row in _rows(_section(INDEX.read_text(encoding="utf-8"), "Where each figure in README.md comes from")):
        cited = re.findall(r"`([^`]+)`", row[2])
        assert cited, row[2]
        first = cited[0].split(" ")[0].rstrip("/")
        if not (fnmatch.filter(names, first) or (ROOT / first).exists()):
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


def test_records_and_suite_stay_within_the_issue_44_targets():
    kept = [ROOT / p for p in _kept("*")]
    assert kept and all(p.is_file() for p in kept)
    size = sum(p.stat().st_size for p in kept)
    # issue 44: records and suite together in at most 500 files and 10 MB; pack new runs (records/README.md)
    assert len(kept) <= 500, f"{len(kept)} files in records/ and benchmarks/"
    assert size <= 10_000_000, f"{size:,} bytes in records/ and benchmarks/"


def _eval_run(folder: Path, date: str, answers: list[bool], first: int = 0) -> None:
    """A minimal `kvpot eval` run folder: config.json and results.jsonl."""
    folder.mkdir(parents=True)
    config = {"date": date, "model": "m", "device": "cpu", "dtype": "float32", "config": {},
              "methods": {"full": {"spec": "full"}}}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    rows = [{"method": "full", "task": "passkey", "length": 2048, "depth": 0.5, "sample": i, "seed": i, "correct": ok,
             "score": float(ok), "stats": {"prefill_seconds": 0.1 * i}} for i, ok in enumerate(answers, first)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _pack(folder: Path) -> None:
    """Pack every JSON / JSONL file below `folder` into its results.jsonl.gz, as records/ is packed."""
    entries = {}
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl")):
        text = path.read_text()
        name = path.relative_to(folder).as_posix()
        try:
            entries[name] = json.loads(text) if path.suffix == ".json" else [json.loads(x) for x in text.splitlines()]
        except ValueError:
            entries[name] = recorded.Verbatim(text)
        path.unlink()
    for empty in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        empty.rmdir()
    with gzip.open(folder / recorded.PACK, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(recorded.pack_lines(entries)) + "\n")


def test_packed_and_compressed_records_read_back_as_the_files_they_were(tmp_path):
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    for root in (plain, packed):
        _eval_run(root / "grid" / "a", "2026-11-01", [True, False, True])
        _eval_run(root / "grid" / "deeper" / "b", "2026-11-02", [False, False], first=3)
        (root / "grid" / "sweep.jsonl").write_text('{"n": 1}\nrc=0 24 s\n')  # a console line appended
    _pack(packed / "grid")
    assert sorted(p.name for p in (packed / "grid").iterdir()) == [recorded.PACK]
    before, after = read(plain, ["grid"]), read(packed, ["grid"])
    assert len(after.rows) == 5 and after.rows == before.rows and after.runs == before.runs == {
        "grid/a": "2026-11-01", "grid/deeper/b": "2026-11-02"}
    assert [p.relative_to(packed).as_posix() for p in recorded.files(packed, "config.json")] == [
        "grid/a/config.json", "grid/deeper/b/config.json"]
    assert recorded.files(packed / "grid" / "deeper", "results.jsonl") == [packed / "grid/deeper/b/results.jsonl"]
    assert recorded.is_dir(packed / "grid" / "deeper") and not recorded.is_dir(packed / "grid" / "c")
    assert recorded.exists(packed / "grid/a/config.json") and not recorded.exists(packed / "grid/a/summary.json")
    assert recorded.read_json(packed / "grid/a/config.json") == json.loads((plain / "grid/a/config.json").read_text())
    text = recorded._packed(packed / "grid/sweep.jsonl")
    assert text == (plain / "grid/sweep.jsonl").read_text()  # not JSONL: kept whole, byte for byte
    with pytest.raises(ValueError):
        recorded.read_jsonl(packed / "grid/sweep.jsonl")  # ... and as unreadable as the plain file
    rows = recorded.read_jsonl(packed / "grid/a/results.jsonl")
    rows[0]["correct"] = "changed"  # a caller's change never reaches the cached pack
    assert recorded.read_jsonl(packed / "grid/a/results.jsonl")[0]["correct"] is True
    with pytest.raises(KvpotError, match="no recorded file"):
        recorded.read_json(packed / "grid/a/summary.json")


def test_one_compressed_file_reads_as_the_plain_one(tmp_path):
    summary = {"mode": "decode", "rows": [{"ms": 9.19}], "text": "é"}
    (tmp_path / "results.json.gz").write_bytes(gzip.compress(json.dumps(summary).encode("utf-8")))
    rows = [{"method": "full", "i": i} for i in range(3)]
    with gzip.open(tmp_path / "results.jsonl.gz", "wt", encoding="utf-8") as handle:  # one run's rows, not a pack
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    assert recorded.read_json(tmp_path / "results.json") == summary
    assert recorded.read_jsonl(tmp_path / "results.jsonl") == rows
    assert recorded.files(tmp_path, "results.jsonl") == [tmp_path / "results.jsonl"]
    assert kind_of(tmp_path) == "bench"


def test_report_plots_draws_a_packed_run(capsys, tmp_path):
    run_folder = RECORDS / "reference-model" / "passkey-8k"
    assert not run_folder.exists() and recorded.exists(run_folder / "summary.json")  # packed
    code, out, _ = run(capsys, "report", "--plots", str(run_folder), "--out", str(tmp_path))
    assert code == 0 and "of 1 run" in out
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
