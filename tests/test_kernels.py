"""Triton kernels against the PyTorch reference (`kvpot.methods.infinitehip.reference`), over a named list of shapes.

Runs on CUDA; on a CPU machine with Triton installed, `TRITON_INTERPRET=1 pytest tests/test_kernels.py`
runs the same kernels in Triton's interpreter. Elsewhere the module is skipped with the reason.
Inputs are fresh random draws (never zeros), outputs are poisoned before each kernel run, and
errors are ‖out − ref‖ / ‖ref‖ against a float64 (attention) or float32 (scan) reference.
"""

from __future__ import annotations

import dataclasses
import math

from types import SimpleNamespace

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels, skip_interpreted_bf16

from kvpot import kernels
from kvpot.methods.infinitehip.reference import (LayerPlan, MaskCache, Stage, _final_attention, _Scorer, prune, refresh_due,
                                                 sparse_attention)

DEVICE = KERNEL_DEVICE
pytestmark = needs_kernels()
interpreter_runtime_loops()


# (name, context n, queries q, kv heads, group g, head dim d, stage chunks, keep per stage)
SHAPES = [
    ("decode-gqa4-d128", 3001, 1, 2, 4, 128, (64, 16, 4), (512, 128, 64)),
    ("prefill-gqa4-d128", 2987, 70, 2, 4, 128, (64, 16, 4), (512, 128, 64)),
    ("decode-gqa1-d64", 2500, 1, 3, 1, 64, (32, 8), (256, 64)),
    ("prefill-gqa8-d64", 2222, 33, 1, 8, 64, (64, 8), (256, 64)),
    ("prefill-gqa1-d128", 1777, 129, 2, 1, 128, (32,), (128,)),
]
IDS = [s[0] for s in SHAPES]


def table(length: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)


def rotator(cos: torch.Tensor, sin: torch.Tensor):
    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[positions].to(x.dtype) + turned * sin[positions].to(x.dtype)

    return rotate


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the kernel's output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def make_plan(chunks, keep, prune_rope="relative", shared=True, window=96, sink=16, rows=32,
              final_rope="streaming") -> LayerPlan:
    return LayerPlan(tuple(Stage(c, k) for c, k in zip(chunks, keep)), sink, window, rows, prune_rope,
                     final_rope, shared)


def inputs(n, q, kv, g, d, dtype, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    query = torch.randn(kv * g, q, d, generator=gen, device=DEVICE).to(dtype)
    keys = torch.randn(kv, n, d, generator=gen, device=DEVICE).to(dtype)
    values = torch.randn(kv, n, d, generator=gen, device=DEVICE).to(dtype)
    return query, keys, values


SCHEDULES = {"fused": {"stepwise": False}, "stepwise": {"stepwise": True},
             "stepwise-narrow": {"stepwise": True, "block_c": 16},
             "stepwise-keys-rotated": {"stepwise": True, "turn": False}}


def scan_case(shape, prune_rope: str, shared: bool, scan: str, seed: int):
    """One stage's search inputs over a named shape: the plan, the RoPE table, the query blocks and candidate
    ranges of every length 0..chunk (some empty, some ending at the context's end), and the PyTorch scorer (the
    paper's or hip-attn's search) with its queries rotated for the first stage."""
    from kvpot.methods.infinitehip.reference import _HipScorer

    _, n, q, kv, g, d, chunks, _ = shape
    plan = dataclasses.replace(make_plan(chunks, (10**9,) * len(chunks), prune_rope, shared, rows=min(32, q)),
                               scan=scan)
    cos, sin = table(n + 200, d, torch.float32)
    query, keys, _ = inputs(n, q, kv, g, d, torch.float32, seed=n + q + (7 if scan == "hip" else 0))
    rows = plan.query_block
    blocks = math.ceil(q / rows)
    grouped = torch.nn.functional.pad(query, (0, 0, 0, blocks * rows - q)).view(kv, g, blocks, rows, d)
    positions = (n - q + torch.arange(blocks * rows, device=DEVICE)).view(blocks, rows)
    rows_valid = positions < n
    chunk = chunks[0]
    count = (n - plan.window) // chunk
    s = 1 if shared else kv
    starts = (torch.arange(count, device=DEVICE) * chunk).view(1, 1, -1).expand(s, blocks, -1).contiguous()
    lengths = torch.randint(0, chunk + 1, starts.shape, generator=torch.Generator(device=DEVICE).manual_seed(seed),
                            device=DEVICE)
    ends = torch.minimum(starts + lengths, torch.tensor(n, device=DEVICE))
    scorer = (_HipScorer if scan == "hip" else _Scorer)(grouped, rows_valid, keys, plan, positions.clamp(max=n - 1),
                                                         rotator(cos, sin))
    scorer.begin_stage(starts < ends, plan.stages[0])
    return SimpleNamespace(plan=plan, cos=cos, sin=sin, keys=keys, rows_valid=rows_valid, starts=starts, ends=ends,
                           chunk=chunk, scorer=scorer)


def assert_same_search(rep, score, ref_rep, ref_score, case):
    valid = case.starts < case.ends
    assert torch.equal(rep[valid], ref_rep[valid])
    assert torch.equal(score.isinf(), ref_score.isinf())
    torch.testing.assert_close(score[valid], ref_score[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("prune_rope", ["relative", "chunk", "absolute"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_stage_scan_matches_the_halving_search(shape, prune_rope, shared, schedule):
    from kvpot.kernels.hip import stage_scan

    case = scan_case(shape, prune_rope, shared, "paper", seed=1)
    ref_rep, ref_score = case.scorer.search(case.starts, case.ends, case.chunk)
    rep, score = stage_scan(case.scorer.rotated, case.rows_valid, case.keys, case.starts, case.ends, case.chunk,
                            prune_rope, shared, case.cos, case.sin, **SCHEDULES[schedule])
    assert_same_search(rep, score, ref_rep, ref_score, case)


@pytest.mark.parametrize(("prune_rope", "turn"), [("relative", True), ("relative", False), ("chunk", False),
                                                   ("absolute", False)],
                         ids=["relative-queries-turned", "relative-keys-rotated", "chunk", "absolute"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_hip_stage_scan_matches_hip_attns_search(shape, prune_rope, shared, turn):
    """`scan="hip"`: each query head on its own path, a range scored by the best probe its path met
    (`hipscan.HipSearch` in PyTorch is the reference), over ranges of every length, some empty, each searched
    whole (`reach`) while its left end is before its end."""
    from kvpot.kernels.hip import hip_stage_scan

    _, _, _, kv, g, _, _, _ = shape
    case = scan_case(shape, prune_rope, shared, "hip", seed=2)
    scorer = case.scorer
    ref_rep, ref_score = scorer.search(case.starts, case.ends, case.chunk)
    kvg = scorer.rotated.expand(kv, g, *scorer.rotated.shape[2:])
    rep, score = hip_stage_scan(kvg, case.rows_valid, case.keys, case.starts, case.ends, case.chunk, prune_rope,
                                case.cos, case.sin, turn=turn, block_c=16, reach=scorer.reach(case.starts, case.chunk))
    assert_same_search(rep, score, ref_rep, ref_score, case)


@pytest.mark.parametrize("scan", ["paper", "hip"])
@pytest.mark.parametrize("shape", SHAPES[:3], ids=IDS[:3])
def test_kernel_path_equals_the_reference_path_for_each_scan(shape, scan):
    """`sparse_attention` with a RoPE table against the PyTorch path for both searches (`scan="hip"` runs
    `hip_stage_scan`), float32, chunk-indexed positions: the same selection and output."""
    _, n, q, kv, g, d, chunks, keep = shape
    plan = dataclasses.replace(make_plan(chunks, keep, "chunk", False, rows=min(32, q)), scan=scan)
    cos, sin = table(n + plan.window + 2, d, torch.float32)
    query, keys, values = inputs(n, q, kv, g, d, torch.float32, seed=13)
    ref_masks, out_masks = MaskCache(), MaskCache()
    ref = sparse_attention(query, keys, values, d ** -0.5, plan, keep[-1], rotator(cos, sin), ref_masks, None)
    out = sparse_attention(query, keys, values, d ** -0.5, plan, keep[-1], rotator(cos, sin), out_masks, None,
                           table=(cos, sin))
    for a, b in zip(ref_masks.stages, out_masks.stages):
        assert torch.equal(a.starts, b.starts) and torch.equal(a.ends, b.ends)
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("schedule", ["fused", "stepwise", "stepwise-keys-rotated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=IDS[:2])
def test_stage_scan_in_half_precision_agrees_where_the_search_is_not_a_near_tie(shape, dtype, schedule):
    """bf16/fp16 rotate in float32 in the kernel and in the input dtype in the reference, so a
    near-tie between two halves may go either way; nearly every representative must agree and
    the scores of agreeing ones must match to the dtype's precision."""
    from kvpot.kernels.hip import stage_scan

    skip_interpreted_bf16(dtype)
    _, n, q, kv, g, d, chunks, _ = shape
    plan = make_plan(chunks, (10**9,) * len(chunks), "relative", True, rows=min(32, q))
    cos, sin = table(n + 200, d, dtype)
    query, keys, _ = inputs(n, q, kv, g, d, dtype, seed=7)
    rows = plan.query_block
    blocks = math.ceil(q / rows)
    grouped = torch.nn.functional.pad(query, (0, 0, 0, blocks * rows - q)).view(kv, g, blocks, rows, d)
    positions = (n - q + torch.arange(blocks * rows, device=DEVICE)).view(blocks, rows)
    chunk = chunks[0]
    count = (n - plan.window) // chunk
    starts = (torch.arange(count, device=DEVICE) * chunk).view(1, 1, -1).expand(1, blocks, -1).contiguous()
    ends = starts + chunk
    scorer = _Scorer(grouped, positions < n, keys, plan, positions.clamp(max=n - 1), rotator(cos, sin))
    scorer.begin_stage(starts < ends)
    ref_rep, ref_score = scorer.search(starts, ends, chunk)
    rep, score = stage_scan(scorer.rotated, positions < n, keys, starts, ends, chunk, "relative", True, cos, sin,
                            **SCHEDULES[schedule])
    same = rep == ref_rep
    assert same.float().mean() >= 0.9
    torch.testing.assert_close(score[same], ref_score[same], rtol=2e-2, atol=2e-1)


def _selection(shape, dtype, shared, seed):
    _, n, q, kv, g, d, chunks, keep = shape
    plan = make_plan(chunks, keep, "relative", shared, rows=min(32, q))
    cos, sin = table(n + plan.window + 2, d, dtype)
    rotate = rotator(cos, sin)
    query, keys, values = inputs(n, q, kv, g, d, dtype, seed)
    rows = plan.query_block
    blocks = math.ceil(q / rows)
    block_q = torch.nn.functional.pad(query, (0, 0, 0, blocks * rows - q)).view(kv * g, blocks, rows, d)
    positions = (n - q + torch.arange(blocks * rows, device=DEVICE)).view(blocks, rows)
    rows_valid = positions < n
    positions = positions.clamp(max=n - 1)
    window_start = (positions[:, 0] + 1 - plan.window).clamp(min=plan.sink)
    stages = prune(block_q.view(kv, g, blocks, rows, d), rows_valid, keys, plan, keep[-1], positions,
                   window_start, rotate)
    width = int((positions.amax(-1) - window_start).max()) + 1
    return plan, (cos, sin), rotate, query, keys, values, block_q, positions, rows_valid, stages[-1], width


@pytest.mark.parametrize("final_rope", ["streaming", "absolute"])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_sparse_attention_kernel_matches_the_final_attention(shape, dtype, shared, final_rope):
    from kvpot.kernels import hip

    skip_interpreted_bf16(dtype)
    plan, tab, rotate, query, keys, values, block_q, positions, rows_valid, selection, width = _selection(
        shape, dtype, shared, seed=3)
    if final_rope == "absolute":
        plan = make_plan(shape[6], shape[7], "relative", shared, rows=plan.query_block, final_rope="absolute")
    h, q, d = query.shape
    scaling = d ** -0.5
    ref = _final_attention(block_q.permute(1, 0, 2, 3).double(), keys.double(), values.double(), scaling,
                           selection, plan.stages[-1].chunk, plan, positions, rows_valid,
                           rotator(tab[0].double(), tab[1].double()), width)  # [B, h, R, d]
    ref = ref.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :q]
    tiles = [(None, None), (1, None), (3, None)]
    if dtype != torch.float32:  # wider query tiles (prefill tuning) are only offered in half precision
        tiles += [(None, 128), (2, 256)]
    for splits, block_m in tiles:
        out = hip.sparse_attention(query, keys, values, scaling, selection.starts, selection.ends,
                                   plan.stages[-1].chunk, selection.window_start, width, plan.sink,
                                   plan.query_block, final_rope == "streaming", *tab, splits=splits,
                                   block_m=block_m)
        assert out.shape == (h, q, d) and out.dtype == dtype
        limit = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel_error(out, ref) < limit, (splits, block_m)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_kernel_path_equals_the_reference_path(shape):
    """`sparse_attention` with a RoPE table (scan + attention kernels) against the PyTorch path,
    float32: same selection, same output, through five decoding steps of mask caching."""
    _, n, q, kv, g, d, chunks, keep = shape
    plan = make_plan(chunks, keep, "chunk", True, rows=min(32, q))
    cos, sin = table(n + 8 + plan.window + 2, d, torch.float32)
    rotate = rotator(cos, sin)
    query, keys, values = inputs(n + 5, q, kv, g, d, torch.float32, seed=11)
    scaling = d ** -0.5
    ref = sparse_attention(query, keys[:, :n], values[:, :n], scaling, plan, keep[-1], rotate)
    out = sparse_attention(query, keys[:, :n], values[:, :n], scaling, plan, keep[-1], rotate, table=(cos, sin))
    assert rel_error(out, ref) < 1e-5
    masks_ref, masks_kernel = MaskCache(), MaskCache()
    for step in range(5):  # decoding: stages cached between refreshes (steps 1, 2 and 4 recompute nothing)
        due = refresh_due(step, (3, 3, 1)[: len(chunks) - 1] + (3,))
        m = n + step + 1
        one = query[:, -1:]
        ref = sparse_attention(one, keys[:, :m], values[:, :m], scaling, plan, keep[-1], rotate, masks_ref, due)
        out = sparse_attention(one, keys[:, :m], values[:, :m], scaling, plan, keep[-1], rotate, masks_kernel, due,
                               table=(cos, sin))
        assert masks_ref.recomputed[-1] == masks_kernel.recomputed[-1]
        assert torch.equal(masks_ref.stages[-1].starts, masks_kernel.stages[-1].starts)
        assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_engine_with_kernels_generates_the_same_tokens(arch):
    """A whole model through the Engine: the Triton path and the PyTorch path pick the same tokens
    (prefill with pruning in every block, then decoding through two refresh periods)."""
    import kvpot
    from conftest import VOCAB, build

    model = build(arch, hidden_size=128, head_dim=32).to(DEVICE)  # the kernels need head dims >= 32
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (400,))
    out = {}
    for kernels_choice in ("torch", "triton"):
        method = kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(64, 32, 16), early_keep=32,
                                   query_block=8, chunk_size=50, refresh=(4, 2, 1), kernels=kernels_choice)
        out[kernels_choice] = kvpot.Engine(model, method=method).generate_ids(ids, max_new_tokens=10).token_ids
    assert out["triton"] == out["torch"]


def test_unsupported_head_dims_fall_back_or_refuse():
    import kvpot
    from conftest import VOCAB, build
    from kvpot.errors import KvpotError

    assert [d for d in (16, 24, 32, 48, 64, 96, 128, 256) if kernels.supports_head_dim(d)] == [32, 64, 128, 256]
    model = build("llama3").to(DEVICE)  # head dim 16
    ids = torch.randint(3, VOCAB, (200,))
    settings = dict(sink=8, window=16, chunks=(32, 8, 2), keep=(64, 32, 16), early_keep=32, query_block=8, chunk_size=50)
    auto = kvpot.Engine(model, method=kvpot.InfiniteHiP(**settings)).generate_ids(ids, max_new_tokens=3).token_ids
    torch_path = kvpot.Engine(model, method=kvpot.InfiniteHiP(**settings, kernels="torch")).generate_ids(
        ids, max_new_tokens=3).token_ids
    assert auto == torch_path
    with pytest.raises(KvpotError, match="head dim 16"):
        kvpot.Engine(model, method=kvpot.InfiniteHiP(**settings, kernels="triton")).generate_ids(ids, max_new_tokens=1)


def test_gpu_cache_keeps_the_most_recently_used_entries():
    from kvpot.methods.infinitehip.offload import GpuKvCache

    gen = torch.Generator(device=DEVICE).manual_seed(5)
    keys = torch.randn(2, 500, 32, generator=gen, device=DEVICE)
    values = torch.randn(2, 500, 32, generator=gen, device=DEVICE)
    cache = GpuKvCache(16, 2, 32, keys.dtype, torch.device(DEVICE))
    cache.ensure(500)

    def touch(tokens, valid=None):
        tokens = torch.tensor(tokens, device=DEVICE)
        cache.touch(tokens, torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid, keys, values)

    def consistent():
        for slot, token in enumerate(cache.token_of[:16].tolist()):
            if token >= 0 and int(cache.slot_of[token]) == slot:
                assert torch.equal(cache.keys[:, slot], keys[:, token])
                assert torch.equal(cache.values[:, slot], values[:, token])
        held = (cache.slot_of[:500] >= 0).nonzero().flatten().tolist()
        for token in held:
            assert int(cache.token_of[int(cache.slot_of[token])]) == token

    touch([1, 2, 3, 4])
    assert (int(cache.hits), int(cache.used)) == (0, 4)
    touch([1, 2, 3, 4])
    assert (int(cache.hits), int(cache.used)) == (4, 8)
    touch([10, 11, 12, 13, 14, 15, 16, 17])  # fills the cache: 4 + 8 = 12 of 16 slots
    touch([20, 21, 22, 23, 24, 25, 26, 27], torch.tensor([True] * 6 + [False] * 2, device=DEVICE))
    consistent()
    assert int(cache.used) == 8 + 8 + 6
    held = set((cache.slot_of[:500] >= 0).nonzero().flatten().tolist())
    assert {20, 21, 22, 23, 24, 25} <= held and not {26, 27} & held
    # 6 misses: the 4 free slots, then 2 of the least recently used (1-4, last used a step before 10-17)
    assert set(range(10, 18)) <= held and len({1, 2, 3, 4} & held) == 2
    touch(sorted({1, 2, 3, 4} & held) + [20])
    assert int(cache.hits) == 4 + 3
    with pytest.raises(Exception, match="too small"):
        touch(list(range(100, 109)))  # 9 reads need 18 slots


def test_admitting_the_newest_key_in_one_launch_matches_the_torch_path():
    """`admit_newest` (a fixed-shape step's GPU-cache update between refreshes) leaves the cache exactly as
    the PyTorch operations do: hits stamped, misses in the least recently used slot (the first of equal
    stamps), the evicted token's slot cleared, rows copied, counters advanced."""
    from kvpot.methods.infinitehip.offload import GpuKvCache

    gen = torch.Generator(device="cpu").manual_seed(11)
    keys = torch.randn(3, 300, 32, generator=gen).to(DEVICE)
    values = torch.randn(3, 300, 32, generator=gen).to(DEVICE)
    caches = [GpuKvCache(16, 3, 32, keys.dtype, torch.device(DEVICE)) for _ in range(2)]
    for cache in caches:
        cache.ensure(300)
        tokens = torch.tensor([0, 1, 2, 3, 40, 41, 42], device=DEVICE)
        cache.touch(tokens, torch.ones_like(tokens, dtype=torch.bool), keys, values)  # 7 of 16 slots
    # misses into free slots, then evictions of the oldest, hits (41, 100), a re-admitted evicted token (0)
    sequence = [100, 101, 41, 102, 103, 104, 105, 106, 107, 108, 109, 110, 100, 111, 0, 112]
    for token in sequence:
        caches[0].touch_newest(torch.tensor([token], device=DEVICE), keys, values, fused=True)
        caches[1].touch_newest(token, keys, values, fused=False)
    fused, reference = caches
    for name in ("slot_of", "token_of", "stamp", "tick", "hits", "used", "set_size", "keys", "values"):
        assert torch.equal(getattr(fused, name), getattr(reference, name)), name
    # 9 free slots take 100-108; 109, 110, 111, 112 (and 0 if it was out) evict the first seven but 41 (a
    # hit), in an order set by their slots (a tie of stamps): one of 1, 2, 3, 40, 42 stays
    held = set((fused.slot_of[:300] >= 0).nonzero().flatten().tolist())
    assert len(held) == 16 and {0, 41, 100, 112} <= held and len({1, 2, 3, 40, 42} & held) == 1


@pytest.mark.parametrize("kv, dk, dv", [(2, 32, 32), (3, 64, 48), (1, 128, 128)],
                         ids=["kv2-d32", "kv3-dk64-dv48", "kv1-d128"])
def test_store_entry_writes_one_entry_at_the_device_slot(kv, dk, dv):
    """The offloaded append of a fixed-shape step: key, value and both positions land at the device-side
    slot of the host buffers (pinned on CUDA), every other entry untouched."""
    from kvpot.host_memory import host_empty
    from kvpot.kernels.hip import store_entry

    n = 40
    gen = torch.Generator(device="cpu").manual_seed(kv * dk + dv)

    def buffer(*shape, dtype=torch.float32):
        out = host_empty(shape, dtype) if DEVICE == "cuda" else torch.empty(shape, dtype=dtype)
        return out.copy_(torch.randn(shape, generator=gen).to(dtype) if dtype.is_floating_point
                         else torch.randint(0, 1000, shape, generator=gen))

    keys, values = buffer(kv, n, dk, dtype=torch.bfloat16), buffer(kv, n, dv, dtype=torch.bfloat16)
    positions, rope_positions = buffer(kv, n, dtype=torch.long), buffer(kv, n, dtype=torch.long)
    before = [t.clone() for t in (keys, values, positions, rope_positions)]
    key = torch.randn(kv, dk, generator=gen).to(DEVICE, torch.bfloat16)
    value = torch.randn(kv, dv, generator=gen).to(DEVICE, torch.bfloat16)
    position = torch.full((kv,), 123456, device=DEVICE)
    rope_position = torch.arange(kv, device=DEVICE) + 7
    slot = torch.tensor([17], device=DEVICE)
    store_entry(keys, values, positions, rope_positions, slot, key, value, position, rope_position)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    expected = [b.clone() for b in before]
    for buf, new in zip(expected, (key, value, position, rope_position)):
        buf[:, 17] = new.cpu()
    for got, want in zip((keys, values, positions, rope_positions), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("gpu_cache_tokens, refresh, scan", [(160, (4, 2, 1), "paper"), (4096, (4, 4, 4), "paper"),
                                                              (160, (4, 2, 1), "hip")])
def test_offloaded_and_resident_runs_produce_the_same_tokens(gpu_cache_tokens, refresh, scan):
    """offload=True (entries in pinned host memory on CUDA, read through an LRU GPU cache) computes the
    same attention as the resident run: same tokens, with a small cache that evicts and a large one."""
    import kvpot
    from conftest import VOCAB, build

    model = build("llama3", hidden_size=128, head_dim=32).to(DEVICE)
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (400,))
    settings = dict(sink=8, window=16, chunks=(32, 8, 2), keep=(64, 32, 16), early_keep=32, query_block=8,
                    chunk_size=50, refresh=refresh, kernels="triton", scan=scan)
    resident = kvpot.Engine(model, method=kvpot.InfiniteHiP(**settings)).generate_ids(ids, max_new_tokens=12)
    engine = kvpot.Engine(model, method=kvpot.InfiniteHiP(**settings, offload=True, gpu_cache_tokens=gpu_cache_tokens))
    state = engine.prefill_ids(ids)
    layer = state.cache.layers[0]
    if DEVICE == "cuda":
        assert layer.keys.device.type == "cpu" and layer.keys.is_pinned()
    offloaded = engine.generate_ids(state=state, max_new_tokens=12)
    assert offloaded.token_ids == resident.token_ids
    report = offloaded.stats.method["offload"]  # 11 decoding forwards, every layer's reads counted
    assert report["reads"] > 0 and 0 <= report["hits"] <= report["reads"]
    runtime = state.cache.attention
    assert runtime.offload_stats()["reads"] == 0  # the state is not consumed: its copy decoded
    again = engine.generate_ids(state=state, max_new_tokens=12, keep_state=False)
    assert again.token_ids == resident.token_ids
    assert again.stats.method["offload"] == report  # decoded in the state's own cache: the same reads
    stats = [c for c in runtime.gpu_caches if c is not None]
    assert stats and all(c.keys.shape[1] == gpu_cache_tokens for c in stats)


@pytest.mark.skipif(DEVICE != "cuda", reason="page-locking host memory needs CUDA")
def test_host_buffers_are_page_locked_at_their_exact_size_and_unlocked_when_freed():
    """Offloaded caches take exactly their size (torch's pinned cache would round 1 GiB + 2 MiB up to
    2 GiB); a kernel reads them in place; freeing unlocks them, so the same pages lock again."""
    from kvpot.kernels.hip import fetch
    from kvpot.host_memory import host_empty

    for _ in range(3):  # a page still locked after its tensor died would make the next lock fail
        keys = host_empty((2, 1000, 64), torch.float16)
        values = host_empty((2, 1000, 64), torch.float16)
        assert keys.untyped_storage().nbytes() == 2 * 1000 * 64 * 2 and keys.is_pinned()
        keys.copy_(torch.randn(2, 1000, 64).half())
        values.copy_(torch.randn(2, 1000, 64).half())
        gpu_k = torch.zeros(2, 8, 64, dtype=torch.float16, device=DEVICE)
        gpu_v = torch.zeros_like(gpu_k)
        tokens = torch.tensor([0, 999, 500], device=DEVICE)
        fetch(keys, values, gpu_k, gpu_v, tokens, torch.tensor([3, 0, 7], device=DEVICE))
        assert torch.equal(gpu_k[:, [3, 0, 7]].cpu(), keys[:, [0, 999, 500]])
        assert torch.equal(gpu_v[:, [3, 0, 7]].cpu(), values[:, [0, 999, 500]])
        del keys, values


def test_read_counts_between_refreshes_match_a_full_touch():
    """`touch_newest` counts what `touch` would count for the same read set (the last one plus the
    newest key), and leaves the same keys cached."""
    from kvpot.methods.infinitehip.offload import GpuKvCache

    gen = torch.Generator(device=DEVICE).manual_seed(9)
    keys = torch.randn(2, 300, 32, generator=gen, device=DEVICE)
    values = torch.randn(2, 300, 32, generator=gen, device=DEVICE)
    full, incremental = (GpuKvCache(64, 2, 32, keys.dtype, torch.device(DEVICE)) for _ in range(2))
    base = list(range(0, 8)) + list(range(100, 116))
    for cache in (full, incremental):
        cache.ensure(300)
        cache.touch(torch.tensor(base, device=DEVICE), torch.ones(len(base), dtype=torch.bool, device=DEVICE),
                    keys, values)
    for newest in (200, 201, 202):
        base = base + [newest]
        full.touch(torch.tensor(base, device=DEVICE), torch.ones(len(base), dtype=torch.bool, device=DEVICE),
                   keys, values)
        incremental.touch_newest(newest, keys, values)
        assert (int(full.hits), int(full.used)) == (int(incremental.hits), int(incremental.used))
    held = (incremental.slot_of[:300] >= 0).nonzero().flatten().tolist()
    assert held == sorted(base)
    for slot, token in enumerate(incremental.token_of[:64].tolist()):
        if token >= 0:
            assert torch.equal(incremental.keys[:, slot], keys[:, token])
