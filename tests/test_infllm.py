"""InfLLM (kvpot.methods.infllm): the paper's rules against a brute-force reading, exactness, decoding,
states, the bound. GPU-only checks (the Triton step, CUDA graphs, offloading) are in test_infllm_kernel.py."""

from __future__ import annotations

import pytest
import torch

import kvpot
from conftest import VOCAB, build, build_llama, reference_greedy
from kvpot.errors import KvpotError
from kvpot.methods.infllm.memory import SCORE, Memory, add_scores
from kvpot.methods.infllm.runtime import InfLLMRuntime, Sizes
from kvpot.methods.infllm.turn import Turner
from kvpot.rope import Rope, rotate_half

KV, G, D = 2, 2, 16
SIZES = Sizes(initial=4, window=24, block=8, reps=2, topk=3, lookup=8)


@pytest.fixture(scope="module")
def rope() -> Rope:
    model = build_llama(head_dim=D, hidden_size=KV * G * D, num_attention_heads=KV * G, num_key_value_heads=KV)
    return Rope(model.model.rotary_emb)


def turn(rope: Rope, x: torch.Tensor, position: int) -> torch.Tensor:
    cos, sin = rope.cos_sin(torch.tensor([position]), x, 4096)
    return x * cos[0] + rotate_half(x) * sin[0]


class Layer:
    """The part of a `PotLayer` the runtime reads: its index, its count, its score buffer."""

    def __init__(self, capacity: int):
        self.layer_idx, self.n = 0, 0
        self.scores = {SCORE: torch.zeros(1, KV, capacity)}

    def score(self, name: str) -> torch.Tensor:
        return self.scores[name][:, :, : self.n]


def brute_scores(rope, queries, keys, window):
    """r_m = sum over t in [m, m + window - 1] of sum over the group's heads of rot(q_t, t) . rot(k_m, m)."""
    n = keys.shape[1]
    score = torch.zeros(KV, n)
    for m in range(n):
        for t in range(m, min(n, m + window)):
            for k in range(KV):
                q = queries[k * G : (k + 1) * G, t]
                score[k, m] += (turn(rope, q, t) @ turn(rope, keys[k, m], m)).sum()
    return score


def brute_forward(rope, queries, keys, values, first, sizes, scaling):
    """The output of queries first .. n-1, each lookup chunk taking its units by the paper's rules."""
    n = keys.shape[1]
    s = sizes
    score = brute_scores(rope, queries, keys, s.window)
    out = torch.zeros(KV * G, n - first, D)
    for c in range(first, n, s.lookup):
        rows = range(c, min(n, c + s.lookup))
        w0 = max(0, c - s.window + 1)
        units = max(0, w0 - s.initial) // s.block
        rest = s.initial + units * s.block if w0 > s.initial else w0
        summary = torch.zeros(KV, units, D)
        for u in range(units):
            tokens = s.initial + u * s.block + torch.arange(s.block)
            for k in range(KV):
                best = tokens[score[k, tokens].topk(s.reps).indices]
                summary[k, u] = keys[k, best].mean(0)
        far_q = torch.stack([turn(rope, queries[:, t], s.window) for t in rows])  # [rows, h, d]
        summed = far_q.view(len(rows), KV, G, D).sum((0, 2))  # [kv, d]
        relevance = torch.einsum("kd,kud->u", summed, summary)
        chosen = relevance.topk(min(s.topk, units)).indices.tolist()
        far = list(range(min(s.initial, w0))) + [s.initial + u * s.block + i for u in chosen for i in range(s.block)]
        far += list(range(rest, w0))
        for t in rows:
            for head in range(KV * G):
                k = head // G
                logits = [turn(rope, queries[head, t], s.window) @ turn(rope, keys[k, m], 0) for m in far]
                logits += [turn(rope, queries[head, t], t) @ turn(rope, keys[k, m], m) for m in range(w0, t + 1)]
                probs = (torch.stack(logits) * scaling).softmax(0)
                out[head, t - first] = probs @ values[k, far + list(range(w0, t + 1))]
    return out, score


def run_forwards(rope, runtime, layer, queries, keys, values, bounds):
    outs = []
    for first, n in zip(bounds, bounds[1:]):
        layer.n = n
        out = runtime(layer, queries[None, :, first:n], keys[None, :, :n], values[None, :, :n], D**-0.5)
        outs.append(out[0])
    return torch.cat(outs, dim=1)


def test_forwards_and_steps_follow_the_papers_rules(rope):
    """Representative scores, units of representatives, lookup per chunk, shared distant position:
    the runtime against a brute-force reading, over forwards of several lookups and one-token steps."""
    torch.manual_seed(0)
    n = 130
    queries, keys, values = torch.randn(KV * G, n, D), torch.randn(KV, n, D), torch.randn(KV, n, D)
    runtime, layer = InfLLMRuntime(SIZES, rope, kernels="torch"), Layer(n)
    bounds = [0, 37, 101, *range(102, n + 1)]  # two prefill forwards, then one query at a time
    got = run_forwards(rope, runtime, layer, queries, keys, values, bounds)
    for first, stop in ((0, 37), (37, 101), (101, 102), (117, 118), (129, 130)):  # a step is its own lookup
        want, _ = brute_forward(rope, queries[:, :stop], keys[:, :stop], values[:, :stop], first, SIZES, D**-0.5)
        torch.testing.assert_close(got[:, first:stop], want, atol=2e-5, rtol=1e-4)
    _, score = brute_forward(rope, queries, keys, values, n, SIZES, D**-0.5)
    torch.testing.assert_close(layer.scores[SCORE][0], score, atol=1e-3, rtol=1e-4)
    assert runtime.memory(0).formed == (n - 1 - SIZES.window + 1 - SIZES.initial) // SIZES.block


def test_representative_scores_sum_over_the_window_at_true_distances(rope):
    """Whatever the cut into forwards, each key's score sums q . k over the queries whose window holds it."""
    torch.manual_seed(1)
    n = 90
    queries, keys = torch.randn(KV * G, n, D), torch.randn(KV, n, D)
    score = torch.zeros(KV, n)
    for first, stop in ((0, 31), (31, 32), (32, 90)):  # a forward's share, in any cut
        start = max(0, first - SIZES.window + 1)
        add_scores(score[:, :stop], keys[:, start:stop], queries[:, first:stop], start, SIZES.window,
                   Turner(rope, keys, 4096, {}))
    torch.testing.assert_close(score, brute_scores(rope, queries, keys, SIZES.window), atol=1e-3, rtol=1e-4)


def test_a_unit_is_represented_by_its_highest_scoring_keys():
    keys = torch.randn(KV, 4 + 16, D)
    score = torch.zeros(KV, 20)
    score[0, [5, 9, 13]] = torch.tensor([3.0, 2.0, 1.0])  # head 0: unit 0 (tokens 4-11) picks 5 and 9
    score[1, [11, 6, 19, 15]] = torch.tensor([4.0, 3.0, 2.0, 1.0])  # head 1: 11 and 6; unit 1: 19 and 15
    score[0, [12, 18]] = torch.tensor([5.0, 6.0])  # head 0, unit 1: 18 and 12
    memory = Memory()
    memory.form(2, score, lambda a, b: keys[:, a:b], initial=4, block=8, reps=2)
    torch.testing.assert_close(memory.summaries[0, 0], keys[0, [5, 9]].mean(0))  # [unit, head]
    torch.testing.assert_close(memory.summaries[0, 1], keys[1, [11, 6]].mean(0))
    torch.testing.assert_close(memory.summaries[1, 0], keys[0, [18, 12]].mean(0))
    torch.testing.assert_close(memory.summaries[1, 1], keys[1, [19, 15]].mean(0))
    assert memory.formed == 2 and memory.bias[:2].tolist() == [0.0, 0.0] and memory.bias[2:].isinf().all()


def test_lookup_takes_the_units_the_chunk_attends(rope):
    """Units whose representatives align with the chunk's queries are looked up, the others are not:
    planted units give the most relevant summaries, and the output equals attention over exactly them."""
    torch.manual_seed(2)
    n, sizes = 200, Sizes(initial=0, window=24, block=8, reps=2, topk=2, lookup=8)
    direction = torch.randn(D)
    queries, keys, values = 0.1 * torch.randn(KV * G, n, D), torch.randn(KV, n, D), torch.randn(KV, n, D)
    queries[:, 150:] += turn(rope, direction, 0 - sizes.window)  # rotated at W, they point at `direction`
    planted = (3, 11)
    for unit in planted:
        keys[:, unit * 8 : unit * 8 + 8] += 3 * direction
    runtime, layer = InfLLMRuntime(sizes, rope, kernels="torch"), Layer(n)
    got = run_forwards(rope, runtime, layer, queries, keys, values, [0, 150, 158])
    want, _ = brute_forward(rope, queries[:, :158], keys[:, :158], values[:, :158], 150, sizes, D**-0.5)
    torch.testing.assert_close(got[:, 150:], want, atol=2e-5, rtol=1e-4)
    summed = runtime.far_turn(queries[:, 150:158], runtime.rotator(queries)).view(KV, G, 8, D).sum((1, 2))
    best = torch.einsum("kd,ukd->u", summed, runtime.memory(0).summaries[: runtime.memory(0).formed]).topk(2)
    assert sorted(best.indices.tolist()) == list(planted)


def test_distant_units_share_one_position(rope):
    """Swapping two whole units before the window (keys, values and scores) changes nothing for a query
    that looks both up: beyond the window every key sits at the same distance, the window size."""
    torch.manual_seed(3)
    n, sizes = 120, Sizes(initial=4, window=24, block=8, reps=2, topk=20, lookup=8)
    queries, keys, values = torch.randn(KV * G, n, D), torch.randn(KV, n, D), torch.randn(KV, n, D)

    def last_query(k, v):
        runtime, layer = InfLLMRuntime(sizes, rope, kernels="torch"), Layer(n)
        return run_forwards(rope, runtime, layer, queries, k, v, [0, 100, 120])[:, -1]

    a, b = slice(4 + 8 * 2, 4 + 8 * 3), slice(4 + 8 * 7, 4 + 8 * 8)
    swapped_k, swapped_v = keys.clone(), values.clone()
    swapped_k[:, a], swapped_k[:, b] = keys[:, b], keys[:, a]
    swapped_v[:, a], swapped_v[:, b] = values[:, b], values[:, a]
    torch.testing.assert_close(last_query(swapped_k, swapped_v), last_query(keys, values), atol=1e-5, rtol=1e-5)
    # within the window positions are true: the same swap there changes the output
    w = slice(n - 16, n - 8)
    near_k = keys.clone()
    near_k[:, w], near_k[:, n - 8 :] = keys[:, n - 8 :], keys[:, w]
    assert not torch.allclose(last_query(near_k, values), last_query(keys, values), atol=1e-3)


# ---------------------------------------------------------------------------- the method in the engine


def small(**kw) -> kvpot.InfLLM:
    args = dict(initial=8, window=48, block_size=16, representatives=2, topk=3, lookup=16, chunk_size=40)
    args.update(kw)
    return kvpot.InfLLM(**args)


def test_a_window_beyond_the_input_equals_full(arch):
    model = build(arch)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (150,))
    expected = reference_greedy(model, ids, 16)
    method = small(window=512, lookup=32)  # every query's window reaches the first token
    for decode in ("eager", "static"):
        out = kvpot.Engine(model, method=method, decode=decode, runner="sequence").generate_ids(ids, max_new_tokens=16)
        assert out.token_ids == expected, decode
        assert out.stats.max_kv_entries == 150 + 15 and out.stats.compressions == 0


def test_fixed_shape_decoding_equals_eager_decoding():
    model = build("llama3")
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (400,))
    method = small()
    runs = {}
    for decode in ("eager", "static"):
        engine = kvpot.Engine(model, method=method, decode=decode, runner="sequence")
        state = engine.prefill_ids(ids)
        out = engine.generate_ids(state=state, max_new_tokens=40, ignore_eos=True, keep_state=False)
        runs[decode] = (out, [layer.scores[SCORE][0, :, : layer.n] for layer in out_cache(engine, out)])
    (eager, eager_scores), (static, static_scores) = runs["eager"], runs["static"]
    assert eager.token_ids == static.token_ids
    assert static.stats.decode["static_steps"] == 39 and static.stats.decode["eager_steps"] == 0
    for a, b in zip(eager_scores, static_scores):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    # the last step: t = 438
    assert eager.stats.method["units"] == static.stats.method["units"] == (400 + 38 - 48 + 1 - 8) // 16


def out_cache(engine, result):
    return engine._last_cache.layers


@pytest.fixture(autouse=True)
def _keep_last_cache(monkeypatch):
    """Keep the cache a generation decoded in (the engine drops it) for the checks above."""
    original = kvpot.Engine._settle

    def settle(self, run):
        self._last_cache = run.cache
        return original(self, run)

    monkeypatch.setattr(kvpot.Engine, "_settle", settle)


def test_every_forward_attends_to_at_most_the_bound():
    model = build("llama3")
    torch.manual_seed(5)
    method = small()
    seen = []
    original = InfLLMRuntime._forward

    def record(self, layer, query, keys, values, scaling):
        before, self.max_attended = self.max_attended, 0
        out = original(self, layer, query, keys, values, scaling)
        seen.append(self.max_attended)
        self.max_attended = max(before, self.max_attended)
        return out

    InfLLMRuntime._forward = record
    try:
        engine = kvpot.Engine(model, method=method, decode="eager")
        out = engine.generate_ids(torch.randint(3, VOCAB, (600,)), torch.randint(3, VOCAB, (5,)), max_new_tokens=30,
                                  ignore_eos=True)
    finally:
        InfLLMRuntime._forward = original
    bound = method.attended()
    assert bound == 8 + 3 * 16 + 16 + 48 + 16 - 1
    assert len(seen) == 2 * (600 // 40 + 1 + 29)  # every layer's every forward
    assert max(seen) <= bound and max(seen) > bound - 16  # reached: the window and every unit in use
    assert out.stats.max_kv_entries == 600 + 5 + 29  # nothing is evicted


def test_a_saved_state_resumes_with_its_memory(tmp_path):
    model = build("llama3")
    torch.manual_seed(6)
    engine = kvpot.Engine(model, method=small(), decode="eager")
    state = engine.prefill_ids(torch.randint(3, VOCAB, (300,)))
    question = torch.randint(3, VOCAB, (6,))
    first = engine.generate_ids(question_ids=question, state=state, max_new_tokens=20, ignore_eos=True)
    again = engine.generate_ids(question_ids=question, state=state, max_new_tokens=20, ignore_eos=True)
    assert first.token_ids == again.token_ids  # the state is not consumed
    path = tmp_path / "state.kvpot"
    state.save(path)
    loaded = kvpot.State.load(path, engine)
    assert loaded.cache.attention is None  # the units are rebuilt from the saved scores
    resumed = engine.generate_ids(question_ids=question, state=loaded, max_new_tokens=20, ignore_eos=True)
    assert resumed.token_ids == first.token_ids


def test_short_window_models_halve_defaulted_sizes(caplog):
    method = kvpot.InfLLM()
    sizes = method.sizes(2048)
    assert (sizes.window, sizes.lookup) == (1024, 128) and sizes.window + sizes.lookup <= 2048
    assert method.sizes(8192).window == 4096  # Llama-3's window: the release's sizes
    assert kvpot.InfLLM(window=2000, lookup=48).sizes(2048).window == 2000  # explicit values stay
    assert method.attended(8192) == 128 + 64 * 128 + 128 + 4096 + 512 - 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size"),
    (dict(representatives=200), "representatives"),
    (dict(window=64, lookup=128), "must not exceed"),
    (dict(initial=-1), "initial"),
    (dict(kernels="cuda"), "kernels must be"),
    (dict(gpu_cache_tokens=4096), "set offload=True"),
    (dict(offload=True, kernels="torch"), "cannot"),
    (dict(topk=0), "topk"),
])
def test_bad_parameters_are_clear_errors(kwargs, message):
    with pytest.raises(KvpotError, match=message):
        kvpot.InfLLM(**kwargs)


def test_offload_on_a_cpu_is_a_clear_error():
    model = build("llama3")
    with pytest.raises(KvpotError, match="drop offload"):
        kvpot.Engine(model, method=small(offload=True)).generate_ids(torch.randint(3, VOCAB, (50,)), max_new_tokens=2)


def test_reachable_from_the_registry_and_the_cli_syntax():
    from kvpot.methods import METHODS, describe, make_method

    assert METHODS["infllm"] is kvpot.InfLLM
    method = make_method("infllm", topk="16", window="2048", offload="false")
    assert method.topk == 16 and method.window == 2048 and method.offload is False
    row = next(r for r in describe() if r["name"] == "infllm")
    assert "InfLLM" in row["paper"] and row["parameters"]["block_size"] == 128 and "topk" in row["bound"]
    with pytest.raises(KvpotError, match="takes no budget"):
        make_method("infllm", budget=4096)


def test_observations_are_refused():
    model = build("llama3")
    engine = kvpot.Engine(model, method=small())
    state = engine.prefill_ids(torch.randint(3, VOCAB, (40,)))
    with pytest.raises(KvpotError, match="observations"):
        engine.probe(state.cache, state.next_position, [5, 6], kvpot.attention.AttentionRequest())
