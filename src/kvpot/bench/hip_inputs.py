"""The q/k/v `kvpot bench hip-reference` feeds both sides: random at a model shape, or captured from a real model.

Keys and queries are un-rotated (kvpot stores keys so, and hip-attn applies RoPE itself with
`need_apply_rope=True`); `rope` is kvpot's `Rope` over the model's own rotary module, whose table both use.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kvpot.methods.infinitehip import HipRuntime, InfiniteHiP
from kvpot.rope import Rope


@dataclass
class Inputs:
    query: torch.Tensor  # [heads, queries, d]: the last `queries` positions
    keys: torch.Tensor  # [kv_heads, n, d]
    values: torch.Tensor  # [kv_heads, n, d]
    rope: Rope
    scaling: float
    max_positions: int  # the model's trained window (hip-attn's model_context_length)
    source: str


def _rotary(config, device):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    if not isinstance(config, LlamaConfig):  # every shape kvpot benches rotates as Llama does
        config = LlamaConfig(**config.to_dict())
    return LlamaRotaryEmbedding(config=config).to(device)


def random_inputs(shape: str, n: int, queries: int, device: str, dtype: torch.dtype, seed: int) -> Inputs:
    from kvpot.models.shapes import get_shape, head_dim

    config = get_shape(shape).config()
    d, heads, kv = head_dim(config), config.num_attention_heads, config.num_key_value_heads
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(dtype)

    return Inputs(rand(heads, queries, d), rand(kv, n, d), rand(kv, n, d), Rope(_rotary(config, device)), d ** -0.5,
                  config.max_position_embeddings, f"random ({shape})")


class _Capture(HipRuntime):
    """kvpot's InfiniteHiP runtime that also keeps one layer's inputs of the forward that reaches `n` keys."""

    layer, n, seen = 0, 0, None

    def attend(self, index, query, keys, values, scaling, decoding):
        if index == self.layer and keys.shape[1] == self.n:
            self.seen = (query.clone(), keys.clone(), values.clone(), scaling)
        return super().attend(index, query, keys, values, scaling, decoding)


class _CaptureHiP(InfiniteHiP):
    layer_index, n = 0, 0
    runtime_seen: _Capture | None = None

    def runtime(self, num_layers, max_positions, rope):
        base = super().runtime(num_layers, max_positions, rope)
        capture = _Capture(base.plans, base.last_keep, base.refresh, rope, base.kernels, base.gpu_cache_tokens)
        capture.layer, capture.n = self.layer_index, self.n
        self.runtime_seen = capture
        return capture


def model_inputs(model, tokenizer, n: int, queries: int, layer: int, seed: int) -> Inputs:
    """One layer's un-rotated q/k/v of `model` reading `n` tokens of varied filler text (the haystack kvpot's
    tasks use), the last `queries` of them as one forward (the model reads through kvpot's InfiniteHiP)."""
    from kvpot import Engine
    from kvpot.tasks.haystack import varied_sentences

    sentences = varied_sentences(random.Random(seed))
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" ".join(next(sentences) for _ in range(64)), add_special_tokens=False)
    method = _CaptureHiP(chunk_size=queries)
    method.layer_index, method.n = layer, n
    ids = torch.tensor([ids[:n]], device=model.device)
    Engine(model, tokenizer, method=method).prefill_ids(ids)
    query, keys, values, scaling = method.runtime_seen.seen
    window = getattr(model.config, "max_position_embeddings", None) or n
    return Inputs(query, keys, values, method.runtime_seen.rope, scaling, window, f"model layer {layer}")
