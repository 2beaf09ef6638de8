"""The architecture support table.

kvpot never patches modeling code, so "supported" means: the model's attention calls the
registered attention function, applies RoPE to q and k from `position_ids` (so running with
positions 0 hands kvpot un-rotated q and k), uses no soft-capping and no sliding window, its base
model exposes the rotary embedding as `rotary_emb`, and its logits are a plain linear head over
the last hidden state. Each entry below was checked against those rules and is covered by tests built from a
tiny config of that class.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from kvpot.errors import KvpotError
from kvpot.models.devices import check_device_map, map_uses_accelerator, parse_max_memory


@dataclass(frozen=True)
class Architecture:
    """One supported architecture: its config class and what is special about it."""

    name: str
    config_class: type[PretrainedConfig]
    notes: str


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("Llama", LlamaConfig, "Llama 2/3/3.1/3.2; RoPE types default, llama3, linear, dynamic, yarn"),
    Architecture("Mistral", MistralConfig, "needs sliding_window=None (Mistral 7B v0.2 and later)"),
    Architecture("Qwen2", Qwen2Config, "qkv bias; Qwen2 and Qwen2.5 without sliding-window layers"),
    Architecture("Qwen3", Qwen3Config, "q/k RMS norm before RoPE; dense models"),
)


def _supported_names() -> str:
    return ", ".join(f"{a.name} ({a.config_class.__name__})" for a in ARCHITECTURES)


def architecture_of(config: PretrainedConfig) -> Architecture:
    """The table entry for `config`, or a KvpotError naming what is supported.

    The match is on the exact config class: a subclass may change attention in ways the
    table has not checked.
    """
    for arch in ARCHITECTURES:
        if type(config) is arch.config_class:
            _refuse_sliding_window(config, arch)
            return arch
    raise KvpotError(
        f"kvpot does not support {type(config).__name__} models yet; supported: {_supported_names()}."
    )


def _refuse_sliding_window(config: PretrainedConfig, arch: Architecture) -> None:
    layer_types = getattr(config, "layer_types", None) or ()
    uses_window = "sliding_attention" in layer_types
    if arch.config_class is MistralConfig:
        uses_window = uses_window or getattr(config, "sliding_window", None) is not None
    if uses_window:
        raise KvpotError(
            f"this {arch.name} config uses sliding-window attention, which kvpot does not support yet; "
            "set config.sliding_window=None (and use_sliding_window=False) to run it with full attention."
        )


def rotary_embedding(model: PreTrainedModel) -> torch.nn.Module:
    """The model's own rotary-embedding module (every supported base model names it `rotary_emb`)."""
    architecture_of(model.config)
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        raise KvpotError(f"{type(model).__name__} has no rotary embedding kvpot can use.")
    return rotary


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bfloat16 on accelerators (what the checkpoints are trained in), float32 on CPU."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def resolve_source(name_or_path, gguf_file: str | Path | None = None) -> str:
    """The local folder or Hub id transformers should load for (`name_or_path`, `gguf_file`).

    A named model (`smollm2-135m`, `kvpot.models.SMOLLM2_135M`) resolves to the GGUF inside its
    pip package; a GGUF file (by path, in a local folder, or in a Hub repository) to its
    de-quantized copy in kvpot's cache (converted on first use, see `kvpot.models.gguf`).
    """
    from kvpot.models.gguf import dequantized, locate
    from kvpot.models.named import named_model

    named = named_model(name_or_path)
    if named is not None:
        if gguf_file is not None:
            raise KvpotError(f"{named.name} is a GGUF model already; give either it or a GGUF file, not both.")
        return str(dequantized(named.gguf_path(), check=architecture_of))
    if gguf_file is not None:
        return str(dequantized(locate(name_or_path, gguf_file), check=architecture_of))
    if name_or_path is None:
        raise KvpotError("give a model: a Hugging Face id, a local folder, a named model or a GGUF file.")
    return str(name_or_path)


def load_pretrained(
    name_or_path, device: str | None = None, dtype: torch.dtype | None = None, device_map=None,
    max_memory: dict | None = None, gguf_file: str | Path | None = None, tp_size: int | None = None,
) -> tuple[PreTrainedModel, object]:
    """Load a supported causal LM and its tokenizer; checks support before reading weights.

    `name_or_path`: a Hub id, a local folder, or a named model (`kvpot.models.NAMED_MODELS`);
    `gguf_file`: a GGUF file (a path, or a file name in that folder or Hub repository), read
    through its de-quantized copy in kvpot's cache.
    With `device_map` ("auto", "balanced", "sequential" or a dict of module name -> device) the
    weights are placed by accelerate, layer by layer, over the devices (within `max_memory`), and
    `device` must be None: a model larger than one GPU is read straight onto several.
    With `tp_size` N > 1 (under `torchrun --nproc-per-node N`) transformers' tensor-parallel plan shards the
    weights over the N processes (`kvpot.models.tensor_parallel`).
    """
    check_device_map(device_map, max_memory)
    tp_size = None if tp_size == 1 else tp_size
    if device_map is not None and device is not None:
        raise KvpotError(f"give either a device ({device!r}) or a device_map, not both.")
    source = resolve_source(name_or_path, gguf_file)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise KvpotError(f"cannot load a model config from {source!r}: {err}".splitlines()[0]) from None
    architecture_of(config)
    if tp_size is not None:
        from kvpot.models.tensor_parallel import check_tp, load_tensor_parallel, tp_device_type

        check_tp(config, tp_size, device, device_map)
        model = load_tensor_parallel(source, tp_size, dtype or default_dtype(device or tp_device_type()))
    elif device_map is None:
        device = device or "cpu"
        dtype = dtype or default_dtype(device)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        model = model.to(device).eval()
    else:
        dtype = dtype or (torch.bfloat16 if map_uses_accelerator(device_map) else torch.float32)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device_map,
                                                     max_memory=max_memory).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    return model, tokenizer


def resolve_model(name: str | None, gguf: str | None = None) -> str | None:
    """`name`; None for a bare GGUF file (`gguf` without `name`); with neither, the bundled
    reference model's path (an error if it is not installed)."""
    if name or gguf:
        return name
    from kvpot.models import reference  # read at call time: tests replace has_reference_model

    if not reference.has_reference_model():
        raise KvpotError("the bundled reference model is missing from this install; give --model PATH_OR_ID.")
    return str(reference.REFERENCE_MODEL)


def model_label(name: str | None, gguf: str | None = None) -> str:
    """How results name the model: --model (or the reference model's path), the GGUF file, or both."""
    if gguf:
        return f"{name}:{gguf}" if name else str(gguf)
    return str(resolve_model(name))


def resolve_device(device: str | None) -> str:
    """`device`, or cuda when available else cpu; an error for cuda on a machine without it."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KvpotError(f"--device {device}: CUDA is not available on this machine; use --device cpu.")
    return device


def resolve_placement(device: str | None, device_map: str | dict | None, max_memory: str | dict | None,
                      tp: int = 1) -> tuple[str | None, str | dict | None, dict | None]:
    """Command-line placement (--device, --device-map, --max-memory as text, --tp) as `load_pretrained`'s
    (device, device_map, max_memory): a device map excludes a device; without either, cuda if available.
    With --tp N > 1 transformers places each rank (cuda:LOCAL_RANK, or the CPU): no device map."""
    if tp != 1:
        from kvpot.models.parallel import check_world

        check_world(tp)
        if device_map is not None or max_memory is not None:
            raise KvpotError("--tp splits every layer over the GPUs; --device-map/--max-memory split the layers: "
                             "give one of them.")
        return device, None, None
    max_memory = parse_max_memory(max_memory) if isinstance(max_memory, str) else max_memory
    check_device_map(device_map, max_memory)
    if device_map is None:
        return resolve_device(device), None, None
    if device is not None:
        raise KvpotError(f"give either --device ({device}) or --device-map ({device_map}), not both.")
    return None, device_map, max_memory


def resolve_dtype(name: str) -> torch.dtype | None:
    """`auto` -> None (the device's default, `default_dtype`), else the torch dtype of that name."""
    return None if name == "auto" else getattr(torch, name)
