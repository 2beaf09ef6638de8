"""InfiniteHiP's fixed-shape decoding step (kvpot.methods.infinitehip.fixed): the same selections and
outputs as the eager step (reference.sparse_attention with a MaskCache), through mask refreshes; the
engine's static and graph decoding give the eager tokens, offloaded too; offloaded decoding reports its
host traffic.

The kernel cases run on CUDA, or on a CPU under `TRITON_INTERPRET=1`; the graph tests are marked gpu.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import KERNEL_DEVICE, VOCAB, build, interpreter_runtime_loops, needs_kernels, rope_table

import kvpot
from kvpot.methods.infinitehip.fixed import FixedMasks, fixed_step, stage_sizes, width_bound
from kvpot.methods.infinitehip.reference import LayerPlan, MaskCache, Stage, refresh_due, sparse_attention
from kvpot.rope import rotate_half

interpreter_runtime_loops()


def rotator(cos: torch.Tensor, sin: torch.Tensor):
    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x * cos[positions].to(x.dtype) + rotate_half(x) * sin[positions].to(x.dtype)

    return rotate


def make_plan(prune_rope: str, shared: bool, final_rope: str = "streaming", scan: str = "paper") -> LayerPlan:
    return LayerPlan(stages=(Stage(64, 256), Stage(16, 64), Stage(4, 32)), sink=8, window=32, query_block=16,
                     prune_rope=prune_rope, final_rope=final_rope, shared=shared, scan=scan)


def run_steps(plan: LayerPlan, refresh: tuple[int, ...], device: str, kernels: bool, d: int = 32,
              n0: int = 555, steps: int = 9, capacity: int = 700, last_keep: int = 32):
    """Decode `steps` queries both ways over the same keys; yields (step, eager out, fixed out, masks, fixed)."""
    kv, g = 2, 2
    gen = torch.Generator(device="cpu").manual_seed(7)
    keys = torch.randn(kv, capacity, d, generator=gen).to(device)
    values = torch.randn(kv, capacity, d, generator=gen).to(device)
    queries = torch.randn(steps, kv * g, 1, d, generator=gen).to(device)
    cos, sin = rope_table(capacity + 128, d, torch.float32, device)
    rotate = rotator(cos, sin)
    table = (cos, sin) if kernels else None
    masks, fixed = MaskCache(), FixedMasks.allocate(plan, last_keep, capacity, kv, torch.device(device))
    width = width_bound(plan.window, refresh)
    for step in range(steps):
        n = n0 + step + 1  # the step's token is entry n - 1
        due = refresh_due(step, refresh)
        eager = sparse_attention(queries[step], keys[:, :n], values[:, :n], d**-0.5, plan, last_keep, rotate, masks,
                                 due, table=table)
        # entries past the live ones hold stale finite values: the fixed step must mask them
        stale_k, stale_v = keys.clone(), values.clone()
        stale_k[:, n:] *= 50
        stale_v[:, n:] *= 50
        t = torch.tensor([n - 1], device=device)
        out = fixed_step(queries[step], stale_k, stale_v, d**-0.5, t, plan, last_keep, tuple(due), fixed, width,
                         rotate, table)
        assert n - masks.stages[-1].window_starts[0] <= width  # the eager window never outgrows the bound
        yield step, eager, out, masks, fixed


def assert_same_selection(masks: MaskCache, fixed: FixedMasks) -> None:
    """Every stage keeps the eager step's ranges in the same places of its list; the rest is empty padding."""
    for i, selection in enumerate(masks.stages):
        c = selection.starts.shape[-1]
        assert c <= fixed.starts[i].shape[-1]
        assert torch.equal(fixed.starts[i][..., :c], selection.starts), i
        assert torch.equal(fixed.ends[i][..., :c], selection.ends), i
        assert bool((fixed.starts[i][..., c:] >= fixed.ends[i][..., c:]).all()), i
    assert int(fixed.window_start) == int(masks.stages[0].window_start)
    assert int(fixed.final_start) == int(masks.stages[-1].window_start)


CASES = [("chunk", True, (4, 2, 1)), ("relative", True, (3, 2, 2)), ("chunk", False, (2, 1, 3)),
         ("absolute", True, (4, 2, 1))]


@pytest.mark.parametrize("prune_rope, shared, refresh", CASES, ids=[f"{r}-{'shared' if s else 'head'}-{f}"
                                                                    for r, s, f in CASES])
def test_fixed_steps_select_and_attend_as_the_eager_steps(prune_rope, shared, refresh):
    plan = make_plan(prune_rope, shared, "absolute" if prune_rope == "absolute" else "streaming")
    for step, eager, out, masks, fixed in run_steps(plan, refresh, "cpu", kernels=False, d=16):
        assert_same_selection(masks, fixed)
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
        assert masks.stages[-1].starts.shape[-1] >= 2  # the selection is sparse, not everything


@pytest.mark.parametrize("prune_rope, shared, refresh", CASES[:3], ids=[f"{r}-{'shared' if s else 'head'}-{f}"
                                                                        for r, s, f in CASES[:3]])
@pytest.mark.parametrize("first_keep", [256, 4096], ids=["stage-1-drops", "stage-1-keeps-all"])
def test_fixed_steps_search_as_hip_attn_as_the_eager_steps(prune_rope, shared, refresh, first_keep):
    """`scan="hip"`: a fixed-shape step searches the live keys of its whole buffer (hip-attn's column counts, its
    candidate region and, with one query, its unsorted top-k order, padding and all) as the eager step searches
    the live keys."""
    plan = dataclasses.replace(make_plan(prune_rope, shared, scan="hip"),
                               stages=(Stage(64, first_keep), Stage(16, 64), Stage(4, 32)))
    for step, eager, out, masks, fixed in run_steps(plan, refresh, "cpu", kernels=False, d=16):
        assert_same_selection(masks, fixed)
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


@needs_kernels()
@pytest.mark.parametrize("prune_rope, shared, refresh", CASES[:3], ids=[f"{r}-{'shared' if s else 'head'}"
                                                                        for r, s, _ in CASES[:3]])
def test_fixed_steps_on_the_kernels_match_the_eager_kernel_steps(prune_rope, shared, refresh):
    plan = make_plan(prune_rope, shared)
    for step, eager, out, masks, fixed in run_steps(plan, refresh, KERNEL_DEVICE, kernels=True, steps=5):
        assert_same_selection(masks, fixed)
        err = float((out.double() - eager.double()).norm() / eager.double().norm())
        assert err < 1e-5, (step, err)


@needs_kernels()
def test_fixed_hip_scan_steps_on_the_kernels_match_the_eager_kernel_steps():
    """`scan="hip"` in a first layer's style through `hip_stage_scan`: the fixed-shape steps over the whole buffer
    (the live count on the device) select and attend as the eager kernel steps."""
    plan = make_plan("chunk", True, scan="hip")
    for step, eager, out, masks, fixed in run_steps(plan, (2, 1, 1), KERNEL_DEVICE, kernels=True, steps=4):
        assert_same_selection(masks, fixed)
        err = float((out.double() - eager.double()).norm() / eager.double().norm())
        assert err < 1e-5, (step, err)


@pytest.mark.parametrize("prune_rope, shared, refresh", CASES[:3], ids=[f"{r}-{'shared' if s else 'head'}-{f}"
                                                                        for r, s, f in CASES[:3]])
def test_offloads_fixed_accounting_matches_the_eager_steps(prune_rope, shared, refresh):
    """Offloaded fixed-shape steps name the same keys as read (the GPU cache's input) and count the same
    stage-scan bytes as the eager steps, from their fixed buffers and host counts."""
    from kvpot.methods.infinitehip.fixed import fixed_used_tokens
    from kvpot.methods.infinitehip.offload import fixed_scan_bytes, scan_bytes, used_tokens

    plan = make_plan(prune_rope, shared)
    width = width_bound(plan.window, refresh)
    d, kv, n0, last_keep = 16, 2, 555, 32
    total = 0
    for step, _, _, masks, fixed in run_steps(plan, refresh, "cpu", kernels=False, d=d):
        n = n0 + step + 1
        due = tuple(refresh_due(step, refresh))
        row = kv * d * 4
        eager_bytes = scan_bytes(plan, masks, torch.empty(kv, n, d))
        assert fixed_scan_bytes(plan, last_keep, due, n - 1, row) == eager_bytes, step
        total += eager_bytes
        selection = masks.stages[-1]
        w0 = int(selection.window_starts[0])
        tokens, valid = used_tokens(min(plan.sink, w0), selection.starts.flatten(), selection.ends.flatten(),
                                    plan.stages[-1].chunk, w0, n)
        fixed_tokens, fixed_valid = fixed_used_tokens(
            plan.sink, fixed.memo["nsink"], fixed.starts[-1].flatten(), fixed.ends[-1].flatten(),
            plan.stages[-1].chunk, fixed.final_start, width, torch.tensor([n - 1]))
        assert sorted(tokens[valid].tolist()) == sorted(fixed_tokens[fixed_valid].tolist()), step
        assert int(fixed_valid.sum()) > plan.window  # sinks, a selection and the window
    assert total > 0


def test_width_bound_and_stage_sizes():
    assert width_bound(1024, (32, 16, 8)) == 1024 + 31
    assert width_bound(16, (4, 2, 1)) == 16 + 3
    # stage 1 every 2 steps, the last stage every 3: step 5 attends with the window stage 1 set at step 2
    assert width_bound(16, (2, 3)) == 16 + 3
    plan = make_plan("chunk", True)
    # 700 entries: stage-1 candidates from the sinks (8) to the latest window start (700 - 32) in chunks of 64;
    # each stage keeps keep // chunk ranges (256 // 64, 64 // 16, the layer's 32 // 4)
    assert stage_sizes(plan, 32, 700) == (11, [4, 4, 8])
    assert stage_sizes(plan, 32, 40) == (1, [1, 4, 8])  # nothing between sinks and window yet: one empty range


# ---------------------------------------------------------------------------- in the engine


def method(**kw) -> kvpot.InfiniteHiP:
    args = dict(sink=8, window=16, chunks=(32, 8, 2), keep=(64, 32, 16), early_keep=32, query_block=8,
                chunk_size=50, refresh=(8, 4, 2))
    args.update(kw)
    return kvpot.InfiniteHiP(**args)


def decode_both(model, ids, new_tokens: int, **kw):
    runs = {}
    for decode in ("eager", "static"):
        engine = kvpot.Engine(model, method=method(**kw), decode=decode, runner="sequence")
        state = engine.prefill_ids(ids)
        result = engine.generate_ids(state=state, max_new_tokens=new_tokens, ignore_eos=True, keep_state=False)
        runs[decode] = (result, state.cache.attention if state.cache is not None else None)
    return runs


def test_static_decoding_gives_the_eager_tokens(one_thread):
    """40 tokens cross five stage-1 refreshes (every 8 steps) and twenty of the last stage."""
    model = build("llama3")
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (400,))
    eager_engine, static_engine = (kvpot.Engine(model, method=method(), decode=d, runner="sequence")
                                   for d in ("eager", "static"))
    eager = eager_engine.prefill_ids(ids)
    static = static_engine.prefill_ids(ids)
    e = eager_engine.generate_ids(state=eager, max_new_tokens=40, ignore_eos=True, keep_state=False)
    s = static_engine.generate_ids(state=static, max_new_tokens=40, ignore_eos=True, keep_state=False)
    assert s.token_ids == e.token_ids
    assert s.stats.decode["static_steps"] == 39 and s.stats.decode["eager_steps"] == 0
    assert s.stats.max_kv_entries == e.stats.max_kv_entries == 400 + 39  # nothing evicted, nothing extra
    assert e.stats.compressions == s.stats.compressions == 0


def test_static_runtime_keeps_the_eager_schedule_and_restarts_after_new_tokens(one_thread):
    from kvpot.methods.infinitehip import InfiniteHiP

    model = build("llama3")
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (300,))
    engine = kvpot.Engine(model, method=method(refresh=(4, 2, 1)), decode="static", runner="sequence")
    state = engine.prefill_ids(ids)
    engine.generate_ids(state=state, max_new_tokens=9, ignore_eos=True)  # a copy decodes: the state keeps step 0
    runtime = state.cache.attention
    assert runtime.step == 0 and runtime.latest is None
    eager_engine = kvpot.Engine(model, method=method(refresh=(4, 2, 1)), decode="eager")
    eager_state = eager_engine.prefill_ids(ids)
    eager_cache, cache = eager_state.cache, state.cache  # decoded in place below (a resumed state's runtime is new)
    eager_engine.generate_ids(state=eager_state, max_new_tokens=9, ignore_eos=True, keep_state=False)
    engine.generate_ids(state=state, max_new_tokens=9, ignore_eos=True, keep_state=False)
    runtime = cache.attention
    assert runtime.step == 8 and runtime.latest == "fixed"
    assert [m.recomputed for m in runtime.masks] == [m.recomputed for m in eager_cache.attention.masks]
    assert runtime.masks[0].recomputed[:5] == [[0, 1, 2], [2], [1, 2], [2], [0, 1, 2]]
    InfiniteHiP.before_forward(engine.method, cache, kvpot.methods.base.Step("question", 3))
    assert runtime.step == 0 and not runtime.masks[0].recomputed  # new tokens: the schedule starts over


def test_graph_keys_are_the_due_patterns():
    m = method(refresh=(8, 4, 2))
    runtime = m.runtime(2, 2048, None)
    patterns = set()
    for step in range(16):
        runtime.step = step
        runtime.due = tuple(refresh_due(step, m.refresh))
        patterns.add(m.decode_key(type("C", (), {"attention": runtime})()))
    assert patterns == {(True, True, True), (False, True, True), (False, False, True), (False, False, False)}


@needs_kernels()
@pytest.mark.slow
def test_static_decoding_on_the_kernels_gives_the_eager_tokens(one_thread):
    model = build("llama3", hidden_size=128, head_dim=32).to(KERNEL_DEVICE)  # the kernels need head dims >= 32
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (160,))
    runs = decode_both(model, ids, 8, kernels="triton", refresh=(4, 2, 1), chunk_size=80)
    assert runs["static"][0].token_ids == runs["eager"][0].token_ids
    assert runs["static"][0].stats.decode["static_steps"] == 7


@needs_kernels()
@pytest.mark.slow
def test_offloaded_static_decoding_gives_the_eager_tokens_and_reads(one_thread):
    """Offloaded fixed-shape steps (the GPU cache updated inside the step, the entry appended by a kernel
    where the buffers are in host memory) decode the eager steps' tokens, and count their reads and scan
    bytes: the read set is the same, only the cache's victims may differ."""
    model = build("llama3", hidden_size=128, head_dim=32).to(KERNEL_DEVICE)
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (160,))
    settings = dict(kernels="triton", refresh=(4, 2, 1), chunk_size=80)
    # (offloaded eager steps give the resident tokens: test_kernels.py)
    runs = decode_both(model, ids, 8, offload=True, gpu_cache_tokens=160, **settings)
    eager, static = runs["eager"][0], runs["static"][0]
    assert static.token_ids == eager.token_ids
    assert static.stats.decode["static_steps"] == 7 and static.stats.decode["eager_steps"] == 0
    fixed, reference = static.stats.method["offload"], eager.stats.method["offload"]
    assert fixed["reads"] == reference["reads"] > 0
    assert fixed["scan_host_bytes"] == reference["scan_host_bytes"] > 0
    assert 0 < fixed["hits"] < fixed["reads"]  # 160 slots: the cache evicts


# ---------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_decoding_gives_the_eager_tokens_and_captures_each_pattern_once(dtype):
    model = build("llama3", hidden_size=128, head_dim=32).to("cuda", dtype)
    torch.manual_seed(3)
    ids = torch.randint(3, VOCAB, (700,))
    eager = kvpot.Engine(model, method=method(kernels="triton"), decode="eager").generate_ids(
        ids, max_new_tokens=64, ignore_eos=True)
    graph = kvpot.Engine(model, method=method(kernels="triton"), decode="graph", runner="sequence").generate_ids(
        ids, max_new_tokens=64, ignore_eos=True)
    report = graph.stats.decode
    # refresh (8, 4, 2): four due patterns, each run once uncaptured (warm-up), captured at its second
    # step and replayed from then on: nothing new is captured after the first 8 steps
    assert report["captures"] == 4 and report["static_steps"] == 4 and report["eager_steps"] == 0
    assert report["replays"] == 63 - 4
    same = sum(a == b for a, b in zip(graph.token_ids, eager.token_ids))
    assert graph.token_ids == eager.token_ids or (dtype == torch.bfloat16 and same >= 56), (graph.token_ids,
                                                                                          eager.token_ids)


@pytest.mark.gpu
def test_graph_decoding_with_the_reference_attention_gives_the_eager_tokens():
    model = build("llama3").to("cuda")  # head dim 16: the PyTorch reference, captured
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (500,))
    eager = kvpot.Engine(model, method=method(), decode="eager").generate_ids(ids, max_new_tokens=30, ignore_eos=True)
    graph = kvpot.Engine(model, method=method(), decode="graph", runner="sequence").generate_ids(ids, max_new_tokens=30,
                                                                                              ignore_eos=True)
    assert graph.token_ids == eager.token_ids and graph.stats.decode["captures"] == 4


@pytest.mark.gpu
def test_offloaded_graph_decoding_gives_the_resident_tokens_and_reports_its_host_traffic():
    model = build("llama3", hidden_size=128, head_dim=32).to("cuda")
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (700,))
    resident = kvpot.Engine(model, method=method(kernels="triton"), decode="graph", runner="sequence").generate_ids(
        ids, max_new_tokens=24, ignore_eos=True)
    engine = kvpot.Engine(model, method=method(offload=True, gpu_cache_tokens=512), decode="graph", runner="sequence")
    state = engine.prefill_ids(ids)
    assert state.cache.layers[0].keys.device.type == "cpu" and state.cache.layers[0].keys.is_pinned()
    offloaded = engine.generate_ids(state=state, max_new_tokens=24, ignore_eos=True)
    eager = kvpot.Engine(model, method=method(offload=True, gpu_cache_tokens=512), decode="eager").generate_ids(
        ids, max_new_tokens=24, ignore_eos=True)
    assert offloaded.token_ids == resident.token_ids == eager.token_ids
    # captured like the resident steps: the entry written to host memory and the GPU cache updated in the graph
    decode = offloaded.stats.decode
    assert decode["eager_steps"] == 0 and decode["captures"] == 4 and decode["replays"] == 23 - 4
    report = offloaded.stats.method["offload"]
    assert 0 < report["hits"] < report["reads"] and report["scan_host_bytes"] > 0
    assert report["reads"] == eager.stats.method["offload"]["reads"]
    assert report["scan_host_bytes"] == eager.stats.method["offload"]["scan_host_bytes"]
    assert report["host_bytes"] == 2 * report["fetched_bytes"] + report["scan_host_bytes"]
    row = 2 * 2 * 32 * 4  # key + value, 2 KV heads, head dim 32, float32
    assert report["fetched_bytes"] == (report["reads"] - report["hits"]) * row


def test_scan_bytes_count_each_recomputed_stages_probes():
    from kvpot.methods.infinitehip.offload import scan_bytes

    plan = make_plan("relative", True)
    gen = torch.Generator(device="cpu").manual_seed(3)
    keys, values = torch.randn(2, 601, 16, generator=gen), torch.randn(2, 601, 16, generator=gen)
    masks = MaskCache()
    sparse_attention(torch.randn(4, 1, 16, generator=gen), keys, values, 0.25, plan, 32, lambda x, p: x, masks,
                     [True, True, True])
    row = 2 * 16 * 4  # one key of each KV head, float32
    w0 = 601 - 32  # the window's start: stage 1 scans [8, w0) in chunks of 64
    stage1 = -(-(w0 - 8) // 64) * (2 * 6 + 1)  # 9 ranges, 6 halvings of 64 keys, 2 probes each + the score
    stage2 = 4 * 4 * (2 * 4 + 1)  # 4 survivors split in 4 ranges of 16
    stage3 = 4 * 4 * (2 * 2 + 1)  # 4 survivors split in 4 ranges of 4
    assert scan_bytes(plan, masks, keys) == (stage1 + stage2 + stage3) * row
    masks.recomputed.append([2])
    assert scan_bytes(plan, masks, keys) == stage3 * row


def test_decode_table_shows_the_offloading_figures():
    from kvpot.bench.report import table_rows

    rows = [{"method": "infinitehip", "length": 1 << 20, "ms_per_token": 9.3, "ms_per_token_mean": 15.44,
             "method_report": {"offload": {"hit_rate": 0.987, "host_bytes_per_token": 3 * 2**20}}},
            {"method": "infinipot", "length": 1 << 20, "ms_per_token": 9.0, "method_report": None}]
    headers, cells = table_rows({"mode": "decode", "rows": rows})
    hits, traffic, mean = headers.index("LRU hits"), headers.index("host->GPU /token"), headers.index("mean ms")
    assert (cells[0][hits], cells[0][traffic], cells[0][mean]) == ("98.7%", "3.0 MiB", "15.44")  # refreshes counted
    assert (cells[1][hits], cells[1][traffic], cells[1][mean]) == ("-", "-", "-")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_static_decoding_equals_generate_when_everything_is_kept(arch, one_thread):
    """Every chunk kept, true positions: the fixed-shape steps are dense attention (docs/design.md, guarantee 2)."""
    from conftest import reference_greedy

    model = build(arch)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (300,))
    roomy = method(keep=(4096,) * 3, early_keep=4096, rope="absolute", refresh=(4, 2, 1))
    out = kvpot.Engine(model, method=roomy, decode="static", runner="sequence").generate_ids(ids, max_new_tokens=20,
                                                                                            ignore_eos=True)
    assert out.token_ids == reference_greedy(model, ids, 20)
    assert out.stats.decode["static_steps"] == 19
