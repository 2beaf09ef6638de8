"""Tiny models built from configs (never downloaded), one per supported architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def llama3_rope() -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }


ARCH_CONFIGS = {
    "llama3": lambda: (LlamaForCausalLM, LlamaConfig(**COMMON, rope_parameters=llama3_rope())),
    "mistral": lambda: (MistralForCausalLM, MistralConfig(**COMMON, sliding_window=None)),
    "qwen2": lambda: (Qwen2ForCausalLM, Qwen2Config(**COMMON)),
    "qwen3": lambda: (Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=16)),
}

ROPE_VARIANTS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": llama3_rope(),
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
}


def build(arch: str, seed: int = 0, **overrides):
    """A float32 tiny model of `arch`, seeded, eval mode, with sdpa attention for references."""
    torch.manual_seed(seed)
    model_class, config = ARCH_CONFIGS[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = model_class(config).eval()
    model.set_attn_implementation("sdpa")
    return model


def build_llama(rope: dict | None = None, seed: int = 0, **config_overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**COMMON, **config_overrides}, rope_parameters=rope or ROPE_VARIANTS["default"])
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    return model


@pytest.fixture(params=sorted(ARCH_CONFIGS))
def arch(request) -> str:
    return request.param


def reference_greedy(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """transformers' own greedy generation (sdpa attention), the exactness reference."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.generate(ids.view(1, -1), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.numel() :].tolist()


KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def needs_kernels():
    """The `pytestmark` of a Triton kernel test module: CUDA, or Triton's interpreter on a CPU."""
    from kvpot import kernels

    return pytest.mark.skipif(
        not kernels.available(KERNEL_DEVICE),
        reason="needs CUDA and Triton (or, on CPU, Triton installed and TRITON_INTERPRET=1)",
    )


def interpreter_runtime_loops() -> None:
    """Triton 3.6's interpreter turns a loop bound that is a runtime int into a 1-element array and
    calls int() on it, which numpy >= 2 refuses; read its one element instead (tests only: compiled
    kernels never take this path). Does nothing unless the kernels run interpreted."""
    from kvpot import kernels

    if not (kernels.interpreting() and kernels.available("cpu")):
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "kvpot_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.kvpot_fixed = True
    interpreter._patch_lang_tensor = patched


def skip_interpreted_bf16(dtype: torch.dtype) -> None:
    from kvpot import kernels

    if dtype == torch.bfloat16 and kernels.interpreting():
        pytest.skip("Triton 3.6's interpreter multiplies the raw bits of bf16 dot operands; runs on CUDA")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skip them (with the reason) where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine, two threads can run a tiny model 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random 2-layer Llama (GQA 4:2, window 2048) with the reference byte tokenizer, saved to disk."""
    from kvpot.models.reference.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=len(tokenizer), max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama-reference-tokenizer")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """`kvpot ARGV...` in-process: (exit code, stdout, stderr)."""
    from kvpot.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_png(path) -> None:
    """A real, non-trivial PNG file."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 1024, path
