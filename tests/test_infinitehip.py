"""InfiniteHiP (kvpot.methods.infinitehip.reference + methods/infinitehip.py): pruning, exactness, decoding with
mask caching."""

import logging

import pytest
import torch

import kvpot
from conftest import VOCAB, build, reference_greedy
from kvpot.errors import KvpotError
from kvpot.rope import rotate_half
from kvpot.methods.infinitehip.reference import (
    LayerPlan,
    MaskCache,
    Stage,
    halving_search,
    no_rotation,
    prune,
    refresh_due,
    sparse_attention,
)

D = 16
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Plain RoPE for the unit tests (the engine uses the model's own)."""
    angles = positions.float().unsqueeze(-1) * INV_FREQ
    emb = torch.cat([angles, angles], dim=-1)
    return x * emb.cos() + rotate_half(x) * emb.sin()


def dense_reference(query, keys, values, scaling):
    """Causal attention at true positions, keys repeated per group: [h, q, d]."""
    h, q, _ = query.shape
    kv, n, _ = keys.shape
    k = rope(keys, torch.arange(n).view(1, n)).repeat_interleave(h // kv, 0)
    v = values.repeat_interleave(h // kv, 0)
    qr = rope(query, (n - q + torch.arange(q)).view(1, q))
    mask = torch.arange(n).view(1, n) <= (n - q + torch.arange(q)).view(q, 1)
    return (qr @ k.transpose(-1, -2) * scaling).masked_fill(~mask, float("-inf")).softmax(-1) @ v


def plan(keep=(10**6, 10**6, 10**6), **kw) -> LayerPlan:
    args = dict(stages=tuple(Stage(c, k) for c, k in zip((64, 8, 2), keep)), sink=16, window=32, query_block=16,
                prune_rope="relative", final_rope="absolute", shared=True)
    args.update(kw)
    return LayerPlan(**args)


# Shapes: (query heads, KV heads, context, new queries). Context and query counts are not
# multiples of any block or chunk size; GQA ratios 1, 4.
SHAPES = [(4, 4, 333, 1), (8, 2, 700, 100), (8, 2, 1025, 37)]


@pytest.mark.parametrize("shape", SHAPES, ids=[f"h{h}-kv{kv}-n{n}-q{q}" for h, kv, n, q in SHAPES])
@pytest.mark.parametrize("prune_rope", ["relative", "chunk", "absolute"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-head"])
def test_keeping_every_chunk_equals_dense_attention(shape, prune_rope, shared):
    h, kv, n, q = shape
    torch.manual_seed(0)
    query, keys, values = torch.randn(h, q, D), torch.randn(kv, n, D), torch.randn(kv, n, D)
    out = sparse_attention(query, keys, values, D**-0.5, plan(prune_rope=prune_rope, shared=shared), 10**6, rope)
    torch.testing.assert_close(out, dense_reference(query, keys, values, D**-0.5), atol=1e-5, rtol=1e-5)


def test_one_long_forward_prunes_for_its_later_blocks():
    """A first forward longer than sink + window: its first blocks see everything (dense), its later
    blocks have a middle region and prune it (each query block prunes for itself)."""
    torch.manual_seed(0)
    query, keys, values = torch.randn(8, 600, D), torch.randn(2, 600, D), torch.randn(2, 600, D)
    p = plan(keep=(128, 32, 8), final_rope="absolute")
    out = sparse_attention(query, keys, values, D**-0.5, p, 8, rope)
    dense = dense_reference(query, keys, values, D**-0.5)
    early = p.sink + p.window  # queries before this have no middle region
    torch.testing.assert_close(out[:, :early], dense[:, :early], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[:, -50:], dense[:, -50:], atol=1e-3)


def test_sparse_output_differs_from_dense_when_chunks_are_dropped():
    torch.manual_seed(0)
    query, keys, values = torch.randn(8, 50, D), torch.randn(2, 900, D), torch.randn(2, 900, D)
    out = sparse_attention(query, keys, values, D**-0.5, plan(keep=(128, 32, 8), final_rope="streaming"), 8, rope)
    assert out.shape == (8, 50, D) and torch.isfinite(out).all()
    assert not torch.allclose(out, dense_reference(query, keys, values, D**-0.5), atol=1e-3)


@pytest.mark.parametrize("direction", ["increasing", "decreasing", "peak"])
@pytest.mark.parametrize("size", [256, 37, 2, 1])
def test_halving_search_finds_the_argmax_of_monotone_scores(direction, size):
    start = 100
    positions = torch.arange(start, start + size).float()
    if direction == "increasing":
        truth = positions
    elif direction == "decreasing":
        truth = -positions
    else:  # rises then falls: monotone on each side of the peak
        truth = -(positions - (start + size // 3)).abs()
    table = torch.full((start + size + 1,), float("-inf"))
    table[start : start + size] = truth

    def score(idx, side):
        return table[idx]

    left, right = torch.tensor([[[start]]]), torch.tensor([[[start + size]]])
    found = halving_search(score, left, right, size)
    assert int(found) == start + int(truth.argmax())


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "per-head"])
def test_planted_blocks_are_selected(shared):
    """Keys of a few stage-1 chunks align with the queries; every stage must pass them on.

    The halving search reads two keys per split, so it finds high-scoring regions that are wide
    or smooth (the "chunk sparsity" the paper builds on), not isolated keys: the planted blocks
    are whole 256-key chunks among random keys.
    """
    torch.manual_seed(0)
    kv, g, n, d, sink = 2, 4, 8192, 32, 16
    keys = torch.randn(kv, n, d)
    query_dir = torch.randn(d)
    queries = query_dir + 0.5 * torch.randn(kv, g, 1, 8, d)  # one block of 8 queries
    planted = [sink + 256 * c for c in (3, 11, 17, 29)]
    for start in planted:
        keys[:, start : start + 256] += 1.5 * query_dir
    p = LayerPlan(stages=(Stage(256, 2048), Stage(32, 1024), Stage(8, 1024)), sink=sink, window=64, query_block=8,
                  prune_rope="absolute", final_rope="absolute", shared=shared)
    block_pos = (n - 8 + torch.arange(8)).view(1, 8)
    window_start = torch.tensor([n - 8 + 1 - 64])
    outputs = prune(queries, torch.ones(1, 8, dtype=torch.bool), keys, p, 1024, block_pos, window_start, no_rotation)
    for stage, out in zip(p.stages, outputs):
        idx, valid = out.tokens(stage.chunk)
        for head in range(idx.shape[0]):
            chosen = set(idx[head][valid[head]].tolist())
            assert len(chosen) <= stage.keep
            for start in planted:
                assert set(range(start, start + 256)) <= chosen, (stage, head, start)


def test_refresh_schedule():
    assert [refresh_due(step, (32, 16, 8)) for step in (0, 8, 16, 24, 32, 5)] == [
        [True, True, True], [False, False, True], [False, True, True], [False, False, True], [True, True, True],
        [False, False, False]]
    torch.manual_seed(0)
    query, keys, values = torch.randn(8, 1, D), torch.randn(2, 900, D), torch.randn(2, 900, D)
    masks = MaskCache()
    for step in range(9):
        sparse_attention(query, keys, values, D**-0.5, plan(keep=(128, 32, 8)), 8, rope, masks,
                         refresh_due(step, (4, 2, 1)))
    assert masks.recomputed == [[0, 1, 2], [2], [1, 2], [2], [0, 1, 2], [2], [1, 2], [2], [0, 1, 2]]


def test_cached_window_start_leaves_no_gap():
    """Between stage-1 refreshes the window keeps its start, so new keys past it stay attended."""
    torch.manual_seed(0)
    p = plan(keep=(128, 32, 8))
    masks = MaskCache()
    keys, values = torch.randn(2, 900, D), torch.randn(2, 900, D)
    sparse_attention(torch.randn(8, 1, D), keys, values, D**-0.5, p, 8, rope, masks, [True, True, True])
    start = int(masks.stages[0].window_start)
    keys2, values2 = torch.cat([keys, torch.randn(2, 3, D)], 1), torch.cat([values, torch.randn(2, 3, D)], 1)
    sparse_attention(torch.randn(8, 1, D), keys2, values2, D**-0.5, p, 8, rope, masks, [False, False, True])
    assert int(masks.stages[0].window_start) == start == 900 - 32


# ---------------------------------------------------------------------------- the method in the engine


def test_equals_generate_when_everything_is_kept(arch):
    model = build(arch)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (300,))
    expected = reference_greedy(model, ids, 20)
    dense = kvpot.InfiniteHiP(chunk_size=64)  # 300 tokens fit in sink + window: the dense path
    roomy = kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(4096,) * 3, early_keep=4096, query_block=8,
                              rope="absolute", chunk_size=50, refresh=(4, 2, 1))  # sparse path, nothing dropped
    for method in (dense, roomy):
        out = kvpot.Engine(model, method=method).generate_ids(ids, max_new_tokens=20)
        assert out.token_ids == expected, method
        assert out.stats.compressions == 0 and out.stats.max_kv_entries == 300 + 19


def test_sparse_run_keeps_every_entry_and_decodes_with_mask_cache():
    model = build("llama3")
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (400,))
    method = kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(64, 32, 16), early_keep=32, query_block=8,
                               chunk_size=50, refresh=(4, 2, 1))
    engine = kvpot.Engine(model, method=method)
    state = engine.prefill_ids(ids)
    first = engine.generate_ids(state=state, max_new_tokens=10)
    second = engine.generate_ids(state=state, max_new_tokens=10)  # the state is not consumed
    assert first.token_ids == second.token_ids
    assert first.stats.max_kv_entries == 400 + 9  # nothing evicted
    runtime = state.cache.attention
    assert runtime.step == 0 and all(not m.recomputed for m in runtime.masks)  # prefill caches no mask


def test_short_window_scales_defaults_and_keeps_explicit_values(caplog):
    method = kvpot.InfiniteHiP()
    sizes = method.resolved(2048)
    assert (sizes["sink"], sizes["window"], sizes["keep"], sizes["early_keep"]) == (64, 256, (8192, 2048, 512), 1024)
    assert sizes["sink"] + sizes["window"] + sizes["early_keep"] + method.query_block <= 2048
    assert method.resolved(131072)["halvings"] == 0  # Llama-3.1's window: release defaults
    explicit = kvpot.InfiniteHiP(window=1024).resolved(2048)
    assert explicit["window"] == 1024 and explicit["sink"] < 256
    with caplog.at_level(logging.WARNING, logger="kvpot"):
        method.plans(4, 2048)
        method.plans(4, 2048)
    assert sum("shorter than the release defaults" in r.message for r in caplog.records) == 1  # logged once
    plans, last = method.plans(4, 2048)
    assert [p.prune_rope for p in plans] == ["chunk", "chunk", "chunk", "relative"] and last == [1024] * 3 + [512]
    assert {p.final_rope for p in plans} == {"streaming"}
    assert {p.prune_rope for p in kvpot.InfiniteHiP(rope="relative").plans(4, 2048)[0]} == {"relative"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(chunks=(256, 48, 8)), "divide"),
    (dict(keep=(1, 2)), "stages"),
    (dict(refresh="32/16"), "refresh has 2"),
    (dict(chunks="256/x/8"), "look like"),
    (dict(rope="yarn"), "rope must be"),
    (dict(selection="layer"), "selection must be"),
    (dict(query_block=0), "query_block"),
    (dict(kernels="cuda"), "kernels must be"),
    (dict(gpu_cache_tokens=4096), "set offload=True"),
    (dict(offload=True, gpu_cache_tokens=0), "gpu_cache_tokens must be"),
    (dict(offload=True, kernels="torch"), "cannot"),
])
def test_bad_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(KvpotError, match=message):
        kvpot.InfiniteHiP(**kwargs)


def test_kernels_triton_where_they_cannot_run_is_a_clear_error():
    from kvpot import kernels

    if kernels.available("cpu"):
        pytest.skip("Triton's interpreter is on: the kernels can run here")
    model = build("llama3")
    method = kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(64, 32, 16), early_keep=32,
                               query_block=8, chunk_size=50, kernels="triton")
    with pytest.raises(KvpotError, match="kernels='triton'"):
        kvpot.Engine(model, method=method).generate_ids(torch.randint(3, VOCAB, (200,)), max_new_tokens=2)


def test_offload_without_the_kernels_is_a_clear_error():
    from kvpot import kernels

    if kernels.available("cpu"):
        pytest.skip("Triton's interpreter is on: the kernels can run here")
    model = build("llama3")
    method = kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(64, 32, 16), early_keep=32,
                               query_block=8, chunk_size=50, offload=True)
    with pytest.raises(KvpotError, match="offload=True needs the Triton kernels"):
        kvpot.Engine(model, method=method).generate_ids(torch.randint(3, VOCAB, (200,)), max_new_tokens=2)


def test_cli_parses_stage_lists():
    from kvpot.methods import make_method

    method = make_method("infinitehip", chunks="128/16/4", keep="8192/2048/512", refresh="16/8/4", sink="32")
    assert method.chunks == (128, 16, 4) and method.keep == (8192, 2048, 512) and method.refresh == (16, 8, 4)
    assert method.sink == 32 and method.config()["chunks"] == (128, 16, 4)


def test_observations_are_refused_with_sparse_attention():
    model = build("llama3")
    engine = kvpot.Engine(model, method=kvpot.InfiniteHiP(chunk_size=64))
    state = engine.prefill_ids(torch.randint(3, VOCAB, (40,)))
    with pytest.raises(KvpotError, match="observations"):
        engine.probe(state.cache, state.next_position, [5, 6], kvpot.attention.AttentionRequest())
