"""Regional compilation of the fixed-shape decoding step (`Engine(compile_step=True)`).

`torch.compile` of the whole decoder traces every layer again and hands inductor one graph as deep as
the model: compiling the `llama3-8b` step (32 layers) did not finish in 140 s on an H100. The decoder's
layers are one block repeated, so the step compiles that block once and runs every layer through it
(PyTorch's "regional compilation" recipe; with nn.Module inlining, the default since 2.5, a layer's
weights are inputs of the compiled code, not constants baked into it). The embedding, the final norm
and the rotary table run uncompiled around the layers, as before compilation.

One compilation serves all layers only if nothing a layer reads is picked by a Python integer that
differs between layers: transformers' attention passes `self.layer_idx`, an nn.Module integer that
the compiler specialises on, into the cache. Each layer is therefore handed a `LayerView` of kvpot's
cache, which carries its layer (`kvpot.attention.LayerView`). Where a method's fixed-shape attention
still indexes by layer (InfLLM, InfiniteHiP), the layers compile one by one, each in full: the
compiler names each dynamic size after where it was read (`...layers[3].keys.size(2)` -> `s87`), so
the layers' graphs differ in those names and inductor's FX-graph cache serves none of them to the next
layer (measured on a CPU: every layer a miss). The recompile
limit is set above that count, so no layer silently falls back to eager.

The compiled layer is installed only while the step runs, in the slot `nn.Module.compile()` fills
(`_compiled_call_impl`), and the slot's previous value is put back after it: the model's forward is
never replaced, and the model's other calls (prefill, eager steps, another engine on the same model)
run exactly as without `compile_step` (kvpot runs a model's forwards on one thread: the server's worker).
"""

from __future__ import annotations

import torch

from kvpot.attention import LayerView
from kvpot.compat import NEW_NAME, OLD_NAME
from kvpot.errors import KvpotError

# Compilations allowed before PyTorch would run the rest eagerly: a method whose fixed-shape attention
# indexes by layer compiles each layer apart, in each of its step forms (InfiniteHiP: up to 3)
_FORMS_PER_LAYER, _SPARE_COMPILES = 4, 8


def _run_layer(layer: torch.nn.Module, *args, **kwargs):
    # nn.Module._call_impl, as nn.Module.compile() compiles it: the layer's hooks run too
    return layer._call_impl(*args, **kwargs)


def decoder_layers(decoder: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's repeated blocks (every supported architecture names them `layers`)."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise KvpotError(f"compile_step: {type(decoder).__name__} has no `layers` list of decoder layers.")
    return layers


class CompiledStep:
    """Calls the decoder as the step does, each decoder layer through one `torch.compile`d block."""

    def __init__(self, decoder: torch.nn.Module):
        self.decoder = decoder
        self.layers = decoder_layers(decoder)
        # dynamic from the start: the host-side counts a layer reads change at every step, and a
        # recompilation must never fall inside a CUDA graph's capture
        self.block = torch.compile(_run_layer, dynamic=True)
        self.limit = _FORMS_PER_LAYER * len(self.layers) + _SPARE_COMPILES
        self.callers = [self._caller(index, layer) for index, layer in enumerate(self.layers)]

    def __call__(self, *args, **kwargs):
        previous = [layer._compiled_call_impl for layer in self.layers]
        for layer, caller in zip(self.layers, self.callers):
            layer._compiled_call_impl = caller
        try:
            with recompile_limit(self.limit):
                return self.decoder(*args, **kwargs)
        finally:
            for layer, slot in zip(self.layers, previous):
                layer._compiled_call_impl = slot

    def _caller(self, index: int, layer: torch.nn.Module):
        block = self.block

        def call(*args, **kwargs):
            return block(layer, *args, **_with_view(kwargs, index))

        return call


def recompile_limit(limit: int):
    """Dynamo's per-function recompile limit raised to at least `limit` while the step runs (a context
    manager). `torch.compile(recompile_limit=...)` is newer than the torch range kvpot allows
    (torch 2.11 on the H100 refused the keyword; 2.13 takes it), and the setting was `cache_size_limit`
    before torch 2.6."""
    import torch._dynamo.config as config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(getattr(config, name), limit)})


def _with_view(kwargs: dict, index: int) -> dict:
    """The layer's keyword arguments with kvpot's cache (under transformers' name for it, and as
    `kvpot_cache` for the attention function) replaced by a view of its layer."""
    cache = kwargs.get("kvpot_cache")
    if cache is None:
        raise KvpotError("compile_step: a decoder layer was called without kvpot's cache.")
    view = LayerView(cache, index)
    out = dict(kwargs, kvpot_cache=view)
    for name in (NEW_NAME, OLD_NAME):
        if kwargs.get(name) is cache:
            out[name] = view
    return out
