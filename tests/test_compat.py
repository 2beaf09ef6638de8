"""kvpot.compat: the cache goes to the model under the name the installed transformers expects.

transformers 5.24 renamed `past_key_values` to `cache` (the old name warns with a FutureWarning and is
removed in 5.40); CI runs this file under the oldest and the newest transformers the pins allow.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from transformers.utils.deprecation import deprecate_kwarg

import kvpot
from conftest import ARCH_CONFIGS, build
from kvpot.bench.hf import hf_decode_row
from kvpot.compat import cache_from_kwargs, cache_kwargs, cache_name

RENAMED_IN = Version("5.24")  # the first transformers whose decoders take `cache`


def installed_name() -> str:
    return "cache" if Version(transformers.__version__).release >= RENAMED_IN.release else "past_key_values"


def deprecations(caught) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in caught
            if issubclass(w.category, (FutureWarning, DeprecationWarning))]


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_cache_kwargs_names_the_installed_transformers_keyword(arch):
    model = build(arch)
    for module in (model, model.get_decoder(), model.get_decoder().layers[0].self_attn):
        assert cache_kwargs(module, "the cache") == {installed_name(): "the cache"}, type(module).__name__


def test_the_name_comes_from_the_undecorated_forward():
    class Renamed(torch.nn.Module):
        @deprecate_kwarg("past_key_values", "99.0.0", new_name="cache")
        def forward(self, x, cache=None):
            return cache

    class Old(torch.nn.Module):
        def forward(self, x, past_key_values=None):
            return past_key_values

    assert cache_name(Renamed()) == "cache" and cache_name(Old()) == "past_key_values"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Renamed()(1, **cache_kwargs(Renamed(), "c")) == "c" and Old()(1, **cache_kwargs(Old(), "c")) == "c"
    assert deprecations(caught) == []


def test_cache_from_kwargs_reads_either_name():
    assert cache_from_kwargs({"cache": "new", "hidden_states": 0}) == "new"
    assert cache_from_kwargs({"past_key_values": "old"}) == "old"
    assert cache_from_kwargs({"cache": None, "past_key_values": "old"}) == "old"
    assert cache_from_kwargs({"hidden_states": 0}) is None


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_kvpot_forwards_raise_no_deprecation_warning(arch, decode):
    """Prefill, compression and both CPU decoding paths (`_run_model`, `_static_step`) on every
    architecture, and the plain-transformers bench baseline: no FutureWarning or DeprecationWarning."""
    model = build(arch)
    torch.manual_seed(0)
    ids = torch.randint(3, 90, (48,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method in (kvpot.Full(chunk_size=16), kvpot.SnapKV(budget=24, window=4, chunk_size=16)):
            engine = kvpot.Engine(model, method=method, decode=decode)
            assert len(engine.generate_ids(ids[:40], ids[40:], max_new_tokens=4, ignore_eos=True).token_ids) == 4
        hf_decode_row(model, ids[:40], ids[40:], steps=2, warmup=0, device="cpu")
    assert deprecations(caught) == []


def test_build_hands_overrides_to_the_config_at_init():
    """What a config derives at init follows the overrides: transformers 5.13-5.17 fix head_dim there, so an override
    set afterwards left it at COMMON's 16 (the batch-invariant GPU test's model then had a head dim the kernels refuse)."""
    assert build("llama3", hidden_size=256, num_attention_heads=4).config.head_dim == 64
    assert build("qwen3").config.head_dim == 16 and build("qwen3", head_dim=32).config.head_dim == 32
