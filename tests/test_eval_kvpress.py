"""`kvpot eval --compression-ratios ... --baseline kvpress`: kvpot's methods and kvpress presses on the same cases.

The real kvpress needs transformers < 5.3; CI has a newer one. So the presses run, through the real
subprocess protocol (`kvpot.eval.kvpress_worker`, PYTHONPATH = the kvpress folder then kvpot's src/),
against a stand-in `kvpress` package written under tmp_path whose presses prune each layer's cache at
the end of the prefill forward, as kvpress' hooks do: SnapKVPress keeps the first entries, TOVAPress the
last, KnormPress fails. That checks what could break: the cases file, the ratios, decoding past the
pruned cache, scoring with the case's metric in kvpot's process, rows and intervals beside kvpot's.
"""

from __future__ import annotations

import json

import pytest

from conftest import run
from kvpot.errors import KvpotError

from kvpress_stand_in import write_stand_in



@pytest.fixture
def kvpress_site(tmp_path):
    return write_stand_in(tmp_path / "kvpress-site")


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ratios_and_kvpress_options_are_checked(tmp_path, kvpress_site):
    from kvpot.eval.config import EvalConfig
    from kvpot.eval.ratios import kept_entries, parse_ratios, ratio_runs
    from kvpot.methods.spec import MethodSpec

    assert parse_ratios("0.75,0.25,0.5,0.5") == [0.25, 0.5, 0.75]
    for bad in ("0", "1", "x", ""):
        with pytest.raises(KvpotError, match="compression-ratios"):
            parse_ratios(bad)
    assert kept_entries(4097, 0.75) == 1024 and kept_entries(3, 0.9) == 1
    with pytest.raises(KvpotError, match="give --compression-ratios"):
        EvalConfig("passkey", ["full"], tmp_path / "o", baselines=["kvpress"], kvpress_path=str(kvpress_site))
    with pytest.raises(KvpotError, match="kvpress' own environment"):
        EvalConfig("passkey", ["full"], tmp_path / "o", baselines=["kvpress"], compression_ratios=[0.5])
    with pytest.raises(KvpotError, match="add --baseline kvpress"):
        EvalConfig("passkey", ["full"], tmp_path / "o", presses=["tova"])
    with pytest.raises(KvpotError, match="unknown kvpress press 'h2o'"):
        EvalConfig("passkey", ["full"], tmp_path / "o", baselines=["kvpress"], compression_ratios=[0.5],
                   presses=["h2o"], kvpress_path=str(kvpress_site))
    specs = [MethodSpec.parse("full"), MethodSpec.parse("streaming"), MethodSpec.parse("tova:chunk_size=64")]
    runs = ratio_runs(specs, [0.25, 0.75], {}, None, 1024)
    assert [r.label for r in runs] == ["full", "streaming@0.25", "streaming@0.75", "tova@0.25", "tova@0.75"]
    assert runs[2].method_for(1001).window == kept_entries(1001, 0.75) - 4  # streaming: sinks + window = budget
    assert runs[3].method_for(1001).config()["chunk_size"] == 64  # the spec's own parameters stay
    with pytest.raises(KvpotError, match="exclude each other"):
        ratio_runs(specs, [0.5], {}, 512, 1024)
    with pytest.raises(KvpotError, match="exclude each other"):
        ratio_runs([MethodSpec.parse("tova:budget=64")], [0.5], {}, None, 1024)


@pytest.mark.slow
def test_presses_answer_the_same_cases_as_kvpots_methods(capsys, tiny_dir, tmp_path, kvpress_site):
    out = tmp_path / "eval"
    code, stdout, _ = run(capsys, "eval", "passkey", "--method", "full", "--method", "streaming",
                          "--compression-ratios", "0.5,0.75", "--baseline", "kvpress", "--press", "snapkv",
                          "--press", "tova", "--press", "knorm", "--kvpress-path", str(kvpress_site),
                          "--lengths", "300", "--depths", "0.5", "--samples", "1", "--templates", "0,1",
                          "--max-new-tokens", "3", "--model", str(tiny_dir), "--out", str(out))
    assert code == 0, stdout
    rows = read_rows(out / "results.jsonl")
    labels = {r["method"] for r in rows}
    assert labels == {"full", "streaming@0.5", "streaming@0.75", "kvpress:snapkv@0.5", "kvpress:snapkv@0.75",
                      "kvpress:tova@0.5", "kvpress:tova@0.75"}  # knorm failed: no column
    cases = {label: sorted((r["template"], r["sample"], r["seed"]) for r in rows if r["method"] == label)
             for label in labels}
    assert len({tuple(v) for v in cases.values()}) == 1 and len(cases["full"]) == 2  # the same two cases
    for r in rows:
        if r["method"].startswith("kvpress:"):
            n = r["stats"]["context_tokens"]
            assert n == 301 and r["stats"]["kept_entries"] == int(n * (1 - r["compression_ratio"]))
            assert r["stats"]["kv_entries_per_layer"] == [r["stats"]["kept_entries"]] * 2
            assert r["stats"]["max_kv_entries"] == n and 1 <= r["stats"]["new_tokens"] <= 3
        elif r["method"] != "full":
            assert r["method_config"]["window"] + 4 == int(301 * (1 - r["compression_ratio"]))
    # the press's answers are what kvpress' protocol gives in this process, decoded and scored here
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpot.eval.kvpress_worker import answer
    from kvpot.tasks import score
    from test_bench_kvpress import _import_fake

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    model.set_attn_implementation("sdpa")
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    from kvpot.eval.config import EvalConfig
    from kvpot.eval.runner import task_cases

    config = EvalConfig("passkey", ["full"], tmp_path / "x", lengths=[300], depths=[0.5], samples=1,
                        templates=[0, 1], max_new_tokens=3)
    _, produced = task_cases(config, tokenizer, [tokenizer.bos_token_id])
    fake = _import_fake(kvpress_site)
    for case in produced:
        mine = next(r for r in rows if r["method"] == "kvpress:tova@0.75" and r["template"] == case.row["template"])
        with torch.no_grad():
            tokens, kept, _ = answer(model, fake.TOVAPress(compression_ratio=0.75), torch.tensor(case.context_ids),
                                     torch.tensor(case.question_ids), 3, {tokenizer.eos_token_id})
        assert mine["prediction"] == tokenizer.decode(tokens, skip_special_tokens=True)
        assert mine["score"] == score("passkey", mine["prediction"], case.answers) and kept == [75, 75]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["methods"]) == labels
    assert summary["kvpress"]["tova"]["versions"]["kvpress"] == "0.0-eval-test"
    assert "stand-in failure" in summary["kvpress"]["knorm"]["error"]
    assert summary["intervals"]["kvpress:tova@0.75"]["300"]["total"] == 2
    assert summary["methods"]["kvpress:tova@0.5"]["family"] == "kvpress:tova"
    text = (out / "summary.md").read_text()
    assert "## Score by compression ratio" in text and "| kvpress:tova |" in text and "| streaming |" in text
    assert (out / "ratios.png").stat().st_size > 1000 and not (out / "kvpress-cases.jsonl").exists()


@pytest.mark.slow
def test_a_folder_without_kvpress_skips_the_presses_not_the_run(capsys, tiny_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "eval"
    code, _, _ = run(capsys, "eval", "niah", "--method", "snapkv", "--compression-ratios", "0.5", "--baseline",
                     "kvpress", "--press", "snapkv", "--kvpress-path", str(empty), "--lengths", "300", "--depths",
                     "0.5", "--samples", "1", "--templates", "0", "--max-new-tokens", "2", "--model", str(tiny_dir),
                     "--out", str(out))
    assert code == 0
    assert {r["method"] for r in read_rows(out / "results.jsonl")} == {"snapkv@0.5"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kvpress"]["snapkv"]["skipped"].startswith("cannot import kvpress") and str(empty) in \
        summary["kvpress"]["snapkv"]["skipped"]


@pytest.mark.slow
def test_presses_alone_are_the_columns_of_a_ruler_run(capsys, tiny_dir, tmp_path, kvpress_site):
    out = tmp_path / "ruler"
    code, _, err = run(capsys, "eval", "ruler", "--tasks", "niah_single_1,vt", "--lengths", "400", "--samples", "1",
                       "--templates", "0,1", "--baseline", "kvpress", "--press", "tova", "--compression-ratios",
                       "0.5", "--kvpress-path", str(kvpress_site), "--max-new-tokens", "2", "--model", str(tiny_dir),
                       "--out", str(out))
    assert code == 0, err
    rows = read_rows(out / "results.jsonl")
    assert {r["method"] for r in rows} == {"kvpress:tova@0.5"} and len(rows) == 4
    assert sorted((r["subtask"], r["template"]) for r in rows) == [("niah_single_1", 0), ("niah_single_1", 1),
                                                                  ("vt", 0), ("vt", 1)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["intervals_by_group"]["kvpress:tova@0.5"]["400"]["total"] == 4
    code, _, err = run(capsys, "eval", "ruler", "--lengths", "400", "--out", str(tmp_path / "none"))
    assert code == 2 and "give at least one --method" in err
