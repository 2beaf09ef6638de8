"""Architectures are recognised by config class; anything else is refused with a clear error."""

import subprocess
from pathlib import Path

import pytest
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

import kvpot
from conftest import build
from kvpot.models import architecture_of


def test_supported_configs_are_recognised():
    assert architecture_of(LlamaConfig()).name == "Llama"
    assert architecture_of(Qwen2Config()).name == "Qwen2"


def test_unsupported_config_names_what_is_supported():
    with pytest.raises(kvpot.KvpotError, match=r"GPT2Config.*Llama \(LlamaConfig\).*Qwen3"):
        architecture_of(GPT2Config())


def test_subclass_is_not_silently_accepted():
    class Custom(LlamaConfig):
        pass

    with pytest.raises(kvpot.KvpotError, match="Custom"):
        architecture_of(Custom())


def test_sliding_window_is_refused_not_ignored():
    with pytest.raises(kvpot.KvpotError, match="sliding_window=None"):
        architecture_of(MistralConfig(sliding_window=4096))
    with pytest.raises(kvpot.KvpotError, match="sliding-window"):
        architecture_of(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0))


def test_engine_refuses_unsupported_model_before_running():
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    with pytest.raises(kvpot.KvpotError, match="does not support GPT2Config"):
        kvpot.Engine(model)


def test_engine_refuses_batches_and_empty_inputs():
    engine = kvpot.Engine(build("llama3"))
    with pytest.raises(kvpot.KvpotError, match="batch size 1"):
        engine.generate_ids([[3, 4], [5, 6]])
    with pytest.raises(kvpot.KvpotError, match="empty"):
        engine.generate_ids([])
    with pytest.raises(kvpot.KvpotError, match="no tokenizer"):
        engine.generate("some text")


def test_no_module_forward_is_replaced_in_src():
    """Guarantee 3: kvpot uses Cache + AttentionInterface, never patches a module's forward."""
    src = Path(kvpot.__file__).parent
    found = subprocess.run(
        ["grep", "-rnE", r"\.forward *= |types\.MethodType|setattr\([^)]*forward", str(src)],
        capture_output=True, text=True,
    )
    assert found.stdout == "", found.stdout
