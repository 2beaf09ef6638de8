"""Eviction by replacement (`kvpot.methods.replace`, issue 30): a steady decoding step drops its one
entry by an arg-min and writes the new entry into its slot, instead of a top-k and gathers.

The kept entries must be the old path's at every step (compared with `replace.enabled = False`, the
top-k and gather path, step by step: positions exactly, keys, values and scores up to the order of
float sums), the tokens those of the eager loop and of the old path, the bound held, rank positions
the entries' ranks, and a cache put back in stream order when decoding ends.
"""

import pytest
import torch

import kvpot
from conftest import VOCAB, build, interpreter_runtime_loops
from kvpot.engine.requests import Request
from kvpot.engine.scheduler import Scheduler
from kvpot.methods import replace
from kvpot.methods.d2o.merge import kernel_merges
from kvpot.methods.base import Ranking, top_indices

interpreter_runtime_loops()  # TRITON_INTERPRET=1 runs the kernels' path in Triton's interpreter

CONTEXT, QUESTION, NEW = 96, 4, 72  # NEW: the windows below wrap several times


def methods():
    return {
        "streaming": kvpot.StreamingLLM(sinks=4, window=20, chunk_size=16),
        "streaming-nosinks": kvpot.StreamingLLM(sinks=0, window=16, chunk_size=16),
        "h2o": kvpot.H2O(heavy=12, recent=12, chunk_size=16),
        "h2o-absolute": kvpot.H2O(heavy=12, recent=8, chunk_size=16, positions="absolute"),
        "tova": kvpot.TOVA(budget=24, chunk_size=16),
        "tova-absolute": kvpot.TOVA(budget=24, chunk_size=16, positions="absolute"),
        "d2o": kvpot.D2O(budget=24, chunk_size=32),
        "d2o-nomerge": kvpot.D2O(budget=24, chunk_size=32, merge=False, layer_budget=False),
        "roco": kvpot.RoCo(budget=24, sinks=2, recent=4, volatile=0.25, chunk_size=16),
        "roco-absolute": kvpot.RoCo(budget=24, sinks=0, recent=3, chunk_size=16, positions="absolute"),
        "cam": kvpot.CaM(start=4, recent=20, merge_budget=6, chunk_size=16),
        "cam-nomerge": kvpot.CaM(start=2, recent=16, merge=False, chunk_size=16, positions="absolute"),
    }


@pytest.fixture(scope="module")
def inputs():
    torch.manual_seed(3)
    return torch.randint(3, VOCAB, (CONTEXT,)), torch.randint(3, VOCAB, (QUESTION,))


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model(request):
    return build(request.param)


def in_stream_order(cache) -> list[dict]:
    """Every layer's live entries sorted by stream position (what a kept set is, whatever the places)."""
    layers = []
    for layer in cache.layers:
        n = layer.n
        order = layer.positions[0, :, :n].argsort(dim=-1)  # [kv, n]
        rows = order.unsqueeze(-1).expand(-1, -1, layer.keys.shape[-1])
        layers.append({
            "positions": layer.positions[0, :, :n].gather(1, order),
            "rope": layer.rope_positions[0, :, :n].gather(1, order),
            "keys": layer.keys[0, :, :n].gather(1, rows),
            "values": layer.values[0, :, :n].gather(1, rows),
            "scores": {k: v[0, :, :n].gather(1, order) for k, v in layer.scores.items()},
        })
    return layers


def run(model, method, inputs, decode, monkeypatch, enabled=True):
    """Generate, recording after every eviction the kept entries in stream order and checking the places."""
    monkeypatch.setattr(replace, "enabled", enabled)
    steps, caches = [], []
    original = method.after_forward

    def spy(cache, step):
        evicted = original(cache, step)
        if step.phase == "decode":
            steps.append(in_stream_order(cache))
            caches.append((cache.unordered, cache.clone() if len(steps) == 10 else cache))
            budgets = cache.method_state.get("d2o.budgets") or [method.keep_count(layer, step) for layer in cache.layers]
            assert evicted and cache.lengths() == list(budgets)  # steady: back to the bound at every step
            for layer in cache.layers:  # the places: every entry once, ranks its rank in stream order
                n = layer.n
                positions = layer.positions[0, :, :n]
                assert positions.unique(dim=-1).shape[-1] == n or positions.shape[0] > 1
                if cache.policy.renumbers:
                    ranks = positions.argsort(dim=-1).argsort(dim=-1)
                    assert torch.equal(layer.rope_positions[0, :, :n], ranks)
                else:
                    assert torch.equal(layer.rope_positions[0, :, :n], positions)
        return evicted

    monkeypatch.setattr(method, "after_forward", spy)
    context, question = inputs
    engine = kvpot.Engine(model, method=method, decode=decode, runner="sequence")
    result = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    return result, steps, caches


@pytest.mark.parametrize("name", sorted(methods()))
def test_replacement_keeps_the_entries_of_the_top_k_path(model, inputs, name, monkeypatch, one_thread):
    new, new_steps, caches = run(model, methods()[name], inputs, "static", monkeypatch)
    old, old_steps, _ = run(model, methods()[name], inputs, "static", monkeypatch, enabled=False)
    eager, _, _ = run(model, methods()[name], inputs, "eager", monkeypatch, enabled=False)
    assert new.token_ids == old.token_ids == eager.token_ids
    assert new.stats.max_kv_entries == old.stats.max_kv_entries
    assert new.stats.compressions == old.stats.compressions
    assert len(new_steps) == len(old_steps) >= NEW - 8  # steady from the first steps on: the ring wraps
    for step, (a, b) in enumerate(zip(new_steps, old_steps)):
        for layer, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x["positions"], y["positions"]), (step, layer)
            assert torch.equal(x["rope"], y["rope"]), (step, layer)
            torch.testing.assert_close(x["keys"], y["keys"], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(x["values"], y["values"], rtol=1e-4, atol=1e-5)
            for key in y["scores"]:
                torch.testing.assert_close(x["scores"][key], y["scores"][key], rtol=1e-4, atol=1e-6)
    # the replacements really ran (entries left stream order in their places), and decoding put them back
    assert all(flag for flag, _ in caches)
    cache = caches[-1][1]
    assert not cache.unordered
    for layer in cache.layers:
        positions = layer.positions[0, :, : layer.n]
        assert torch.equal(positions, positions.sort(dim=-1).values)


@pytest.mark.parametrize("name", ["streaming", "h2o-absolute", "tova", "d2o", "roco", "cam"])
def test_a_cache_out_of_order_sorts_back_to_the_old_paths(model, inputs, name, monkeypatch, one_thread):
    """Mid-decoding, the replaced cache sorted back (`restore_order`, what an eager eviction does first)
    holds in its places what the top-k path's cache holds in its own."""
    _, _, caches = run(model, methods()[name], inputs, "static", monkeypatch)
    _, old_steps, old_caches = run(model, methods()[name], inputs, "static", monkeypatch, enabled=False)
    assert not any(flag for flag, _ in old_caches)
    unordered, cache = caches[9]  # a copy taken after the 10th eviction
    assert unordered and cache.unordered
    moved = [not torch.equal(layer.positions[0, :, : layer.n], layer.positions[0, :, : layer.n].sort().values)
             for layer in cache.layers]
    assert any(moved)
    replace.restore_order(cache)
    assert not cache.unordered
    for layer, expected in zip(cache.layers, old_steps[9]):
        n = layer.n
        assert torch.equal(layer.positions[0, :, :n], expected["positions"])
        assert torch.equal(layer.rope_positions[0, :, :n], expected["rope"])
        torch.testing.assert_close(layer.keys[0, :, :n], expected["keys"], rtol=1e-4, atol=1e-5)
        for key, values in expected["scores"].items():
            torch.testing.assert_close(layer.scores[key][0, :, :n], values, rtol=1e-4, atol=1e-6)


def _old_drop(scores, positions, sinks, recent):
    """The old rule on the same entries: sort them by stream position, protect, take `top_indices`."""
    order = positions.argsort(dim=-1)
    n = positions.shape[-1]
    sorted_scores = scores.gather(-1, order[:, : scores.shape[1]])
    protected = Ranking(sorted_scores, sinks=sinks, recent=recent).by_index(_Layer(n, scores.device))
    keep = top_indices(protected, n - 1)
    gone = n * (n - 1) // 2 - keep.sum(dim=-1, keepdim=True)  # the one index left out, in stream order
    return order[:, : scores.shape[1]].gather(-1, gone)


class _Layer:
    def __init__(self, n, device):
        self.n, self.device = n, device


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("sinks,recent", [(0, 0), (2, 0), (0, 3), (2, 3)])
def test_the_arg_min_is_top_indices_rule_whatever_the_places(heads, sinks, recent):
    """Scores with many ties (small integers), entries in shuffled places (the sinks first, as replacement
    leaves them): the dropped entry is the one the top-k over stream order leaves out."""
    generator = torch.Generator().manual_seed(heads * 10 + sinks + recent)
    for _ in range(50):
        b, kv, n = 2, 3, 11
        stream = torch.arange(100, 100 + n)
        places = torch.stack([torch.cat([torch.arange(sinks), sinks + torch.randperm(n - sinks - 1, generator=generator),
                                         torch.tensor([n - 1])]) for _ in range(b * kv)]).view(b, kv, n)
        positions = stream[places]  # [b, kv, n], newest last
        if heads == 1:
            positions = positions[:, :1].expand(b, kv, n).contiguous()
        scores = torch.randint(0, 3, (b, heads, n), generator=generator).float()
        drop = replace.drop_index(scores, positions, sinks, recent)
        expected = _old_drop(scores, positions, sinks, recent)
        assert torch.equal(drop, expected)


def test_streaming_drops_the_oldest_entry_after_the_sinks():
    positions = torch.tensor([[[0, 1, 7, 5, 6, 9]]])  # sinks 0, 1; the ring's oldest at place 3
    assert replace.drop_index(None, positions, sinks=2).item() == 3


def test_renumbering_keeps_ranks_in_stream_order():
    ranks = torch.tensor([[[0, 3, 1, 4, 2, 5]]])
    replace.renumber(ranks, torch.tensor([[[2]]]))  # rank 1 leaves
    assert ranks.tolist() == [[[0, 2, 1, 3, 1, 4]]]  # its own place is written over by the newest next


@pytest.mark.parametrize("name", ["streaming", "h2o", "tova", "d2o", "roco", "cam"])
def test_batched_replacement_gives_the_top_k_paths_tokens(model, inputs, name, monkeypatch, one_thread):
    """Several requests at once, rows evicting by replacement: each gets the tokens it gets alone, and the
    tokens of the top-k path."""
    torch.manual_seed(5)
    prompts = [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (4,)).tolist()) for n in (96, 60, 130)]
    capacity = 256 if name == "d2o" else None

    def batched(enabled):
        monkeypatch.setattr(replace, "enabled", enabled)
        engine = kvpot.Engine(model, method=methods()[name])
        scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="static")
        requests = [scheduler.submit(Request(c, q, max_new_tokens=40, ignore_eos=True)) for c, q in prompts]
        scheduler.run()
        assert scheduler.report["steady_rows"] > 0
        return [r.tokens for r in requests]

    def alone():
        monkeypatch.setattr(replace, "enabled", False)
        engine = kvpot.Engine(model, method=methods()[name], decode="eager")
        return [engine.generate_ids(c, q, max_new_tokens=40, ignore_eos=True).token_ids for c, q in prompts]

    assert batched(True) == batched(False) == alone()


@pytest.mark.parametrize("name", ["streaming", "h2o", "tova", "d2o", "roco", "cam"])
def test_half_precision_replacement_keeps_the_old_paths_entries(inputs, name, monkeypatch, one_thread):
    """In bfloat16, where D2O's steady step runs as one kernel (`kvpot.kernels.replace.d2o_step`) when the
    kernels run (CUDA, or TRITON_INTERPRET=1): the top-k path's entries and tokens at every step."""
    model = build("llama3").to(torch.bfloat16)
    new, new_steps, _ = run(model, methods()[name], inputs, "static", monkeypatch)
    old, old_steps, _ = run(model, methods()[name], inputs, "static", monkeypatch, enabled=False)
    if name == "d2o" and kernel_merges(torch.zeros(1, dtype=torch.bfloat16)):
        # the kernel's cosine similarities round differently from PyTorch's einsum, so the threshold's EMA
        # drifts by ulps and, after some steps, a merge decision within rounding of it may go the other way
        new_steps, old_steps = new_steps[:8], old_steps[:8]
        new.token_ids, old.token_ids = new.token_ids[:8], old.token_ids[:8]
    # (not the eager loop's: in bfloat16 it rotates keys in bfloat16, the fixed-shape steps in float32)
    assert new.token_ids == old.token_ids
    for a, b in zip(new_steps, old_steps):
        for x, y in zip(a, b):
            assert torch.equal(x["positions"], y["positions"])
            if name != "d2o":  # the merge kernel's similarities round differently: merged keys drift by ulps
                torch.testing.assert_close(x["keys"], y["keys"], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(methods()))
def test_graph_replacement_gives_the_old_paths_tokens_on_cuda(name, dtype, inputs, monkeypatch):
    """CUDA graphs replaying the replacement kernels: the tokens of the old path's graphs and of the eager loop."""
    model = build("qwen3", head_dim=32).to("cuda", dtype)  # head dim 32: the Triton decode kernel attends
    cuda_inputs = tuple(t.cuda() for t in inputs)
    tokens = {}
    for label, decode, enabled in (("new", "graph", True), ("old", "graph", False), ("eager", "eager", False)):
        monkeypatch.setattr(replace, "enabled", enabled)
        out = kvpot.Engine(model, method=methods()[name], decode=decode, runner="sequence").generate_ids(
            *cuda_inputs, max_new_tokens=NEW, ignore_eos=True)
        tokens[label] = out.token_ids
        if decode == "graph":
            assert out.stats.decode["replays"] > NEW // 2
    if name == "d2o" and dtype == torch.bfloat16:  # the merge kernel rounds its similarities otherwise (above)
        tokens = {label: ids[:8] for label, ids in tokens.items()}
    assert tokens["new"] == tokens["old"]
    if dtype == torch.float32:  # in bfloat16 the eager loop rotates keys in bfloat16, the decode kernel in float32
        assert tokens["new"] == tokens["eager"]
