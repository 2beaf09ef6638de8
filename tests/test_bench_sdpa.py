"""`kvpot bench --sdpa no-cudnn|default`: SDPA's backends for every row of a run (`kvpot.bench.backends`).

torch >= 2.11 on an H100 prefers cuDNN's attention, which builds an execution plan for every new key length,
i.e. one per decoding step of plain transformers. These tests check that the option parses and reaches the
config, that the switch is thrown on CUDA only (and undone after the run), that results.json and summary.md
record the setting and the backends it left on, that kvpress' process is told the same setting, and (GPU) that
a plain transformers decode step runs no cuDNN attention with `no-cudnn`.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run
from kvpot.bench import backends
from kvpot.bench.config import BenchConfig
from kvpot.cli import build_parser
from kvpot.cli.bench import config_from_args
from kvpot.errors import KvpotError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def flags():
    """SDPA's backend flags (process-wide) with cuDNN on, as torch starts; restored afterwards."""
    before = backends.enabled_backends()
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    for name, on in before.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


@pytest.fixture
def switch(monkeypatch, flags):
    """Every call of torch's cuDNN-attention switch, recorded (and passed on)."""
    calls = []
    real = torch.backends.cuda.enable_cudnn_sdp

    def recorded(on):
        calls.append(on)
        real(on)

    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", recorded)
    return calls


def _args(tmp_path, *extra):
    return build_parser().parse_args(["bench", "decode", "--shape", "tiny", "--method", "full",
                                      "--out", str(tmp_path / "out"), *extra])


def test_the_option_parses_into_the_config_with_no_cudnn_by_default(tmp_path):
    assert config_from_args(_args(tmp_path)).sdpa == "no-cudnn"
    config = config_from_args(_args(tmp_path, "--sdpa", "default"))
    assert config.sdpa == "default" and config.to_dict()["sdpa"] == "default"
    with pytest.raises(SystemExit):
        _args(tmp_path, "--sdpa", "cudnn")
    with pytest.raises(KvpotError, match="--sdpa"):
        BenchConfig(mode="decode", shape="tiny", out=tmp_path / "out", methods=["full"], sdpa="flash")


def test_the_switch_is_thrown_on_cuda_only(switch):
    assert backends.set_sdpa_backends("no-cudnn", "cpu") == {"flash": True, "mem_efficient": True, "math": True,
                                                             "cudnn": True}
    assert backends.set_sdpa_backends("default", "cpu")["cudnn"] and switch == []
    assert backends.set_sdpa_backends("no-cudnn", "cuda:1") == {"flash": True, "mem_efficient": True, "math": True,
                                                                "cudnn": False}
    assert backends.set_sdpa_backends("default", "cuda")["cudnn"] and switch == [False, True]
    assert backends.attention_backends("cuda:0")["cudnn"] is False and switch == [False, True, False]
    with pytest.raises(ValueError, match="no-cudnn"):
        backends.set_sdpa_backends("none", "cuda")


def test_a_run_s_setting_is_undone_after_it(switch):
    with backends.sdpa_backends("no-cudnn", "cuda") as enabled:
        assert enabled["cudnn"] is False and not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() and switch == [False, True]
    with backends.sdpa_backends("no-cudnn", "cpu"):
        pass
    assert switch == [False, True]


def test_kvpress_keeps_its_import_and_is_told_the_run_s_setting(tmp_path):
    from kvpot.bench import kvpress_runner
    from kvpot.bench.kvpress import kvpress_command

    assert kvpress_runner.attention_backends is backends.attention_backends  # the worker imports it from there
    config = BenchConfig(mode="decode", shape="tiny", out=tmp_path / "out", methods=["full"], device="cpu",
                         sdpa="default")
    command = kvpress_command(config, "snapkv", 512, 64, "decode")
    assert kvpress_runner.parse_args(command[3:]).sdpa == "default"
    assert kvpress_runner.parse_args(command[3:-2]).sdpa == "no-cudnn"  # the runner's own default


@pytest.mark.parametrize("choice", ["default", "no-cudnn"])
def test_every_row_runs_under_the_setting_and_results_record_it(capsys, tmp_path, monkeypatch, switch, choice):
    from kvpot.bench import hf, run as bench_run

    seen = []
    real_context, real_row = bench_run.sdpa_backends, hf.hf_decode_row

    def context(setting, device):
        seen.append((setting, device))
        return real_context(setting, device)

    def row(*args, **kwargs):
        seen.append(("hf row", torch.backends.cuda.cudnn_sdp_enabled()))
        return real_row(*args, **kwargs)

    monkeypatch.setattr(bench_run, "sdpa_backends", context)
    monkeypatch.setattr(hf, "hf_decode_row", row)
    out = tmp_path / "out"
    extra = [] if choice == "no-cudnn" else ["--sdpa", choice]
    code, _, err = run(capsys, "bench", "decode", "--shape", "tiny", "--device", "cpu", "--method", "full",
                       "--baseline", "hf", "--lengths", "128", "--decode-steps", "2", "--warmup-steps", "0",
                       "--question-tokens", "4", "--no-floor", "--out", str(out), *extra)
    assert code == 0, err
    assert seen == [(choice, "cpu"), ("hf row", True)] and switch == []  # a CPU run: flags untouched
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["sdpa"] == choice and results["machine"]["sdpa"] == choice
    assert results["machine"]["sdpa_backends"] == {"flash": True, "mem_efficient": True, "math": True, "cudnn": True}
    assert {r["method"] for r in results["rows"]} == {"full", "hf"}
    summary = (out / "summary.md").read_text()
    assert f"- SDPA backends: `--sdpa {choice}` (enabled: flash, mem_efficient, math, cudnn; flags left as they " \
           "were: they apply on CUDA only)" in summary


def test_summaries_of_results_without_the_record_still_render():
    from kvpot.bench.report import _sdpa_line

    assert _sdpa_line({"device": "cuda:0"}) == []
    assert _sdpa_line({"device": "cuda:0", "sdpa": "no-cudnn", "sdpa_backends": {
        "flash": True, "mem_efficient": True, "math": True, "cudnn": False}}) == \
        ["- SDPA backends: `--sdpa no-cudnn` (enabled: flash, mem_efficient, math)"]


def _sdpa_ops(model, setting: str) -> set[str]:
    """The SDPA operators a plain transformers decode (prefill + 2 steps) runs under `setting`."""
    from torch.profiler import ProfilerActivity, profile

    from kvpot.bench.hf import hf_decode_row

    ids = torch.randint(3, 60, (300,), device="cuda")
    question = torch.randint(3, 60, (4,), device="cuda")
    with backends.sdpa_backends(setting, "cuda"), profile(activities=[ProfilerActivity.CPU]) as prof:
        hf_decode_row(model, ids, question, steps=2, warmup=0, device="cuda")
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


@pytest.mark.gpu
def test_no_cudnn_leaves_cudnn_attention_out_of_a_plain_transformers_decode_on_a_gpu(flags):
    from conftest import build_llama

    model = build_llama(hidden_size=256, num_attention_heads=2, num_key_value_heads=1)  # head 128: as llama3-8b
    model = model.to("cuda", torch.bfloat16)
    prefers_cudnn = (torch.backends.cudnn.version() or 0) > 91500 and torch.cuda.get_device_capability() in ((9, 0),
                                                                                                         (10, 0))
    if prefers_cudnn:  # the cause: torch's own choice sends these calls to cuDNN
        ops = _sdpa_ops(model, "default")
        assert "aten::_scaled_dot_product_cudnn_attention" in ops, ops
    ops = _sdpa_ops(model, "no-cudnn")
    assert ops and not any("cudnn" in op for op in ops), ops
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the setting lasted only as long as the run
