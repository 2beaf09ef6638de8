"""kvpress' processes run SDPA without cuDNN's attention on CUDA (`kvpot.bench.kvpress_runner.attention_backends`).

On an H100 with torch >= 2.11, SDPA picks cuDNN first, and cuDNN builds an execution plan for every new key
length: one per decoding step, and one per layer and step for PyramidKVPress, whose layers differ in length
(records/protocol-smollm2-gpu: 130-335 s for a first answer). These tests check that both kvpress processes
(`kvpot.eval.kvpress_worker`, `kvpot.bench.kvpress_runner`) turn cuDNN's attention off on CUDA, leave the other
backends and CPU runs alone, and report which backends ran; on a GPU, that decoding a cache with per-layer
lengths runs no cuDNN attention kernel then, and does without the setting (the cause, where torch prefers cuDNN).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvpot.bench import kvpress_runner
from kvpress_stand_in import write_stand_in


@pytest.fixture
def backends():
    """SDPA's backend flags as torch starts, restored afterwards (they are process-wide)."""
    names = ("flash", "mem_efficient", "math", "cudnn")
    before = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in names}
    torch.backends.cuda.enable_cudnn_sdp(True)
    yield
    for name, on in before.items():
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)


def test_cuda_leaves_cudnn_attention_out_and_cpu_runs_as_they_are(backends):
    assert kvpress_runner.attention_backends("cpu") == {"flash": True, "mem_efficient": True, "math": True,
                                                         "cudnn": True}
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert kvpress_runner.attention_backends("cuda:0") == {"flash": True, "mem_efficient": True, "math": True,
                                                            "cudnn": False}
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_the_worker_sets_the_backends_for_its_device_before_answering(backends, tmp_path, tiny_dir, monkeypatch):
    from kvpot.eval import kvpress_worker

    from test_bench_kvpress import _import_fake

    monkeypatch.setitem(sys.modules, "kvpress", _import_fake(write_stand_in(tmp_path / "site")))  # `import kvpress`
    cases, out = tmp_path / "cases.jsonl", tmp_path / "answers.jsonl"
    cases.write_text(json.dumps({"case": 0, "key": "k0", "context_ids": list(range(3, 43)),
                                 "question_ids": [5, 6, 7], "max_new_tokens": 2, "eos_ids": []}) + "\n")
    calls = []

    def recorded(device):
        calls.append((device, out.exists() and out.read_text()))  # nothing answered yet
        return kvpress_runner.attention_backends(device)

    monkeypatch.setattr(kvpress_worker, "attention_backends", recorded)
    args = kvpress_worker.parse_args(["--cases", str(cases), "--model-dir", str(tiny_dir), "--press", "snapkv",
                                      "--ratios", "0.5", "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    result = kvpress_worker.answer_all(args)
    assert calls == [("cpu", False)] and result["answers"] == 1
    assert result["sdpa_backends"] == {"flash": True, "mem_efficient": True, "math": True, "cudnn": True}
    assert json.loads(out.read_text())["kept"] == [20, 20]


def _attention_ops(model, press, context, question) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        kvpress_runner.answer(model, press, context, question, max_new_tokens=4)
    return {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key}


@pytest.mark.gpu
def test_per_layer_lengths_decode_without_cudnn_attention_on_a_gpu(backends, tmp_path):
    from conftest import build_llama
    from test_bench_kvpress import FAKE_KVPRESS, _import_fake

    site = tmp_path / "site"
    (site / "kvpress").mkdir(parents=True)
    (site / "kvpress" / "__init__.py").write_text(FAKE_KVPRESS)
    fake = _import_fake(site)
    model = build_llama(hidden_size=192, num_attention_heads=3, num_key_value_heads=1)  # SmolLM2's head: 64, GQA 3:1
    model = model.to("cuda", torch.bfloat16)
    context, question = torch.randint(3, 60, (300,), device="cuda"), torch.randint(3, 60, (5,), device="cuda")
    with torch.no_grad():
        _, kept, _ = kvpress_runner.answer(model, fake.PyramidKVPress(compression_ratio=0.5), context, question, 2)
    assert len(set(kept)) > 1  # the layers differ in length, as PyramidKVPress leaves them
    prefers_cudnn = (torch.backends.cudnn.version() or 0) > 91500 and torch.cuda.get_device_capability() in ((9, 0),
                                                                                                         (10, 0))
    if prefers_cudnn:  # the cause: torch's default sends these calls to cuDNN
        ops = _attention_ops(model, fake.PyramidKVPress(compression_ratio=0.5), context, question)
        assert "aten::_scaled_dot_product_cudnn_attention" in ops, ops
    kvpress_runner.attention_backends("cuda")
    ops = _attention_ops(model, fake.PyramidKVPress(compression_ratio=0.5), context, question)
    assert not any("cudnn" in op for op in ops) and "aten::_scaled_dot_product_flash_attention" in ops, ops
