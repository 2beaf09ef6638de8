"""`kvpot eval`: argument parsing, method specs, one-line errors, and real runs on a tiny model.

The tiny model is random, so accuracy is ~0; these tests check the harness: every method reads the
same samples, rows and summaries hold what they claim, figures are real PNGs, and a crash keeps
the rows already written.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import assert_png, run
from kvpot.cli import main
from kvpot.errors import KvpotError
from kvpot.eval.common import special_prefix
from kvpot.eval.config import parse_depths, parse_length, parse_lengths, sample_seed
from kvpot.eval.perplexity import window_means
from kvpot.eval.stats import wilson_interval
from kvpot.methods.spec import MethodSpec, build_methods, method_labels
from kvpot.models.reference.tokenizer import BOS_ID, build_tokenizer



pytestmark = pytest.mark.usefixtures("one_thread")



def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]



# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "text, tokens",
    [("4096", 4096), ("2k", 2048), ("128K", 131072), ("1m", 1048576), ("1M", 1 << 20), ("1.5k", 1536), (" 8k ", 8192)],
)
def test_parse_length_reads_binary_units(text, tokens):
    assert parse_length(text) == tokens


@pytest.mark.parametrize("text", ["", "0", "-1", "2g", "k", "1.3", "2kk", "0.0001k"])
def test_parse_length_refuses_non_lengths(text):
    with pytest.raises(KvpotError):
        parse_length(text)


def test_parse_lengths_and_depths_sort_and_dedupe():
    """Tables and heatmaps need axes in order; a repeated value would double-count samples."""
    assert parse_lengths("8k,2k,2048,32k") == [2048, 8192, 32768]
    assert parse_depths("0.9,0.1,0.5,0.1") == [0.1, 0.5, 0.9]
    assert parse_depths("0,1") == [0.0, 1.0]
    for bad in ("1.5", "-0.1", "x", ""):
        with pytest.raises(KvpotError):
            parse_depths(bad)


def test_method_spec_parses_name_and_parameters():
    spec = MethodSpec.parse("streaming:window=1020,chunk_size=256")
    assert spec.name == "streaming"
    assert spec.overrides == {"window": "1020", "chunk_size": "256"}
    assert spec.text() == "streaming:window=1020,chunk_size=256"
    assert MethodSpec.parse("tova") == MethodSpec("tova", {})


@pytest.mark.parametrize("text", ["streaming:window", ":window=3", "streaming:window=1,window=2", "stream ing"])
def test_method_spec_refuses_malformed(text):
    with pytest.raises(KvpotError):
        MethodSpec.parse(text)


def test_labels_are_unique_when_a_method_is_given_twice():
    specs = [MethodSpec.parse(t) for t in ("streaming:window=1020", "streaming:window=2044", "tova")]
    assert method_labels(specs) == ["streaming[window=1020]", "streaming[window=2044]", "tova"]
    with pytest.raises(KvpotError, match="given twice"):
        method_labels([MethodSpec.parse("tova"), MethodSpec.parse("tova")])


def test_build_methods_applies_global_budget_and_settings_where_they_fit():
    """Comparing several methods: full ignores --budget, --set reaches only methods that have the key."""
    specs = [MethodSpec.parse(t) for t in ("full", "streaming", "tova:budget=64")]
    runs = build_methods(specs, budget=128, settings={"chunk_size": "32", "sinks": "2"})
    configs = {run.label: run.method.config() for run in runs}
    assert configs["full"] == {"method": "full", "chunk_size": 32}
    assert configs["streaming"]["sinks"] == 2 and configs["streaming"]["window"] == 126
    assert configs["tova"]["budget"] == 64  # its own budget wins over the global one
    assert configs["tova"]["chunk_size"] == 32


def test_build_methods_explicit_parameter_wins_over_budget():
    runs = build_methods([MethodSpec.parse("streaming:window=60"), MethodSpec.parse("tova")], 128, {})
    assert runs[0].method.window == 60
    assert runs[1].method.budget == 128


def test_build_methods_single_method_is_strict():
    with pytest.raises(KvpotError, match="takes no budget"):
        build_methods([MethodSpec.parse("full")], budget=128, settings={})
    with pytest.raises(KvpotError, match="unknown parameter"):
        build_methods([MethodSpec.parse("full")], budget=None, settings={"window": "3"})
    with pytest.raises(KvpotError, match="none of the methods"):
        build_methods([MethodSpec.parse("full"), MethodSpec.parse("tova")], None, {"colour": "red"})


def test_sample_seeds_are_stable_and_distinct():
    assert sample_seed(0, 1, 2048, 0.5) == sample_seed(0, 1, 2048, 0.5)
    seeds = {sample_seed(s, i, n, d) for s in (0, 1) for i in range(3) for n in (2048, 4096) for d in (0.1, 0.5)}
    assert len(seeds) == 24


def test_special_prefix_is_what_add_special_tokens_puts_first():
    assert special_prefix(build_tokenizer()) == [BOS_ID]

    class NoSpecials:
        bos_token_id = None

        def encode(self, text, add_special_tokens=False):
            return list(text.encode())

    assert special_prefix(NoSpecials()) == []


def test_window_means_cover_every_scored_token():
    nll = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    windows = window_means(nll, 2)
    assert [(w["start"], w["end"]) for w in windows] == [(1, 3), (3, 5), (5, 6)]
    assert [w["mean_nll"] for w in windows] == [2.0, 2.0, 5.0]
    assert windows[2]["perplexity"] == pytest.approx(math.exp(5.0))


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["nope", "--method", "tova"], "unknown task 'nope'"),
        (["passkey", "--method", "tova", "--lengths", "2x"], "is not a length"),
        (["passkey", "--method", "tova", "--depths", "0.5,1.5"], "outside [0, 1]"),
        (["passkey", "--method", "tova", "--samples", "0"], "--samples must be at least 1"),
        (["passkey", "--method", "tova", "--templates", "5"], "templates 0 to 2"),
        (["kv", "--method", "tova", "--templates", "0,1"], "kv has templates 0 to 0"),
        (["passkey", "--method", "nope"], "unknown method 'nope'"),
        (["passkey", "--method", "tova:colour=red"], "unknown parameter 'colour'"),
        (["passkey", "--method", "full", "--budget", "64"], "takes no budget"),
        (["passkey", "--method", "tova", "--task-set", "num_keys=4"], "has no option 'num_keys'"),
        (["passkey", "--method", "tova", "--method", "tova"], "given twice"),
        (["perplexity", "--method", "tova", "--lengths", "2k,4k"], "one --length"),
    ],
)
def test_eval_refuses_bad_input_in_one_line(capsys, tmp_path, argv, fragment):
    code, _, err = run(capsys, "eval", *argv, "--out", str(tmp_path / "out"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert fragment in lines[0]
    assert lines[0].startswith("kvpot eval: error:")


def test_eval_refuses_missing_out_parent(capsys, tmp_path):
    code, _, err = run(capsys, "eval", "passkey", "--method", "tova", "--out", str(tmp_path / "no" / "out"))
    assert code == 2
    assert "does not exist" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- real runs

EVAL_ARGS = [
    "eval", "passkey", "--method", "streaming:window=60", "--method", "streaming:window=120", "--method", "full",
    "--budget", "128", "--set", "chunk_size=64", "--lengths", "256,512", "--depths", "0.2,0.8", "--samples", "2",
    "--templates", "0",  # one wording keeps this fast (the default, all, triples the samples)
]


def test_eval_writes_results_summaries_and_figures(capsys, tiny_dir, tmp_path):
    out = tmp_path / "run"
    code, stdout, _ = run(capsys, *EVAL_ARGS, "--model", str(tiny_dir), "--out", str(out))
    assert code == 0
    labels = ["streaming[window=60]", "streaming[window=120]", "full"]

    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 2 * 2 * 2 * len(labels)
    fields = {"method", "method_config", "task", "task_options", "length", "depth", "seed", "answers",
              "prediction", "score", "correct", "stats"}
    assert all(fields <= set(row) for row in rows)
    assert {row["method"] for row in rows} == set(labels)
    # Every method answered the same samples: one seed and one answer per (length, depth, index).
    cells: dict = {}
    for row in rows:
        cells.setdefault((row["length"], row["depth"], row["sample"]), set()).add((row["seed"], tuple(row["answers"])))
    assert len(cells) == 8 and all(len(v) == 1 for v in cells.values())
    assert len({next(iter(v)) for v in cells.values()}) == 8  # and different samples per cell
    for row in rows:
        assert row["stats"]["context_tokens"] == row["length"] + 1  # + BOS
        if row["method"] == "streaming[window=60]":
            assert row["method_config"]["window"] == 60
            assert row["stats"]["max_kv_entries"] <= 4 + 60 + 64
        if row["method"] == "full":
            assert "budget" not in row["method_config"]  # full ignored --budget
            assert row["stats"]["max_kv_entries"] >= row["length"]

    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["methods"]) == labels
    assert set(summary["accuracy"]["full"]) == {"256", "512"}
    assert set(summary["accuracy_by_depth"]["full"]["512"]) == {"0.2", "0.8"}
    for label in labels:
        mine = [r for r in rows if r["method"] == label and r["length"] == 512]
        assert summary["accuracy"][label]["512"] == pytest.approx(sum(r["score"] for r in mine) / len(mine))
        assert summary["cost"][label]["peak_kv_entries"] == max(r["stats"]["max_kv_entries"] for r in rows
                                                                if r["method"] == label)
    assert summary["config"]["lengths"] == [256, 512] and summary["model"] == str(tiny_dir)
    assert {"kvpot", "torch", "transformers"} <= set(summary["versions"]) and summary["device"] == "cpu"
    assert json.loads((out / "config.json").read_text())["config"] == summary["config"]

    markdown = (out / "summary.md").read_text()
    assert all(label in markdown for label in labels) and "| 20% |" in markdown
    for name in ("heatmap_streaming_window=60.png", "heatmap_streaming_window=120.png", "heatmap_full.png",
                 "accuracy.png"):
        assert_png(out / name)
    # ONE comparison table on the terminal, holding both settings of streaming.
    assert stdout.count("accuracy by context length") == 1
    assert all(label in stdout for label in labels)


def test_eval_keeps_finished_rows_when_a_run_crashes(capsys, tiny_dir, tmp_path, monkeypatch):
    from kvpot.engine import Engine

    real, calls = Engine.generate_ids, []

    def crash_on_fourth(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("out of memory (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate_ids", crash_on_fourth)
    out = tmp_path / "crash"
    with pytest.raises(RuntimeError):
        main([*EVAL_ARGS, "--model", str(tiny_dir), "--out", str(out)])
    capsys.readouterr()
    rows = read_rows(out / "results.jsonl")
    assert len(rows) == 3 and rows[0]["method"] == "streaming[window=60]"
    assert (out / "config.json").exists() and not (out / "summary.json").exists()


def test_eval_task_options_reach_the_samples(capsys, tiny_dir, tmp_path):
    out = tmp_path / "niah"
    code, _, _ = run(capsys, "eval", "niah", "--method", "streaming", "--budget", "64", "--set", "chunk_size=64",
                     "--task-set", "num_keys=3", "--lengths", "384", "--depths", "0.5", "--samples", "1",
                     "--templates", "0", "--max-new-tokens", "4", "--model", str(tiny_dir), "--out", str(out))
    assert code == 0
    (row,) = read_rows(out / "results.jsonl")
    assert row["task_options"]["num_keys"] == 3
    assert row["stats"]["new_tokens"] <= 4


def test_eval_reports_wilson_intervals_and_template_spread(capsys, tiny_dir, tmp_path):
    out = tmp_path / "templates"
    code, stdout, _ = run(capsys, "eval", "passkey", "--method", "full", "--lengths", "384", "--depths", "0.5",
                          "--samples", "2", "--templates", "0,2", "--max-new-tokens", "2", "--model", str(tiny_dir),
                          "--out", str(out))
    assert code == 0
    rows = read_rows(out / "results.jsonl")
    assert sorted((r["template"], r["sample"]) for r in rows) == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert len({r["seed"] for r in rows}) == 4  # each template reads its own samples
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["templates"] == [0, 2]
    cell = summary["intervals"]["full"]["384"]
    correct = sum(r["correct"] for r in rows)
    assert (cell["correct"], cell["total"]) == (correct, 4)
    assert cell["wilson95"] == pytest.approx(list(wilson_interval(correct, 4)))
    assert set(cell["by_template"]) == {"0", "2"}
    assert cell["template_spread"] == [min(cell["by_template"].values()), max(cell["by_template"].values())]
    assert summary["intervals_by_depth"]["full"]["384"]["0.5"]["total"] == 4
    assert summary["intervals_overall"]["full"]["total"] == 4
    assert f"{correct}/4" in stdout and "tpl" in stdout and "95%" in stdout
    assert f"{correct}/4, 95%" in (out / "summary.md").read_text()
    assert_png(out / "accuracy.png")


def test_templates_option_is_checked(tmp_path):
    from kvpot.eval.config import EvalConfig, parse_templates

    assert parse_templates("all") is None and parse_templates("2,0,2") == [0, 2]
    assert EvalConfig("niah", ["full"], tmp_path / "o").templates == [0, 1, 2]
    assert EvalConfig("kv", ["full"], tmp_path / "o").templates == [0]
    with pytest.raises(KvpotError, match="templates 0 to 2"):
        EvalConfig("passkey", ["full"], tmp_path / "o", templates=[3])
    with pytest.raises(KvpotError, match="'all' or template numbers"):
        parse_templates("first")


def test_perplexity_reports_overall_and_per_window_nll(capsys, tiny_dir, tmp_path):
    """Full attention's mean NLL must equal the model's own loss: the harness scores the right tokens."""
    out = tmp_path / "ppl"
    code, stdout, _ = run(capsys, "eval", "perplexity", "--method", "full", "--method", "streaming", "--budget", "64",
                          "--set", "chunk_size=32", "--length", "600", "--window", "256", "--model", str(tiny_dir),
                          "--out", str(out))
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    full, streaming = summary["methods"]["full"], summary["methods"]["streaming"]
    assert full["tokens_scored"] == 599 and summary["config"]["haystack"] == "varied"
    assert [(w["start"], w["end"]) for w in full["windows"]] == [(1, 257), (257, 513), (513, 600)]
    assert full["perplexity"] == pytest.approx(math.exp(full["mean_nll"]))
    assert streaming["stats"]["max_kv_entries"] <= 4 + 60 + 32 < full["stats"]["max_kv_entries"]

    curves = torch.load(out / "nll.pt")
    model = LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    from kvpot.eval.perplexity import filler_ids

    ids = torch.tensor([[BOS_ID] + filler_ids(build_tokenizer(), 599, "varied", 0)])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert full["mean_nll"] == pytest.approx(float(loss), rel=1e-4)
    assert float(curves["full"].mean()) == pytest.approx(full["mean_nll"], rel=1e-5)
    assert_png(out / "perplexity.png")
    assert "perplexity" in (out / "summary.md").read_text() and "streaming" in stdout


def test_perplexity_with_prompt_tokens_scores_the_rest_as_generation(capsys, tiny_dir, tmp_path):
    out = tmp_path / "gen"
    code, _, _ = run(capsys, "eval", "perplexity", "--method", "h2o:heavy=16,recent=16", "--length", "200",
                     "--prompt-tokens", "50", "--window", "64", "--model", str(tiny_dir), "--out", str(out))
    assert code == 0
    stats = json.loads((out / "summary.json").read_text())["methods"]["h2o"]["stats"]
    assert stats["new_tokens"] == 200 - 51 and stats["final_kv_entries"] <= 32  # BOS + 50 prompt tokens
    code, _, err = run(capsys, "eval", "perplexity", "--method", "full", "--prompt-tokens", "0",
                       "--out", str(tmp_path / "x"))
    assert code == 2 and "--prompt-tokens" in err


def test_eval_batch_size_gives_the_one_at_a_time_answers(capsys, tiny_dir, tmp_path):
    """`--batch-size 4`: each method answers its samples decoded together, with the same predictions,
    scores and KV counts as one at a time (greedy)."""
    alone, together = tmp_path / "alone", tmp_path / "together"
    assert run(capsys, *EVAL_ARGS, "--model", str(tiny_dir), "--out", str(alone))[0] == 0
    assert run(capsys, *EVAL_ARGS, "--model", str(tiny_dir), "--out", str(together), "--batch-size", "4")[0] == 0
    mixed = tmp_path / "mixed"  # prompt chunks in the decoding rows' forward, as a GPU runs them by default
    assert run(capsys, *EVAL_ARGS, "--model", str(tiny_dir), "--out", str(mixed), "--batch-size", "4",
               "--mix", "on")[0] == 0
    key = lambda r: (r["method"], r["length"], r["depth"], r["sample"])  # noqa: E731
    one = {key(r): r for r in read_rows(alone / "results.jsonl")}
    for out in (together, mixed):
        many = {key(r): r for r in read_rows(out / "results.jsonl")}
        assert one.keys() == many.keys()
        for cell, row in one.items():
            assert many[cell]["prediction"] == row["prediction"] and many[cell]["score"] == row["score"]
            assert many[cell]["stats"]["max_kv_entries"] == row["stats"]["max_kv_entries"]
    assert json.loads((together / "config.json").read_text())["config"]["batch_size"] == 4
    assert json.loads((mixed / "config.json").read_text())["config"]["mix"] == "on"
    code, _, err = run(capsys, "eval", "passkey", "--method", "full", "--out", str(tmp_path / "x"), "--batch-size", "0")
    assert code == 2 and "--batch-size" in err
