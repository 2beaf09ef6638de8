"""`kvpot eval --time-limit` and `--resume`: a stopped run still reports, and a second run completes it.

Time is simulated where the outcome must be exact: `kvpot.eval.limits._now` is replaced by a clock that
reads how much work is on disk (100 s per row of results.jsonl, 10 s per kvpress answer), so "the
deadline is near" falls after a known number of samples whatever the machine's speed. The SIGTERM test
uses real processes and a real signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run
from kvpot.eval import limits

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = ["eval", "passkey", "--method", "streaming:window=60", "--method", "full", "--budget", "128",
        "--set", "chunk_size=64", "--lengths", "256,512", "--depths", "0.2,0.8", "--samples", "2",
        "--templates", "0", "--max-new-tokens", "3"]
FIELDS = ("method", "task", "length", "depth", "template", "chat", "sample", "prediction")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def identity(rows) -> list[tuple]:
    return sorted(tuple(r[f] for f in FIELDS) for r in rows)


def clock_of(path: Path, seconds: float):
    """A clock that advances `seconds` per line written to `path`."""
    return lambda: seconds * (len(path.read_text().splitlines()) if path.exists() else 0)


def test_a_time_limit_stops_early_and_resume_completes_the_same_rows(capsys, tiny_dir, tmp_path, monkeypatch):
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(whole))[0] == 0
    # each sample (one group: 2 methods' rows) takes 200 s; with 10 s kept for the summary, a 650 s limit
    # starts samples at 0, 200 and 400 s and none at 600 s (450 > 210, 250 > 210, 50 < 210)
    monkeypatch.setattr(limits, "_now", clock_of(part / "results.jsonl", 100.0))
    code, stdout, _ = run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(part), "--time-limit", "650")
    assert code == 0 and "stopped (time limit): 10 of 16 rows not run" in stdout
    first = (part / "results.jsonl").read_text()
    assert len(rows_of(part / "results.jsonl")) == 6
    summary = json.loads((part / "summary.json").read_text())
    assert summary["completion"] == {
        "samples_planned": 8, "rows_planned": 16, "rows": 6, "rows_not_run": 10,
        "not_run_by_method": {"streaming": 5, "full": 5}, "stopped_by": "time limit",
        "time_limit": 650.0, "rows_from_before": 0}
    assert json.loads((part / "config.json").read_text())["completion"] == summary["completion"]
    assert summary["intervals"]["full"]["256"]["total"] == 3 and summary["intervals"]["full"]["512"]["total"] == 0
    assert "stopped at the time limit (650 s): 10 of 16 planned rows not run" in (part / "summary.md").read_text()

    # another set of options is another set of samples: refused before anything is touched
    for other in (["--samples", "3"], ["--lengths", "256"], ["--method", "tova"]):
        code, _, err = run(capsys, *ARGS, *other, "--model", str(tiny_dir), "--out", str(part), "--resume")
        assert code == 2 and "--resume" in err and "give the same options" in err
    assert (part / "results.jsonl").read_text() == first

    code, stdout, _ = run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(part), "--resume", "--batch-size", "2")
    assert code == 0 and "stopped" not in stdout
    text = (part / "results.jsonl").read_text()
    assert text.startswith(first)  # the rows written before stay, the rest is appended
    assert identity(rows_of(part / "results.jsonl")) == identity(rows_of(whole / "results.jsonl"))
    summary = json.loads((part / "summary.json").read_text())
    assert summary["completion"]["rows_not_run"] == 0 and summary["completion"]["rows_from_before"] == 6
    assert summary["intervals"] == json.loads((whole / "summary.json").read_text())["intervals"]
    assert "not run" not in (part / "summary.md").read_text()
    # resuming a complete run answers nothing
    assert run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(part), "--resume")[0] == 0
    assert (part / "results.jsonl").read_text() == text


def test_a_ruler_run_resumes_to_the_rows_of_one_run(capsys, tiny_dir, tmp_path, monkeypatch):
    argv = ["eval", "ruler", "--tasks", "niah_single_1,vt", "--lengths", "400", "--samples", "1", "--templates",
            "0,1", "--method", "full", "--max-new-tokens", "2", "--model", str(tiny_dir)]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run(capsys, *argv, "--out", str(whole))[0] == 0
    monkeypatch.setattr(limits, "_now", clock_of(part / "results.jsonl", 100.0))
    assert run(capsys, *argv, "--out", str(part), "--time-limit", "250")[0] == 0  # 2 of 4 items (150 > 110)
    assert len(rows_of(part / "results.jsonl")) == 2
    assert "2 of 4 planned rows not run" in (part / "summary.md").read_text()
    assert run(capsys, *argv, "--out", str(part), "--resume")[0] == 0
    key = lambda r: (r["subtask"], r["id"], r["template"], r["length"], r["prediction"])  # noqa: E731
    assert sorted(map(key, rows_of(part / "results.jsonl"))) == sorted(map(key, rows_of(whole / "results.jsonl")))


def test_a_limit_spent_before_the_first_sample_still_writes_a_summary(capsys, tiny_dir, tmp_path):
    out = tmp_path / "none"
    code, _, _ = run(capsys, *ARGS, "--model", str(tiny_dir), "--out", str(out), "--time-limit", "0.001")
    assert code == 0 and rows_of(out / "results.jsonl") == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completion"]["rows_not_run"] == 16 and summary["completion"]["stopped_by"] == "time limit"
    assert summary["intervals"]["full"]["256"]["total"] == 0 and (out / "accuracy.png").exists()


def test_a_resume_in_an_empty_folder_is_a_fresh_run_and_options_are_checked(capsys, tmp_path):
    from kvpot.errors import KvpotError
    from kvpot.eval.config import EvalConfig

    for bad in (0, -1, float("inf"), True, "5"):
        with pytest.raises(KvpotError, match="--time-limit"):
            EvalConfig("passkey", ["full"], tmp_path / "o", time_limit=bad)
    with pytest.raises(KvpotError, match="not perplexity"):
        EvalConfig("perplexity", ["full"], tmp_path / "o", lengths=[512], resume=True)
    from kvpot.eval.resume import load

    assert load(EvalConfig("passkey", ["full"], tmp_path / "new", resume=True), suite=False).rows == []


def test_a_cut_last_line_is_dropped_and_repaired(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": ')
    assert limits.read_jsonl(path) == [{"a": 1}, {"a": 2}] and path.read_text().endswith('{"a": ')
    assert limits.read_jsonl(path, repair=True) == [{"a": 1}, {"a": 2}]
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n'
    assert limits.read_jsonl(tmp_path / "absent.jsonl") == []


def test_a_sigterm_is_held_while_rows_are_written(monkeypatch):
    stop = limits.Terminate()
    with stop.installed():
        with pytest.raises(limits.Interrupted):
            with stop.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler runs here, and must wait for the end of the block
                written = True
        assert written
        os.kill(os.getpid(), signal.SIGTERM)  # a second one: the run is already finishing
        time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ---------------------------------------------------------------------------- kvpress

from kvpress_stand_in import write_stand_in  # noqa: E402



@pytest.fixture
def kvpress_site(tmp_path):
    return write_stand_in(tmp_path / "kvpress-site")


def write_cases(path: Path, count: int) -> None:
    with open(path, "w") as handle:
        for case in range(count):
            handle.write(json.dumps({"case": case, "key": f"k{case}", "context_ids": [1, *range(5, 45 + case)],
                                     "question_ids": [7, 8, 9], "max_new_tokens": 2, "eos_ids": [2]}) + "\n")


def test_the_worker_stops_at_its_deadline_and_resumes_without_asking_again(tiny_dir, tmp_path, kvpress_site,
                                                                          monkeypatch, capsys):
    from kvpot.eval import kvpress_worker
    from test_bench_kvpress import _import_fake

    monkeypatch.setitem(sys.modules, "kvpress", _import_fake(kvpress_site))
    cases, out = tmp_path / "cases.jsonl", tmp_path / "answers.jsonl"
    write_cases(cases, 2)
    argv = ["--cases", str(cases), "--model-dir", str(tiny_dir), "--press", "snapkv", "--ratios", "0.25,0.5",
            "--device", "cpu", "--dtype", "float32", "--out", str(out)]
    # 10 s per answer: at a 25 s deadline the third would end at 30 s, so it is not started
    monkeypatch.setattr(limits, "_now", clock_of(out, 10.0))
    assert kvpress_worker.main([*argv, "--deadline", "25"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["answers"], report["already"], report["left"], report["stopped"]) == (2, 0, 2, "deadline")
    assert [(a["key"], a["ratio"]) for a in rows_of(out)] == [("k0", 0.25), ("k0", 0.5)]
    assert kvpress_worker.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (report["answers"], report["already"], report["left"], report["stopped"]) == (2, 2, 0, None)
    assert [(a["key"], a["ratio"]) for a in rows_of(out)] == [("k0", 0.25), ("k0", 0.5), ("k1", 0.25), ("k1", 0.5)]
    assert kvpress_worker.main([*argv, "--deadline", "0"]) == 0  # nothing left: nothing to stop
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["already"] == 4


@pytest.mark.slow
def test_kvpress_answers_of_a_run_stopped_by_sigterm_become_rows(tiny_dir, tmp_path, kvpress_site):
    out = tmp_path / "eval"
    argv = [sys.executable, "-m", "kvpot", "eval", "passkey", "--baseline", "kvpress", "--press", "snapkv",
            "--compression-ratios", "0.5", "--kvpress-path", str(kvpress_site), "--lengths", "300", "--depths",
            "0.2,0.5,0.8", "--samples", "2", "--templates", "0", "--max-new-tokens", "2", "--model", str(tiny_dir),
            "--out", str(out), "--resume"]
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "STAND_IN_SLEEP": "3", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    # as `timeout` does: SIGTERM to the whole process group, the kvpress worker included
    process = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    answers = out / "kvpress-snapkv-answers.jsonl"
    began = time.monotonic()
    while not (answers.exists() and answers.read_text().count("\n") >= 1):
        assert process.poll() is None and time.monotonic() - began < 120, process.communicate()
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + 15, err.decode()[-2000:]
    rows = rows_of(out / "results.jsonl")
    given = rows_of(answers)
    assert 1 <= len(rows) == len(given) < 6 and {r["method"] for r in rows} == {"kvpress:snapkv@0.5"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completion"]["stopped_by"] == "SIGTERM"
    assert summary["completion"]["rows_not_run"] == 6 - len(rows)
    assert summary["intervals"]["kvpress:snapkv@0.5"]["300"]["total"] == len(rows)
    # the same command again, with a fast press: the answered cases are not asked again
    done = subprocess.run(argv, env={**env, "STAND_IN_SLEEP": "0"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = rows_of(out / "results.jsonl")
    assert len(rows) == 6 and len({(r["depth"], r["sample"]) for r in rows}) == 6
    assert len(rows_of(answers)) == 6  # each case answered once
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completion"]["rows_not_run"] == 0 and summary["kvpress"]["snapkv"]["answers"] == 6 - len(given)
