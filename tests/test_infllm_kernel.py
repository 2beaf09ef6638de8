"""InfLLM's Triton step (`kvpot.kernels.infllm`) against its PyTorch reference, and InfLLM on a GPU:
CUDA-graph decoding and offloading give the tokens of eager, resident runs.

The kernel tests run on CUDA, or on a CPU under `TRITON_INTERPRET=1`; the engine tests are marked gpu.
Errors are ||out - ref|| / ||ref|| against the float32 reference.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, VOCAB, build, interpreter_runtime_loops, needs_kernels

import kvpot
from kvpot.methods.infllm import decode
from kvpot.methods.infllm.runtime import Sizes
from kvpot.rope import rotate_half

DEVICE = KERNEL_DEVICE
interpreter_runtime_loops()

# (name, kv heads, group, head dim, sizes, capacity N, topk units selected)
SHAPES = [
    ("gqa4-d128-release", 2, 4, 128, Sizes(initial=128, window=512, block=128, reps=4, topk=8, lookup=64), 3000),
    ("gqa1-d64-small-units", 3, 1, 64, Sizes(initial=4, window=100, block=16, reps=2, topk=5, lookup=16), 900),
    ("gqa8-d64-no-initial", 1, 8, 64, Sizes(initial=0, window=64, block=32, reps=1, topk=3, lookup=32), 700),
]
IDS = [s[0] for s in SHAPES]


def table(length: int, d: int, dtype: torch.dtype):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel's output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def inputs(shape, dtype, seed=0):
    _, kv, g, d, sizes, n = shape
    generator = torch.Generator(device="cpu").manual_seed(seed)
    keys = torch.randn(kv, n, d, generator=generator).to(DEVICE, dtype)
    values = torch.randn(kv, n, d, generator=generator).to(DEVICE, dtype)
    query = torch.randn(kv * g, d, generator=generator).to(DEVICE, dtype)
    score = torch.randn(kv, n, generator=generator).to(DEVICE)
    return query, keys, values, score


def reference(query, keys, values, score, t, selected, sizes, cos, sin):
    def rotate(x, positions):
        return x * cos[positions].to(x.dtype) + rotate_half(x) * sin[positions].to(x.dtype)

    far_turn = rotate(query.float(), torch.full((query.shape[0],), sizes.window, device=DEVICE)) * cos[0].float()
    c = decode.counts(t, sizes.initial, sizes.window, sizes.block)
    return decode.step_reference(query, keys, values, score, c, selected, sizes, query.shape[-1] ** -0.5, rotate,
                                 far_turn)


pytestmark_kernels = needs_kernels()


@pytestmark_kernels
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("where", ["early", "partial-units", "late"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_step_kernel_matches_the_reference(shape, where, dtype):
    from kvpot.kernels.infllm import decode_step

    _, kv, g, d, sizes, n = shape
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter has no bfloat16 dot")
    position = {"early": sizes.window // 2, "partial-units": sizes.window + sizes.initial + 2 * sizes.block + 3,
                "late": n - 7}[where]
    query, keys, values, score = inputs(shape, dtype)
    cos, sin = table(sizes.window + 1, d, dtype)
    t = torch.tensor([position], device=DEVICE)
    units = max(0, position - sizes.window + 1 - sizes.initial) // sizes.block
    selected = torch.randperm(max(units + 3, sizes.topk), device="cpu")[: sizes.topk].to(DEVICE)  # some not complete
    ref_score, got_score = score.clone(), score.clone()
    want = reference(query, keys, values, ref_score, t, selected, sizes, cos, sin)
    for splits in (None, 1, 3):
        got_score.copy_(score)
        got = decode_step(query, keys, values, got_score, t, selected, sizes, d**-0.5, cos, sin, splits=splits)
        assert rel_error(got, want) < (2e-2 if dtype == torch.bfloat16 else 1e-5), splits
        torch.testing.assert_close(got_score, ref_score, atol=(0.5 if dtype == torch.bfloat16 else 1e-3), rtol=2e-2)
    # only the window's keys, up to the query, took a share
    changed = (got_score != score).any(0).nonzero().flatten()
    assert changed.numel() > 0 and int(changed.min()) >= max(0, position - sizes.window + 1)
    assert int(changed.max()) <= position


@pytestmark_kernels
@pytest.mark.skipif(DEVICE != "cuda", reason="pinned host memory needs CUDA")
def test_step_kernel_reads_host_memory_through_the_gpu_cache():
    from kvpot.host_memory import host_empty
    from kvpot.kernels.infllm import decode_step
    from kvpot.methods.infinitehip.offload import GpuKvCache

    shape = SHAPES[0]
    _, kv, g, d, sizes, n = shape
    query, keys, values, score = inputs(shape, torch.bfloat16, seed=1)
    host_k, host_v = host_empty((kv, n, d), torch.bfloat16), host_empty((kv, n, d), torch.bfloat16)
    host_k.copy_(keys.cpu())
    host_v.copy_(values.cpu())
    cos, sin = table(sizes.window + 1, d, torch.bfloat16)
    t = torch.tensor([n - 5], device=DEVICE)
    selected = torch.arange(sizes.topk, device=DEVICE) * 2
    cache = GpuKvCache(4096, kv, d, torch.bfloat16, torch.device(DEVICE))
    cache.ensure(n)
    half = torch.arange(0, n, 2, device=DEVICE)[:1500]  # every other token cached: reads mix both sources
    cache.touch(half, torch.ones_like(half, dtype=torch.bool), host_k, host_v)
    resident_score, offload_score = score.clone(), score.clone()
    want = decode_step(query, keys, values, resident_score, t, selected, sizes, d**-0.5, cos, sin)
    got = decode_step(query, host_k, host_v, offload_score, t, selected, sizes, d**-0.5, cos, sin, gpu_cache=cache)
    assert rel_error(got, want) < 1e-6
    torch.testing.assert_close(offload_score, resident_score)


# ---------------------------------------------------------------------------- the method on a GPU


def method(**kw) -> kvpot.InfLLM:
    args = dict(initial=8, window=64, block_size=16, representatives=2, topk=4, lookup=32, chunk_size=64)
    args.update(kw)
    return kvpot.InfLLM(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_decoding_gives_the_eager_tokens(dtype):
    model = build("llama3", hidden_size=128, head_dim=32).to("cuda", dtype)  # head dim 32: the kernel runs
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (500,))
    eager = kvpot.Engine(model, method=method(kernels="torch"), decode="eager").generate_ids(
        ids, max_new_tokens=48, ignore_eos=True)
    graph = kvpot.Engine(model, method=method(kernels="triton"), decode="graph", runner="sequence").generate_ids(
        ids, max_new_tokens=48, ignore_eos=True)
    assert graph.stats.decode["replays"] > 40 and graph.stats.decode["captures"] == 1
    same = sum(a == b for a, b in zip(graph.token_ids, eager.token_ids))
    assert graph.token_ids == eager.token_ids or (dtype == torch.bfloat16 and same >= 40), (graph.token_ids,
                                                                                          eager.token_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_cache_tokens", [512, 8192])
def test_offloaded_and_resident_runs_give_the_same_tokens(gpu_cache_tokens):
    model = build("llama3", hidden_size=128, head_dim=32).to("cuda")
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (600,))
    resident = kvpot.Engine(model, method=method(kernels="triton"), decode="eager").generate_ids(
        ids, max_new_tokens=24, ignore_eos=True)
    engine = kvpot.Engine(model, method=method(offload=True, gpu_cache_tokens=gpu_cache_tokens))
    state = engine.prefill_ids(ids)
    layer = state.cache.layers[0]
    assert layer.keys.device.type == "cpu" and layer.keys.is_pinned()
    offloaded = engine.generate_ids(state=state, max_new_tokens=24, ignore_eos=True)
    assert offloaded.token_ids == resident.token_ids
    assert offloaded.stats.decode["eager_steps"] == 23  # offloaded steps run eagerly
    report = offloaded.stats.method["offload"]
    assert report["reads"] > 0 and 0 < report["hits"] <= report["reads"]
    caches = state.cache.attention.gpu_caches.values()
    assert caches and all(c.keys.shape[1] == gpu_cache_tokens for c in caches)  # the GPU holds the cache only
