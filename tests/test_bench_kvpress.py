"""kvpress baseline rows (`kvpot.bench.kvpress.run_kvpress`, `kvpot.bench.kvpress_runner`).

The real kvpress needs transformers < 5.3; CI has a newer one. So the runner's protocol is tested in
its subprocess against a stand-in `kvpress` package written under tmp_path: presses that are
context managers registering kvpress-style forward hooks on the attention layers, which prune each
layer's cache to its first `int(L * (1 - ratio))` entries at the end of the (prefill) forward. That is
enough to check what could break: arguments, PYTHONPATH, the compressed KV count the runner reads,
decoding at positions past the compressed cache, step counts, the JSON line, OOM and import failures.
"""

from __future__ import annotations

import textwrap
from contextlib import contextmanager

import pytest

from kvpot.bench import kvpress_runner
from kvpot.bench.kvpress import kvpress_command, run_kvpress
from kvpot.bench.config import BenchConfig
from kvpot.errors import KvpotError

FAKE_KVPRESS = '''
"""Stand-in for kvpress in kvpot's tests: same press names and call protocol, simplest pruning."""
from contextlib import contextmanager
from dataclasses import dataclass

from kvpot.compat import cache_from_kwargs  # the cache's keyword: past_key_values, or cache from transformers 5.24

__version__ = "0.0-test"


@dataclass
class _Press:
    compression_ratio: float = 0.0

    def hook(self, module, args, kwargs, output):
        cache, q_len = cache_from_kwargs(kwargs), kwargs["hidden_states"].shape[1]
        layer = cache.layers[module.layer_idx]
        if layer.keys.shape[2] != q_len:  # only the prefill forward (the cache holds just its tokens)
            return output
        kept = max(1, int(layer.keys.shape[2] * (1 - self.compression_ratio)))
        layer.keys, layer.values = layer.keys[:, :, :kept].contiguous(), layer.values[:, :, :kept].contiguous()
        return output

    @contextmanager
    def __call__(self, model):
        hooks = [layer.self_attn.register_forward_hook(self.hook, with_kwargs=True) for layer in model.model.layers]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


@dataclass
class SnapKVPress(_Press):
    window_size: int = 64


@dataclass
class ExpectedAttentionPress(_Press):
    n_sink: int = 4


@dataclass
class PyramidKVPress(_Press):
    """Per-layer budgets around the requested average: layer i of L keeps (L - 1 - 2i) * 2 more."""
    window_size: int = 64
    beta: int = 20

    def hook(self, module, args, kwargs, output):
        cache, q_len = cache_from_kwargs(kwargs), kwargs["hidden_states"].shape[1]
        layer = cache.layers[module.layer_idx]
        if layer.keys.shape[2] != q_len:
            return output
        shift = (module.config.num_hidden_layers - 1 - 2 * module.layer_idx) * 2
        kept = int(layer.keys.shape[2] * (1 - self.compression_ratio)) + shift
        layer.keys, layer.values = layer.keys[:, :, :kept].contiguous(), layer.values[:, :, :kept].contiguous()
        return output


@dataclass
class StreamingLLMPress(_Press):
    n_sink: int = 4

    @contextmanager
    def __call__(self, model):  # the out-of-memory path: fails on entering, as an allocation would
        raise MemoryError("fake allocation failure")
        yield
'''


def config(tmp_path, kvpress_path=None, **overrides) -> BenchConfig:
    values = dict(mode="decode", shape="tiny", out=tmp_path / "out", methods=["full"], device="cpu",
                  dtype="float32", decode_steps=3, warmup_steps=1, question_tokens=4, seed=3, threads=1,
                  kvpress_path=kvpress_path)
    values.update(overrides)
    return BenchConfig(**values)


@pytest.fixture
def fake_kvpress(tmp_path):
    site = tmp_path / "site"
    (site / "kvpress").mkdir(parents=True)
    (site / "kvpress" / "__init__.py").write_text(textwrap.dedent(FAKE_KVPRESS))
    return site


def test_without_a_kvpress_path_the_row_is_skipped_with_the_reason(tmp_path):
    row = run_kvpress(config(tmp_path), "snapkv", 512, 128, "decode")
    assert row["method"] == "kvpress:snapkv" and row["length"] == 512
    assert "no kvpress environment" in row["skipped"] and "--kvpress-path" in row["skipped"]
    assert "\n" not in row["skipped"]


def test_bad_press_mode_or_path_are_clear_errors(tmp_path):
    with pytest.raises(KvpotError, match="unknown kvpress press"):
        run_kvpress(config(tmp_path), "h2o", 512, 128, "decode")
    with pytest.raises(KvpotError, match="not 'attention'"):
        run_kvpress(config(tmp_path), "snapkv", 512, 128, "attention")
    with pytest.raises(KvpotError, match="is not a folder"):
        config(tmp_path, kvpress_path=tmp_path / "missing")


def test_runner_arguments_are_validated():
    base = ["--shape", "tiny", "--length", "64", "--press", "snapkv", "--kept", "16"]
    assert kvpress_runner.parse_args(base).kept == 16
    for bad in (["--kept", "0"], ["--decode-steps", "0"], ["--press", "h2o"], ["--mode", "attention"]):
        with pytest.raises(SystemExit):
            kvpress_runner.parse_args(base + bad)


@pytest.mark.parametrize("length", [100, 512, 3000, 131072, 1_000_003])
def test_compression_ratio_keeps_exactly_the_requested_entries(length):
    for kept in (1, 7, 128, 999, 1000, 4096):
        if kept < length:
            ratio = kvpress_runner.compression_ratio(length, kept)
            assert 0 <= ratio < 1 and int(length * (1 - ratio)) == kept  # kvpress' compute_n_kept
    assert kvpress_runner.compression_ratio(100, 100) == 0.0  # nothing to compress: kvpress' ratio 0


def test_command_carries_the_bench_settings(tmp_path):
    cmd = kvpress_command(config(tmp_path), "expected_attention", 2048, 256, "prefill")
    assert cmd[1:3] == ["-m", "kvpot.bench.kvpress_runner"]
    args = kvpress_runner.parse_args(cmd[3:])
    assert (args.press, args.length, args.kept, args.mode, args.seed, args.question_tokens) == \
        ("expected_attention", 2048, 256, "prefill", 3, 4)
    assert (args.decode_steps, args.warmup_steps, args.device, args.dtype) == (3, 1, "cpu", "float32")


@pytest.mark.slow
def test_decode_row_through_the_subprocess_with_a_stand_in_kvpress(tmp_path, fake_kvpress):
    row = run_kvpress(config(tmp_path, fake_kvpress), "snapkv", 96, 24, "decode")
    assert row["skipped"] is False and row["oom"] is False and "error" not in row, row
    assert row["method"] == "kvpress:snapkv" and row["versions"]["kvpress"] == "0.0-test"
    assert row["compression_ratio"] == pytest.approx(0.75) and row["press_settings"]["window_size"] == 64
    assert row["max_kv_entries"] == 24 and row["kv_entries_per_layer"] == [24] * 4
    # the question (4) and every fed decode token (1 warm-up + 3 timed) were appended after pruning
    assert row["final_kv_entries"] == 24 + 4 + 1 + 3
    assert row["steps"] == 3 and len(row["samples_ms"]) == 3 and row["ms_per_token"] > 0
    assert row["ms_per_token_p90"] >= row["ms_per_token"] > 0 and row["tokens_per_second"] > 0
    assert row["prefill_seconds"] == pytest.approx(row["context_seconds"] + row["question_seconds"])
    assert row["kv_cache_bytes"] == 24 * 2 * 4 * 2 * 32 * 4  # entries x K,V x layers x KV heads x dim x fp32
    assert row["peak_memory_bytes"] is None  # CPU: no CUDA peak


@pytest.mark.slow
def test_a_press_with_per_layer_budgets_reports_its_largest_layer_and_mean_bytes(tmp_path, fake_kvpress):
    row = run_kvpress(config(tmp_path, fake_kvpress, mode="prefill"), "pyramidkv", 96, 24, "prefill")
    assert row["skipped"] is False and "error" not in row, row
    assert row["press"] == "PyramidKVPress" and row["press_settings"]["beta"] == 20
    assert row["kv_entries_per_layer"] == [30, 26, 22, 18] and row["max_kv_entries"] == 30
    assert row["kv_cache_bytes"] == 24 * 2 * 4 * 2 * 32 * 4  # the layers' mean (24) x bytes per token


@pytest.mark.slow
def test_oom_and_missing_kvpress_become_rows_not_exceptions(tmp_path, fake_kvpress):
    row = run_kvpress(config(tmp_path, fake_kvpress, mode="prefill"), "streaming_llm", 64, 16, "prefill")
    assert row["oom"] is True and row["error"] == "out of memory" and row["skipped"] is False
    empty = tmp_path / "empty"
    empty.mkdir()
    row = run_kvpress(config(tmp_path, empty), "snapkv", 64, 16, "prefill")
    assert row["skipped"].startswith("cannot import kvpress: ModuleNotFoundError") and str(empty) in row["skipped"]


class _NoPress:
    """kvpress' press protocol (`with press(model):`) pruning nothing."""

    @contextmanager
    def __call__(self, model):
        yield


def _import_fake(site):
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_kvpress", site / "kvpress" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_answer_without_pruning_is_transformers_greedy_generation():
    import torch
    from conftest import build_llama, reference_greedy

    model = build_llama()
    context, question = torch.randint(3, 60, (40,)), torch.randint(3, 60, (6,))
    expected = reference_greedy(model, torch.cat([context, question]), 7)
    with torch.no_grad():
        tokens, kept, _ = kvpress_runner.answer(model, _NoPress(), context, question, max_new_tokens=7)
    assert tokens == expected
    assert kept == [40] * model.config.num_hidden_layers
    with torch.no_grad():  # an EOS id ends the answer, itself included
        stopped, _, _ = kvpress_runner.answer(model, _NoPress(), context, question, 7, eos_ids={expected[2]})
    assert stopped == expected[: expected.index(expected[2]) + 1]


def test_answer_reports_what_the_press_kept(fake_kvpress):
    import torch
    from conftest import build_llama

    model = build_llama()
    press = _import_fake(fake_kvpress).SnapKVPress(compression_ratio=kvpress_runner.compression_ratio(40, 16))
    with torch.no_grad():
        tokens, kept, _ = kvpress_runner.answer(model, press, torch.randint(3, 60, (40,)), torch.randint(3, 60, (6,)), 4)
    assert kept == [16] * model.config.num_hidden_layers
    assert len(tokens) == 4
