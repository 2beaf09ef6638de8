"""Key formats as a dimension of the evaluation protocol (issue 32, `kvpot eval --key-formats`): every cell's
samples in each format asked for, seeded, balanced; the default is the protocol as it was (same cases, same
resume keys); a resumed run across formats equals one run; the spread over formats in tables and reports."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from conftest import run
from kvpot.errors import KvpotError
from kvpot.eval import limits
from kvpot.eval.config import EvalConfig, parse_key_formats
from kvpot.eval.stats import accuracy_stats, key_format_of

FORMATS = ["digits", "uuid", "words"]


@pytest.fixture(scope="module")
def tokenizer():
    from kvpot.models.reference.tokenizer import build_tokenizer

    return build_tokenizer()


def cases_of(tokenizer, tmp_path, task="passkey", **kw):
    from kvpot.eval.runner import task_cases

    config = EvalConfig(task=task, methods=["full"], out=tmp_path / "x", lengths=[300], depths=[0.2, 0.8],
                        samples=2, **kw)
    count, cases = task_cases(config, tokenizer, [tokenizer.bos_token_id])
    cases = list(cases)
    assert count == len(cases)
    return cases


def test_parse_key_formats():
    assert parse_key_formats(None) is None and parse_key_formats("task") is None
    assert parse_key_formats("uuid, digits,uuid") == ["uuid", "digits"]
    with pytest.raises(KvpotError, match="empty"):
        parse_key_formats(" , ")


@pytest.mark.parametrize("task,kw,message", [
    ("passkey", {"key_formats": ["digits", "hex"]}, "digits, words, uuid, not 'hex'"),
    ("kv", {"key_formats": ["uuid"]}, "passkey, niah"),
    ("vt", {"key_formats": ["digits"]}, "passkey, niah"),
    ("ruler", {"key_formats": ["uuid"]}, "RULER's niah tasks fix their own formats"),
    ("passkey", {"key_formats": ["uuid"], "task_options": {"key_format": "words"}}, "drop --task-set key_format"),
    ("niah", {"key_formats": ["uuid"], "task_options": {"value_format": "words"}}, "drop --task-set value_format"),
])
def test_an_unsupported_key_format_is_refused(tmp_path, task, kw, message):
    with pytest.raises(KvpotError, match=message):
        EvalConfig(task=task, methods=["full"], out=tmp_path / "x", **kw)


def test_formats_are_balanced_over_every_cell_and_seeded(tokenizer, tmp_path):
    from kvpot.eval.config import sample_seed
    from kvpot.tasks.keys import format_of

    cases = cases_of(tokenizer, tmp_path, key_formats=FORMATS, templates=[0, 1])
    assert len(cases) == 2 * 2 * 3 * 2  # depths x templates x formats x samples (no chat template: plain only)
    per_cell = Counter((c.row["depth"], c.row["template"], c.row["key_format"]) for c in cases)
    assert set(per_cell.values()) == {2} and len(per_cell) == 2 * 2 * 3  # every format in every cell, 2 each
    for case in cases:
        fmt = case.row["key_format"]
        assert format_of(case.answers[0]) == fmt and case.row["task_options"]["key_format"] == fmt
        tail = None if fmt == "digits" else fmt  # passkey's own format keeps the seeds it had
        assert case.row["seed"] == sample_seed(0, case.row["sample"], 300, case.row["depth"], case.row["template"],
                                               False, tail)
    assert len({c.row["seed"] for c in cases}) == len(cases)  # each format its own samples
    again = cases_of(tokenizer, tmp_path, key_formats=FORMATS, templates=[0, 1])
    assert [(c.key, c.context_ids, c.answers) for c in again] == [(c.key, c.context_ids, c.answers) for c in cases]
    # the task's own format is the very sample of a run without --key-formats
    plain = {(c.row["depth"], c.row["template"], c.row["sample"]): c for c in cases_of(tokenizer, tmp_path,
                                                                                       templates=[0, 1])}
    for case in (c for c in cases if c.row["key_format"] == "digits"):
        old = plain[case.row["depth"], case.row["template"], case.row["sample"]]
        assert (case.context_ids, case.answers, case.row["seed"]) == (old.context_ids, old.answers, old.row["seed"])
        assert case.key != old.key  # but the key says which protocol asked for it


def test_niah_spreads_its_values_over_the_formats(tokenizer, tmp_path):
    from kvpot.tasks.keys import format_of

    cases = cases_of(tokenizer, tmp_path, task="niah", key_formats=["uuid", "words"], templates=[0])
    for case in cases:
        assert case.row["task_options"]["value_format"] == case.row["key_format"] == format_of(case.answers[0])
        assert case.row["task_options"]["key_format"] == "words"  # the names keep niah's own format


def test_niah_word_values_never_equal_its_word_keys_and_old_draws_stay():
    import random

    from kvpot.tasks.keys import draw, draw_distinct

    for seed in range(300):  # 40 keys and 40 values of 2,756 pairs: most seeds clash at least once
        rng, twin = random.Random(seed), random.Random(seed)
        keys = draw(rng, 40, "words")
        values = draw_distinct(rng, keys, 40, "words")
        assert len(set(values)) == 40 and not set(values) & set(keys)
        draw(twin, 40, "words")
        first = draw(twin, 40, "words")
        if not set(first) & set(keys):
            assert values == first  # no clash: the draw made before clashes were redrawn
    with pytest.raises(KvpotError, match="distinct"):
        draw_distinct(random.Random(0), [str(v) for v in range(10, 100)], 1, "digits", 2)


def test_the_default_keeps_the_cases_and_resume_keys_of_before(tokenizer, tmp_path):
    from kvpot.tasks import make_sample

    cases = cases_of(tokenizer, tmp_path)  # passkey, every template, no --key-formats
    keys = [c.key for c in cases]
    # recorded from the code before key formats were a dimension (commit cb6d4e1)
    assert keys[:2] == ["[300, 0.2, 0, false, 0, 3281664992]", "[300, 0.2, 0, false, 1, 2006325654]"]
    assert hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:16] == "c888010e78ee9d4c"
    for case in cases:
        assert "key_format" not in case.row
        sample = make_sample("passkey", tokenizer, 300, case.row["depth"], case.row["seed"], "repeat",
                             case.row["template"])  # the old runner's call
        assert case.context_ids == [tokenizer.bos_token_id, *sample.context_ids]
        assert case.answers == sample.answers and case.row["task_options"] == sample.options


def test_accuracy_stats_spread_over_key_formats():
    rows = [{"correct": c, "score": float(c), "template": 0, "task": "passkey", "key_format": f,
             "task_options": {"key_format": f}}
            for f, c in [("digits", 1), ("digits", 1), ("uuid", 0), ("uuid", 1), ("words", 0), ("words", 0)]]
    stats = accuracy_stats(rows)
    assert stats["by_key_format"] == {"digits": 1.0, "uuid": 0.5, "words": 0.0}
    assert stats["key_format_spread"] == [0.0, 1.0] and (stats["correct"], stats["total"]) == (3, 6)
    assert accuracy_stats(rows[:2])["key_format_spread"] is None  # one format: no spread
    # rows without the field (runs before --key-formats) say theirs in their task options; niah's is its value
    assert key_format_of({"task": "passkey", "task_options": {"key_format": "uuid"}}) == "uuid"
    niah = {"task": "niah", "task_options": {"key_format": "words", "value_format": "digits"}}
    assert key_format_of(niah) == "digits"
    assert key_format_of({"task": "vt", "task_options": {}}) is None and key_format_of({"task": "passkey"}) is None

    from kvpot.eval.readme import _fmt_stats
    from kvpot.eval.records import describe_protocol
    from kvpot.eval.report import format_accuracy

    assert format_accuracy(0.5, stats) == "0.50 (3/6, 95% 0.19-0.81; key formats 0.00-1.00)"
    assert format_accuracy(0.5, stats, terminal=True).splitlines()[-1] == "fmt 0.00-1.00"
    assert _fmt_stats(stats) == "3/6 [0.19, 0.81] fmt 0.00-1.00"
    marked = [{**r, "protocol": "templated"} for r in rows]
    assert "key formats digits, uuid, words" in describe_protocol(marked)
    assert "key formats" not in describe_protocol(marked[:2])


ARGS = ["eval", "passkey", "--method", "streaming:window=60", "--method", "full", "--budget", "128",
        "--set", "chunk_size=64", "--lengths", "320", "--depths", "0.5", "--samples", "2", "--templates", "0",
        "--key-formats", "digits,uuid", "--max-new-tokens", "3"]
FIELDS = ("method", "length", "depth", "template", "key_format", "sample", "seed", "prediction")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.usefixtures("one_thread")
def test_a_run_across_formats_resumes_to_the_rows_of_one_run(capsys, tiny_dir, tmp_path, monkeypatch):
    whole, part = tmp_path / "whole", tmp_path / "part"
    code, stdout, _ = run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(whole))
    assert code == 0 and "fmt: over key formats digits,uuid" in stdout
    rows = rows_of(whole / "results.jsonl")
    assert Counter((r["method"], r["key_format"]) for r in rows) == {
        (m, f): 2 for m in ("streaming", "full") for f in ("digits", "uuid")}
    summary = json.loads((whole / "summary.json").read_text())
    by_format = summary["intervals_by_key_format"]["full"]
    assert by_format["digits"]["total"] == by_format["uuid"]["total"] == 2
    overall = summary["intervals_overall"]["full"]
    assert overall["by_key_format"] == {f: by_format[f]["accuracy"] for f in ("digits", "uuid")}
    assert (whole / "key_formats.png").stat().st_size > 1000
    assert "key formats digits,uuid" in (whole / "summary.md").read_text()

    results = part / "results.jsonl"
    written = lambda: len(results.read_text().splitlines()) if results.exists() else 0  # noqa: E731
    monkeypatch.setattr(limits, "_now", lambda: 100.0 * written())  # 100 s per row written
    assert run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(part), "--time-limit", "450")[0] == 0
    assert len(rows_of(part / "results.jsonl")) == 4  # 2 of the 4 samples (200 s each, 10 s kept)
    other = [a if a != "digits,uuid" else "digits,words" for a in ARGS]
    code, _, err = run(capsys, *other, "--model", str(tiny_dir), "--out", str(part), "--resume")
    assert code == 2 and "key_formats" in err and "give the same options" in err
    assert run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(part), "--resume")[0] == 0
    identity = lambda rs: sorted(tuple(r[f] for f in FIELDS) for r in rs)  # noqa: E731
    assert identity(rows_of(part / "results.jsonl")) == identity(rows)
    assert json.loads((part / "summary.json").read_text())["intervals"] == summary["intervals"]


def test_a_key_formats_table_has_a_column_per_format_and_one_pooled(tmp_path):
    from kvpot.eval.readme import cells, render
    from kvpot.eval.records import read

    run_dir = tmp_path / "runs" / "formats"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"date": "2026-11-26T00:00:00", "device": "cpu",
                                                     "methods": {"full": {"spec": "full"}}}))
    outcomes = {"digits": [1, 1, 1], "uuid": [0, 1, 0], "words": [0, 0, 0]}
    rows = [{"method": "full", "task": "passkey", "task_options": {"key_format": f}, "length": 1900, "depth": 0.5,
             "template": 0, "chat": False, "key_format": f, "sample": i, "seed": 10 * len(f) + i,
             "score": float(c), "correct": bool(c)} for f, cs in outcomes.items() for i, c in enumerate(cs)]
    (run_dir / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = {"name": "t", "title": "Formats.", "root": "runs", "folders": ["formats"], "task": "passkey",
             "kind": "key_formats", "lengths": [1900], "key_formats": FORMATS,
             "rows": [{"label": "Full", "spec": "full"}], "pending": "not yet"}
    stats, used = cells(table, read(tmp_path / "runs", ["formats"]))
    got = {head: (s["correct"], s["total"]) for head, s in stats["Full"].items()}
    assert got == {"1900 digits": (3, 3), "1900 uuid": (1, 3), "1900 words": (0, 3), "1900 all": (4, 9)}
    assert stats["Full"]["1900 all"]["key_format_spread"] == [0.0, 1.0]
    assert len(used) == 18  # each format's column, then all
    text = render(table, tmp_path)
    assert "key formats digits, uuid, words" in text and "| 1900 digits | 1900 uuid | 1900 words | 1900 all |" in text
    assert "4/9 [0.19, 0.73] fmt 0.00-1.00" in text and "fmt: the range of per-key-format accuracy" in text
