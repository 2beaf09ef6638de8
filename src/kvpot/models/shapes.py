"""Model shapes for `kvpot bench`: real models' dimensions with random weights, nothing downloaded.

Speed and memory depend on a model's dimensions, not on its weights, so kvpot ships the configs
of the models it is benchmarked on and builds them with random weights directly on the requested
device and dtype:

- the model is constructed inside `torch.device(device)` (no CPU copy of an 8B model) with the
  dtype as torch's default dtype (`_from_config(config, dtype=...)`), under transformers'
  `no_init_weights()`, which skips the (slow, CPU-style) initialisers;
- every matrix is then filled in place with `normal_(0, initializer_range)` and every bias with
  zeros on the device (RMSNorm weights are ones from their constructors). This takes well under
  a second for 8B parameters on a GPU, and keeps activations finite in bfloat16.

A shape larger than one GPU (`llama3-70b`: 141 GB in bfloat16) is built split over several with
`device_map` (`build_split`): made on the `meta` device, mapped by accelerate from its parameter
sizes, then each block's weights are allocated and drawn on its own GPU, never whole on one device.

Shapes are recognised by name only inside this table: they are kvpot's own, not a model registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpot.errors import KvpotError


@dataclass(frozen=True)
class Shape:
    """A named model shape: which model it mirrors, and how to make its config."""

    name: str
    mirrors: str
    make_config: Callable[[], object]
    model_class: str  # transformers class name of the causal LM

    def config(self):
        return self.make_config()


def _llama3_rope(factor: float, theta: float = 500000.0) -> dict:
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_8b():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_llama3_rope(8.0), bos_token_id=128000, eos_token_id=128001,
        tie_word_embeddings=False,
    )


def _llama32_1b():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_llama3_rope(32.0), bos_token_id=128000, eos_token_id=128001,
        tie_word_embeddings=True,
    )


def _mistral_7b():
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )


def _qwen25_7b():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False, sliding_window=None, bos_token_id=151643, eos_token_id=151645,
        tie_word_embeddings=False,
    )


def _llama3_70b():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_llama3_rope(8.0), bos_token_id=128000, eos_token_id=128001,
        tie_word_embeddings=False,
    )


def _tiny():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=131072,
        rope_parameters=_llama3_rope(8.0), bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama3-8b", "meta-llama/Llama-3.1-8B (GQA 32/8, llama3 RoPE x8)", _llama3_8b, "LlamaForCausalLM"),
        Shape("llama3-70b", "meta-llama/Llama-3.1-70B (GQA 64/8, llama3 RoPE x8; needs --device-map over GPUs)",
              _llama3_70b, "LlamaForCausalLM"),
        Shape("mistral-7b", "mistralai/Mistral-7B-v0.3 (GQA 32/8, no sliding window)", _mistral_7b,
              "MistralForCausalLM"),
        Shape("qwen2.5-7b", "Qwen/Qwen2.5-7B (GQA 28/4, qkv bias)", _qwen25_7b, "Qwen2ForCausalLM"),
        Shape("llama3.2-1b", "meta-llama/Llama-3.2-1B (GQA 32/8, llama3 RoPE x32, tied embeddings)",
              _llama32_1b, "LlamaForCausalLM"),
        Shape("tiny", "a 4-layer toy for CPU and CI (GQA 8/2, llama3 RoPE)", _tiny, "LlamaForCausalLM"),
    )
}


def get_shape(name: str) -> Shape:
    shape = SHAPES.get(name)
    if shape is None:
        raise KvpotError(f"unknown shape {name!r}; choose one of: {', '.join(SHAPES)} (`kvpot bench shapes`).")
    return shape


def model_class(shape: Shape):
    import transformers

    return getattr(transformers, shape.model_class)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def describe(shape: Shape) -> dict:
    """The dimensions that matter for speed and memory, plus the parameter count (meta device)."""
    config = shape.config()
    return {
        "name": shape.name, "mirrors": shape.mirrors, "class": shape.model_class,
        "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": head_dim(config), "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size, "parameters": count_parameters(shape),
        "kv_bytes_per_token_bf16": kv_bytes_per_token(config, 2),
    }


def kv_bytes_per_token(config, element_bytes: int) -> int:
    """Bytes of keys and values one token takes over all layers."""
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim(config) * element_bytes


def count_parameters(shape: Shape) -> int:
    """Parameters of the shape, counted on the meta device (no memory, no time)."""
    import torch

    with torch.device("meta"):
        model = model_class(shape)(shape.config())
    return sum(p.numel() for p in model.parameters())


def rotary(name: str, device: str = "cpu"):
    """The rotary-embedding module of shape `name`'s model, without building the model's weights
    (the model is made on the meta device only to find which module class it uses)."""
    import torch

    from kvpot.models import rotary_embedding

    shape = get_shape(name)
    with torch.device("meta"):
        model = model_class(shape)(shape.config())
    with torch.device(device):
        return type(rotary_embedding(model))(shape.config())


def build(name: str, device: str = "cpu", dtype=None, seed: int = 0, device_map=None, max_memory=None,
          tp_size: int = 1):
    """A random-weight model of shape `name` on `device` in `dtype` (default: float32 on CPU,
    bfloat16 elsewhere), in eval mode. See the module docstring for how the init is skipped.
    With `device_map` ("auto", ... or a dict), split over devices instead (`build_split`); with `tp_size` N > 1
    (under torchrun), sharded by transformers' tensor-parallel plan as a checkpoint would be
    (`kvpot.models.tensor_parallel.build_tensor_parallel`)."""
    import torch
    from transformers.initialization import no_init_weights

    from kvpot.models import default_dtype

    if tp_size > 1:
        from kvpot.models.tensor_parallel import build_tensor_parallel, tp_device_type

        if device_map is not None:
            raise KvpotError("give either tp_size (tensor parallelism) or a device_map, not both.")
        return build_tensor_parallel(get_shape(name).config(), tp_size, dtype or default_dtype(tp_device_type()), seed)

    if device_map is not None:
        return build_split(name, device_map, dtype, seed, max_memory)
    shape = get_shape(name)
    dtype = dtype or default_dtype(device)
    config = shape.config()
    with torch.device(device), no_init_weights():
        model = model_class(shape)._from_config(config, dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std, generator=generator)
            elif pname.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)  # RMSNorm weights
    return model.eval()


def build_split(name: str, device_map="auto", dtype=None, seed: int = 0, max_memory: dict | None = None):
    """A random-weight model of shape `name` placed by `device_map` as `from_pretrained(device_map=...)`
    would place a checkpoint, without ever holding it whole on one device.

    The model is made under accelerate's `init_empty_weights` (parameters on `meta`; buffers such as
    RoPE frequencies real, on the CPU); a strategy ("auto", "balanced", "balanced_low_0",
    "sequential") is resolved to a map from the parameter sizes within `max_memory`, as transformers
    does; then every parameter is allocated on its block's device and drawn there (one generator
    per device, seeded with `seed`), and `accelerate.dispatch_model` adds the hooks that carry
    activations from GPU to GPU. A map that would offload weights to the CPU or disk (the shape does
    not fit on the GPUs) is refused: random weights are for measuring GPUs.
    """
    import accelerate
    import torch
    from accelerate.utils import get_balanced_memory, get_max_memory, infer_auto_device_map, set_module_tensor_to_device
    from transformers.initialization import no_init_weights

    from kvpot.models.devices import as_device, check_device_map, map_uses_accelerator

    check_device_map(device_map, max_memory)
    shape = get_shape(name)
    config = shape.config()
    dtype = dtype or (torch.bfloat16 if map_uses_accelerator(device_map) else torch.float32)
    with accelerate.init_empty_weights(include_buffers=False), no_init_weights():
        model = model_class(shape)._from_config(config, dtype=dtype)
    if isinstance(device_map, str):  # sized from the meta parameters, as transformers does
        no_split = model._no_split_modules
        memory = get_max_memory(max_memory) if device_map == "sequential" else get_balanced_memory(
            model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
            low_zero=device_map == "balanced_low_0")
        device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split, dtype=dtype)
    places = {str(d) for d in device_map.values()}
    if places & {"disk", "meta"} or ("cpu" in places and len(places) > 1):
        raise KvpotError(f"shape {name!r} does not fit on the GPUs here (accelerate would offload to {sorted(places)}); "
                         "use more GPUs, a larger --max-memory, or a smaller shape.")
    std = getattr(config, "initializer_range", 0.02)
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for pname, param in model.named_parameters():
            target = as_device(_placement(device_map, pname))
            if target not in generators:
                generators[target] = torch.Generator(device=target).manual_seed(seed)
            value = torch.empty(param.shape, dtype=param.dtype, device=target)
            if param.dim() >= 2:
                value.normal_(0.0, std, generator=generators[target])
            else:
                value.fill_(0.0 if pname.endswith("bias") else 1.0)  # biases; RMSNorm weights
            set_module_tensor_to_device(model, pname, target, value=value)
        for bname, buffer in model.named_buffers():  # RoPE frequencies: computed on the CPU, moved
            set_module_tensor_to_device(model, bname, as_device(_placement(device_map, bname)), value=buffer)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model = accelerate.dispatch_model(model, device_map=device_map)
    model.hf_device_map = device_map
    return model.eval()


def _placement(device_map: dict, name: str):
    """The device of the deepest `device_map` entry that contains tensor `name` ("" holds everything)."""
    parts = name.split(".")
    for cut in range(len(parts), -1, -1):
        key = ".".join(parts[:cut])
        if key in device_map:
            return device_map[key]
    raise KvpotError(f"device_map places no module that holds {name!r}.")
