"""`kvpot bench`: shapes with the documented dimensions, the three modes on `tiny`, OOM handling,
one-line errors. Timings are never compared with the clock: keys, counts and positivity only."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from kvpot.models import shapes
from conftest import assert_png, run
from kvpot.cli import main
from kvpot.engine import Engine
from kvpot.errors import KvpotError


pytestmark = pytest.mark.usefixtures("one_thread")




def bench(capsys, tmp_path, mode: str, *extra: str, name: str = "out") -> dict:
    out = tmp_path / name
    code, stdout, err = run(capsys, "bench", mode, "--shape", "tiny", "--device", "cpu", "--out", str(out), *extra)
    assert code == 0, err
    assert "wrote" in stdout
    return json.loads((out / "results.json").read_text())


def rows_of(results: dict, method: str) -> list[dict]:
    return [r for r in results["rows"] if r["method"] == method]


# ---------------------------------------------------------------------------- shapes


def test_llama3_8b_config_matches_llama_3_1_8b():
    c = shapes.get_shape("llama3-8b").config()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (4096, 32, 32, 8)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (14336, 128256, 131072)
    rope = c.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["rope_theta"] == 500000.0
    assert (rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]) == (1.0, 4.0, 8192)
    assert not c.tie_word_embeddings


def test_other_shapes_configs():
    m = shapes.get_shape("mistral-7b").config()
    assert type(m).__name__ == "MistralConfig"
    assert (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads) == (4096, 32, 32, 8)
    assert (m.intermediate_size, m.vocab_size, m.sliding_window) == (14336, 32768, None)
    assert m.rope_parameters["rope_theta"] == 1e6
    q = shapes.get_shape("qwen2.5-7b").config()
    assert type(q).__name__ == "Qwen2Config"
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads) == (3584, 28, 28, 4)
    assert (q.intermediate_size, q.vocab_size, q.rope_parameters["rope_theta"]) == (18944, 152064, 1e6)
    s = shapes.get_shape("llama3.2-1b").config()
    assert (s.hidden_size, s.num_hidden_layers, s.num_attention_heads, s.num_key_value_heads) == (2048, 16, 32, 8)
    assert (s.intermediate_size, s.vocab_size, s.tie_word_embeddings) == (8192, 128256, True)
    assert s.rope_parameters["rope_type"] == "llama3" and s.rope_parameters["factor"] == 32.0
    assert s.rope_parameters["original_max_position_embeddings"] == 8192


def test_every_shape_is_supported_by_the_engine():
    from kvpot.models import architecture_of

    for shape in shapes.SHAPES.values():
        architecture_of(shape.config())  # raises for an unsupported config (e.g. a sliding window)


@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3.2-1b", 1.24), ("mistral-7b", 7.25),
                                            ("qwen2.5-7b", 7.62)])
def test_parameter_counts_on_meta(name, billions):
    assert shapes.count_parameters(shapes.get_shape(name)) / 1e9 == pytest.approx(billions, abs=0.01)


def test_qwen_shape_has_qkv_bias():
    with torch.device("meta"):
        model = shapes.model_class(shapes.get_shape("qwen2.5-7b"))(shapes.get_shape("qwen2.5-7b").config())
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None


def test_build_tiny_random_weights_on_device_and_dtype():
    model = shapes.build("tiny", "cpu", torch.bfloat16, seed=3)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in params.values())
    q = params["model.layers.0.self_attn.q_proj.weight"].float()
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.002  # normal(0, 0.02), not garbage
    assert torch.equal(params["model.norm.weight"].float(), torch.ones(256))
    again = shapes.build("tiny", "cpu", torch.bfloat16, seed=3)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, params["model.layers.0.self_attn.q_proj.weight"])
    model.set_attn_implementation("sdpa")
    logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape == (1, 3, 2048) and torch.isfinite(logits.float()).all()


def test_list_shapes(capsys):
    for argv in (["bench", "shapes"], ["bench", "--list-shapes"]):
        code, out, _ = run(capsys, *argv)
        assert code == 0
        assert all(name in out for name in shapes.SHAPES) and "8.03B" in out


# ---------------------------------------------------------------------------- modes


def test_prefill_writes_results_summary_and_plots(capsys, tmp_path):
    results = bench(capsys, tmp_path, "prefill", "--method", "full", "--method", "streaming", "--budget", "128",
                    "--lengths", "256,512", "--repeats", "2", "--question-tokens", "8")
    assert results["mode"] == "prefill" and results["complete"] is True
    assert {"command", "machine", "config", "shape", "model_config", "methods", "rows", "dtype"} <= set(results)
    assert results["command"][0] and results["machine"]["cpu"] and results["machine"]["gpu"] is None
    assert {"torch", "transformers", "kvpot"} <= set(results["machine"]["versions"])
    assert {"git_commit", "git_dirty", "date", "cpu_count", "torch_threads"} <= set(results["machine"])
    assert results["command"] == sys.argv  # the process's command line (pytest's here)
    assert results["shape"]["name"] == "tiny" and results["model_config"]["num_hidden_layers"] == 4
    assert list(results["methods"]) == ["full", "streaming"]
    assert results["methods"]["streaming"]["config"]["window"] > 0
    assert [(r["method"], r["length"]) for r in results["rows"]] == [
        (m, n) for m in ("floor", "full", "streaming") for n in (256, 512)]
    for row in results["rows"]:
        assert not row["oom"] and not row["skipped"]
        assert row["prefill_seconds"] > 0 and len(row["samples"]) == 2
        assert 0 <= row["compress_share"] < 1
        assert row["peak_memory_bytes"] is None  # CPU
    full = rows_of(results, "full")
    assert [r["max_kv_entries"] for r in full] == [256 + 8, 512 + 8]  # context + question, nothing evicted
    streaming = rows_of(results, "streaming")
    bound = results["methods"]["streaming"]["max_entries"]
    assert all(r["max_kv_entries"] <= bound for r in streaming) and streaming[-1]["compressions"] > 0
    assert streaming[-1]["kv_cache_bytes"] < full[-1]["kv_cache_bytes"]
    assert rows_of(results, "floor")[0]["max_kv_entries"] is None
    out = tmp_path / "out"
    summary = (out / "summary.md").read_text()
    assert "# kvpot bench prefill: tiny" in summary and "| floor | 256 |" in summary and "TTFT s" in summary
    for name in ("ttft.png", "memory.png"):
        assert_png(out / name)


def test_decode_per_step_medians(capsys, tmp_path):
    results = bench(capsys, tmp_path, "decode", "--method", "full", "--method", "infinipot", "--budget", "128",
                    "--lengths", "300", "--decode-steps", "5", "--warmup-steps", "2", "--no-floor")
    assert [r["method"] for r in results["rows"]] == ["full", "infinipot"]
    for row in results["rows"]:
        assert row["steps"] == 5 and len(row["samples_ms"]) == 5
        assert row["ms_per_token"] > 0 and row["tokens_per_second"] == pytest.approx(1000 / row["ms_per_token"])
        assert row["timing"].startswith("per-step")
        assert row["ms_per_token_p90"] >= row["ms_per_token"]
        assert row["prefill_seconds"] > 0
        assert row["linear"] == "torch"  # `--linear auto` as resolved on a CPU
    full, pot = results["rows"]
    assert full["max_kv_entries"] == 300 + 32 + 7  # context + question + the 7 decoded forwards, no eviction
    assert pot["max_kv_entries"] <= 128
    out = tmp_path / "out"
    assert "ms/token" in (out / "summary.md").read_text()
    for name in ("ms_per_token.png", "memory.png"):
        assert_png(out / name)


def test_decode_breakdown_charges_each_part_of_the_step(capsys, tmp_path):
    results = bench(capsys, tmp_path, "decode", "--method", "streaming", "--budget", "96", "--lengths", "300",
                    "--decode-steps", "3", "--warmup-steps", "1", "--no-floor", "--decode", "static", "--breakdown")
    (row,) = results["rows"]
    breakdown = row["breakdown"]
    assert breakdown["steps"] == 8  # every profiled step a fixed-shape one: streaming at its budget is steady
    parts = breakdown["parts"]
    # on a CPU the host operators are charged: the decoder's all go to "other" (no kernels to name)
    for part in ("decoder: other (norms, RoPE, residual, cache writes)", "head (logits)", "method (append / evict)",
                 "sampling"):
        assert parts[part]["ms_per_step"] > 0 and parts[part]["launches_per_step"] >= 1
    assert breakdown["step_ms"] == pytest.approx(sum(v["ms_per_step"] for k, v in parts.items()
                                                     if k != "outside the step"))
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "Where a step's time goes" in summary and "method (append / evict)" in summary


def test_breakdown_names_kernels_by_part():
    from types import SimpleNamespace as NS

    from kvpot.bench.breakdown import classify

    def op(name, parent=None, kernels=()):
        return NS(name=name, cpu_parent=parent, device_type=None, self_cpu_time_total=1.0,
                  kernels=[NS(name=k, duration=d) for k, d in kernels])

    decoder, method = op("kvpot.step.decoder"), op("kvpot.step.method")
    events = [decoder, method,
              op("aten::mm", decoder, [("sm90_xmma_gemm_bf16", 300.0)]),
              op("triton", decoder, [("_decode_kernel", 40.0)]),
              op("aten::mul", decoder, [("vectorized_elementwise_kernel", 5.0)]),
              op("aten::argmin", method, [("reduce_kernel", 6.0)]),
              op("aten::copy_", None, [("copy_kernel", 2.0)])]
    out = classify(events, steps=2, cuda=True)
    parts = out["parts"]
    assert parts["decoder: weights (matmul)"] == {"ms_per_step": 0.15, "launches_per_step": 0.5}
    assert parts["decoder: attention"]["ms_per_step"] == pytest.approx(0.02)
    assert parts["decoder: other (norms, RoPE, residual, cache writes)"]["ms_per_step"] == pytest.approx(0.0025)
    assert parts["method (append / evict)"]["ms_per_step"] == pytest.approx(0.003)
    assert parts["outside the step"]["ms_per_step"] == pytest.approx(0.001)
    assert out["step_ms"] == pytest.approx(0.15 + 0.02 + 0.0025 + 0.003)  # outside the step not counted


def test_breakdown_is_for_decode_only(capsys, tmp_path):
    code, _, err = run(capsys, "bench", "prefill", "--shape", "tiny", "--device", "cpu", "--out", str(tmp_path / "o"),
                       "--method", "full", "--breakdown")
    assert code == 2 and "--breakdown applies to bench decode" in err


def test_decode_baselines_in_the_same_run(capsys, tmp_path, monkeypatch):
    """`--baseline hf` adds plain transformers on the same tokens; kvpress rows without an environment
    are recorded as skipped, with the reason; `--decode static` runs kvpot's fixed-shape steps."""
    monkeypatch.delenv("KVPOT_KVPRESS_PATH", raising=False)
    results = bench(capsys, tmp_path, "decode", "--method", "infinipot", "--budget", "128", "--lengths", "300",
                    "--decode-steps", "4", "--warmup-steps", "1", "--no-floor", "--baseline", "hf,kvpress",
                    "--decode", "static")
    rows = {r["method"]: r for r in results["rows"]}
    assert list(rows) == ["hf", "kvpress:snapkv", "kvpress:expected_attention", "kvpress:streaming_llm",
                          "kvpress:pyramidkv", "infinipot"]
    hf = rows["hf"]
    assert hf["steps"] == 4 and hf["max_kv_entries"] == 300 + 32 + 1 + 4  # whole context, question, every step
    assert all("kvpress" in rows[name]["skipped"] for name in rows if name.startswith("kvpress"))
    # (the default runner, the core, in its fixed-shape steps)
    assert rows["infinipot"]["decode"]["mode"] == "batch-static" and rows["infinipot"]["max_kv_entries"] <= 128
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "skipped" in summary and "| decoded by |" in summary
    steps = rows["infinipot"]["decode"]
    assert f"core ({steps['batched_rows']:,} batched" in summary and steps["batched_rows"] > 0


def test_prefill_baseline_reads_the_whole_context_in_one_forward(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOT_KVPRESS_PATH", raising=False)
    results = bench(capsys, tmp_path, "prefill", "--method", "streaming", "--budget", "128", "--lengths", "300",
                    "--no-floor", "--baseline", "hf")
    hf, streaming = results["rows"]
    assert (hf["method"], streaming["method"]) == ("hf", "streaming")
    assert hf["max_kv_entries"] == 300 + 32 and hf["prefill_seconds"] > 0 and hf["compress_share"] == 0.0
    assert streaming["max_kv_entries"] <= results["methods"]["streaming"]["max_entries"]


def test_attention_dense_kvpot_and_method_caches(capsys, tmp_path):
    results = bench(capsys, tmp_path, "attention", "--method", "streaming", "--budget", "128", "--lengths", "256,1k",
                    "--min-time", "0.01", "--block", "64")
    assert [(r["method"], r["length"]) for r in results["rows"]] == [
        (m, n) for m in ("sdpa", "kvpot", "streaming") for n in (256, 1024)]
    bound = results["methods"]["streaming"]["max_entries"]
    for row in results["rows"]:
        assert (row["heads"], row["kv_heads"], row["head_dim"]) == (8, 2, 32)
        assert row["decode_us"] > 0 and row["prefill_us"] > 0 and row["decode_samples_us"]
        assert row["prefill_block"] == 64
        expected = min(row["length"], bound) if row["method"] == "streaming" else row["length"]
        assert row["cache_entries"] == expected
    out = tmp_path / "out"
    for name in ("attention_decode.png", "attention_prefill.png"):
        assert_png(out / name)


def test_a_new_method_needs_only_its_row_in_methods(capsys, tmp_path, monkeypatch):
    from kvpot.methods import METHODS, StreamingLLM

    @dataclasses.dataclass
    class Window(StreamingLLM):
        name = "window"

    monkeypatch.setitem(METHODS, "window", Window)
    results = bench(capsys, tmp_path, "prefill", "--method", "window:sinks=0,window=100", "--lengths", "300",
                    "--no-floor")
    assert results["methods"]["window"]["config"]["method"] == "window"
    assert results["rows"][0]["max_kv_entries"] <= results["methods"]["window"]["max_entries"]


# ---------------------------------------------------------------------------- out of memory


def _raise_oom_for(method_name: str, from_length: int, monkeypatch, error=torch.cuda.OutOfMemoryError):
    original = Engine.prefill_ids
    calls = []

    def prefill_ids(self, input_ids, *args, **kwargs):
        calls.append((self.method.name, len(input_ids)))
        if self.method.name == method_name and len(input_ids) >= from_length:
            raise error("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(Engine, "prefill_ids", prefill_ids)
    return calls


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError, MemoryError])
def test_oom_is_recorded_and_longer_lengths_skipped(capsys, tmp_path, monkeypatch, error):
    calls = _raise_oom_for("full", 512, monkeypatch, error)
    results = bench(capsys, tmp_path, "prefill", "--method", "full", "--method", "streaming", "--budget", "128",
                    "--lengths", "256,512,1k")
    full = rows_of(results, "full")
    assert [(r["oom"], r["skipped"]) for r in full] == [(False, False), (True, False), (False, True)]
    assert "out of memory" in full[1]["error"] and "prefill_seconds" not in full[1]
    assert ("full", 1024) not in calls  # skipped, never run
    assert all(not r["oom"] and r["prefill_seconds"] > 0 for r in rows_of(results, "streaming"))
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| full | 512 | OOM |" in summary and "| full | 1K | skipped |" in summary
    assert_png(tmp_path / "out" / "ttft.png")


def test_other_errors_are_not_swallowed_and_finished_rows_are_kept(capsys, tmp_path, monkeypatch):
    _raise_oom_for("full", 512, monkeypatch, RuntimeError)
    with pytest.raises(RuntimeError):
        main(["bench", "prefill", "--shape", "tiny", "--device", "cpu", "--method", "full", "--lengths", "256,512",
              "--out", str(tmp_path / "out")])
    partial = json.loads((tmp_path / "out" / "results.json").read_text())
    assert partial["complete"] is False
    assert [(r["method"], r["length"]) for r in partial["rows"]] == [("floor", 256), ("floor", 512), ("full", 256)]
    assert all(r["prefill_seconds"] > 0 for r in partial["rows"])


def test_attention_oom_recorded(capsys, tmp_path, monkeypatch):
    import kvpot.attention

    def attend(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory.")

    monkeypatch.setattr(kvpot.attention, "attend", attend)
    results = bench(capsys, tmp_path, "attention", "--lengths", "256,512", "--min-time", "0.01")
    assert [(r["oom"], r["skipped"]) for r in rows_of(results, "kvpot")] == [(True, False), (False, True)]
    assert all(r["decode_us"] > 0 for r in rows_of(results, "sdpa"))


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prefill", "--shape", "gpt5", "--method", "full"], "unknown shape 'gpt5'"),
        (["prefill", "--method", "nosuch"], "unknown method 'nosuch'"),
        (["prefill"], "needs at least one --method"),
        (["decode", "--method", "full", "--lengths", "12q"], "is not a length"),
        (["prefill", "--method", "full", "--repeats", "0"], "--repeats must be at least 1"),
        (["prefill", "--method", "streaming", "--budget", "0"], "budget must be a positive"),
        (["prefill", "--method", "full", "--device", "cuda"], "CUDA is not available"),
        ([], "give a mode"),
    ],
)
def test_errors_are_one_line_exit_2(capsys, tmp_path, argv, message):
    if torch.cuda.is_available() and "cuda" in argv:
        pytest.skip("this machine has CUDA")
    code, out, err = run(capsys, "bench", *argv, "--out", str(tmp_path / "out"))
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_out_errors_and_bad_mode(capsys, tmp_path):
    code, _, err = run(capsys, "bench", "prefill", "--method", "full", "--out", str(tmp_path / "a" / "b"))
    assert code == 2 and "does not exist" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "bench", "prefill", "--method", "full")
    assert code == 2 and "needs --out" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "train", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_help_teaches(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for word in ("prefill", "decode", "attention", "floor", "OOM", "examples:", "--lengths", "--decode-steps"):
        assert word in out


def test_profile_names_the_busiest_operators(capsys, tmp_path):
    results = bench(capsys, tmp_path, "prefill", "--method", "infinipot", "--budget", "128",
                    "--lengths", "300", "--question-tokens", "4", "--profile")
    for row in results["rows"]:
        prof = row["profile"]
        assert prof["wall_seconds"] > 0 and prof["host_op_seconds"] > 0
        assert prof["top_device"] == []  # CPU: no device timeline
        assert 0 < len(prof["top_host"]) <= 12
        assert any(e["op"] == "aten::mm" or e["op"] == "aten::addmm" for e in prof["top_host"])  # the projections
    text = (tmp_path / "out" / "profile.md").read_text()
    assert "## infinipot @ 300 tokens" in text and "## floor @ 300 tokens" in text and "no device timeline" in text


def test_decode_profile(capsys, tmp_path):
    results = bench(capsys, tmp_path, "decode", "--method", "full", "--lengths", "200", "--decode-steps", "3",
                    "--warmup-steps", "1", "--profile")
    for row in results["rows"]:
        assert row["profile"]["host_op_seconds"] > 0 and row["profile"]["top_host"]
    assert "## full @ 200 tokens" in (tmp_path / "out" / "profile.md").read_text()


def test_machine_record_takes_the_commit_named_by_whoever_copied_the_tree(monkeypatch):
    from kvpot.bench.common import machine

    monkeypatch.setenv("KVPOT_GIT_COMMIT", "0123456789abcdef")
    assert machine("cpu")["git_commit"] == "0123456789abcdef"
    monkeypatch.delenv("KVPOT_GIT_COMMIT")
    assert machine("cpu")["git_commit"] != "0123456789abcdef"
    for placeholder in ("REPLACE", "HEAD", "abc", "0123456789abcdef0123456789abcdef0123456789"):  # a name, not a hash
        monkeypatch.setenv("KVPOT_GIT_COMMIT", placeholder)
        with pytest.raises(KvpotError, match="is not a commit hash"):
            machine("cpu")


def test_a_placeholder_commit_stops_the_bench_before_it_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("KVPOT_GIT_COMMIT", "REPLACE")
    code, _, err = run(capsys, "bench", "decode", "--shape", "tiny", "--device", "cpu", "--lengths", "64",
                       "--method", "full", "--out", str(tmp_path / "out"))
    assert code == 2 and "KVPOT_GIT_COMMIT='REPLACE' is not a commit hash" in err
    assert not (tmp_path / "out" / "results.json").exists()


def test_throughput_batch_one_at_a_time_and_transformers(capsys, tmp_path):
    """`bench throughput` on `tiny`: every user answered by kvpot batched, one at a time and transformers'
    continuous batching, with the rates, latencies and plots; a method that cannot run is a row's error."""
    out = tmp_path / "out"
    code, stdout, err = run(capsys, "bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out),
                            "--method", "infinipot:pot_size=128", "--method", "citrus", "--budget", "128",
                            "--users", "3", "--lengths", "96", "--new-tokens", "4", "--question-tokens", "4",
                            "--baseline", "hf", "--hf-timeout", "120", "--document")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    rows = {row["method"]: row for row in results["rows"]}
    assert set(rows) == {"infinipot [batch]", "infinipot [one at a time]", "citrus [batch]",
                         "citrus [one at a time]", "hf [generate_batch]"}
    for name in ("infinipot [batch]", "infinipot [one at a time]", "hf [generate_batch]"):
        row = rows[name]
        assert row["completed"] == row["requests"] == 3 and row["output_tokens"] == 12, name
        assert row["output_tokens_per_second"] > 0 and row["ttft_p50_seconds"] > 0 and row["itl_p99_ms"] >= 0
    batch = rows["infinipot [batch]"]
    assert batch["slots"] == 3 and batch["max_kv_entries"] <= 128 and batch["document_prefill_seconds"] > 0
    assert batch["scheduler"]["batched_rows"] > 0
    # CItruS' shared cache needs the question while a document is read: recorded, the run goes on
    assert "needs the instruction" in rows["citrus [batch]"]["error"]
    summary = (out / "summary.md").read_text()
    assert "| infinipot [batch] | 96 | 3 | 3 |" in summary and "| hf [generate_batch] | 96 | 3 | 3 |" in summary
    assert "kvpot bench throughput" in stdout
    assert_png(out / "throughput.png")
    assert_png(out / "itl.png")
