"""CItruS: eq. 1's selection, the memory bound, exactness without eviction, the cache variants."""

import pytest
import torch

import kvpot
from conftest import VOCAB, build, reference_greedy
from kvpot.errors import KvpotError
from kvpot.methods.citrus import CItruS

KEEP, CHUNK = 32, 8


@pytest.fixture(scope="module")
def model():
    return build("llama3")


@pytest.mark.parametrize("variant", ["none", "shared", "individual"])
def test_memory_bound_for_a_context_64x_the_budget(model, variant):
    torch.manual_seed(0)
    context, question = torch.randint(3, VOCAB, (64 * (KEEP + CHUNK),)), torch.randint(3, VOCAB, (5,))
    method = CItruS(chunk_size=CHUNK, keep=KEEP, cache=variant)
    out = kvpot.Engine(model, method=method).generate_ids(context, question, max_new_tokens=64, ignore_eos=True)
    probe = question.numel() if variant == "shared" else 0  # the instruction, while it is probed
    assert out.stats.max_kv_entries <= method.max_entries() + probe
    # between chunks C holds keep + chunk_size (the paper's "cache size k + l_s")
    assert out.stats.max_kv_entries >= KEEP + CHUNK
    assert out.stats.compressions >= context.numel() // CHUNK - KEEP // CHUNK - 1
    assert out.stats.new_tokens == 64


def test_between_chunks_the_cache_holds_keep_plus_chunk(model):
    engine = kvpot.Engine(model, method=CItruS(chunk_size=CHUNK, keep=KEEP, cache="none"))
    state = engine.prefill_ids(torch.randint(3, VOCAB, (KEEP * 8 + 3,)))  # ends on a 3-token chunk
    assert state.cache.lengths() == [KEEP + 3] * 2  # no instruction: no final eviction


@pytest.mark.parametrize("variant", ["none", "shared", "individual"])
def test_equals_full_when_keep_plus_chunk_holds_the_context(model, variant):
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (70,))
    expected = reference_greedy(model, ids, 20)
    method = CItruS(chunk_size=16, keep=100, cache=variant)
    out = kvpot.Engine(model, method=method).generate_ids(ids[:60], ids[60:], max_new_tokens=20)
    assert out.token_ids == expected and out.stats.compressions == 0


class Recorder(CItruS):
    """CItruS that records, per layer, the eq.-1 importance it selected with."""

    def _keep_top(self, cache, scores, old, keep):
        self.seen = [s.clone() for s in scores]
        self.before = [layer.positions[0, :, :old].clone() for layer in cache.layers]
        super()._keep_top(cache, scores, old, keep)


def test_kept_set_is_exactly_the_top_keep_of_eq_1(model):
    """Standard CSE, one eviction: the importance is a mean of softmaxes over C alone (each head's
    scores sum to 1: eq. 1's denominator; the softmax itself is checked against eager attention in
    test_attention.py), C keeps exactly its top-k, and the whole chunk stays after them."""
    method = Recorder(chunk_size=CHUNK, keep=KEEP, cache="none", selection="head")
    engine = kvpot.Engine(model, method=method)
    torch.manual_seed(2)
    state = engine.prefill_ids(torch.randint(3, VOCAB, (KEEP + 2 * CHUNK,)))  # one eviction
    for layer, score, before in zip(state.cache.layers, method.seen, method.before):
        assert score.shape == (1, 2, KEEP + CHUNK)
        torch.testing.assert_close(score.sum(-1), torch.ones(1, 2), rtol=1e-5, atol=1e-5)  # mean of softmaxes over C
        top = score[0].topk(KEEP, dim=-1).indices.sort(dim=-1).values  # [2, keep]
        expected = torch.gather(before, 1, top)  # original positions of the top-k of C
        kept_old = layer.positions[0, :, :KEEP]
        assert torch.equal(kept_old, expected)
        # and the whole chunk stays, after them
        assert layer.positions[0, :, KEEP : layer.n].tolist() == [list(range(KEEP + CHUNK, KEEP + 2 * CHUNK))] * 2


def test_layer_selection_keeps_the_same_tokens_in_every_head(model):
    engine = kvpot.Engine(model, method=CItruS(chunk_size=CHUNK, keep=KEEP, cache="none"))
    state = engine.prefill_ids(torch.randint(3, VOCAB, (300,)))
    for layer in state.cache.layers:
        positions = layer.positions[0, :, : layer.n]
        assert torch.equal(positions[0], positions[1])


def test_instruction_entries_are_rolled_back_and_individual_answers_from_c_i(model):
    torch.manual_seed(3)
    context, question = torch.randint(3, VOCAB, (200,)), torch.tensor([90, 91, 92])
    engine = kvpot.Engine(model, method=CItruS(chunk_size=CHUNK, keep=KEEP, cache="individual"))
    state = engine.prefill_ids(context, question)
    assert "citrus.instruction_cache" not in state.cache.method_state  # C^I became the cache
    for layer in state.cache.layers:
        positions = layer.positions[0, :, : layer.n]
        # keep entries of the document, then the 3 instruction tokens at stream positions 200..202
        assert layer.n == KEEP + 3 and positions[0, -3:].tolist() == [200, 201, 202]
        assert positions.max() <= 202


def test_shared_and_individual_need_the_instruction(model):
    for variant in ("shared", "individual"):
        engine = kvpot.Engine(model, method=CItruS(chunk_size=CHUNK, keep=KEEP, cache=variant))
        with pytest.raises(KvpotError, match="needs the instruction"):
            engine.prefill_ids(torch.arange(3, 90))


@pytest.mark.parametrize(
    "kwargs, fragment",
    [(dict(cache="both"), "cache must be one of"), (dict(score="tova"), "score must be one of"),
     (dict(selection="token"), "selection must be one of"), (dict(keep=0), "keep must be a positive")],
)
def test_bad_parameters_are_refused(kwargs, fragment):
    with pytest.raises(KvpotError, match=fragment):
        CItruS(**kwargs)


def test_budget_splits_like_the_paper():
    method = kvpot.make_method("citrus", budget=1024)
    assert (method.keep, method.chunk_size) == (768, 256)


def test_prefilled_document_is_evicted_by_the_question_when_asked(model):
    """Standard CSE through the two-phase API: the after-document eviction happens with the
    question; the state is not consumed, and asking twice gives the same answer."""
    torch.manual_seed(4)
    engine = kvpot.Engine(model, method=CItruS(chunk_size=CHUNK, keep=KEEP, cache="none"))
    state = engine.prefill_ids(torch.randint(3, VOCAB, (300,)))
    assert state.cache.lengths() == [KEEP + 300 % CHUNK or KEEP + CHUNK] * 2
    question = torch.tensor([90, 91, 92, 93, 94])
    first = engine.generate_ids(question_ids=question, state=state, max_new_tokens=5)
    second = engine.generate_ids(question_ids=question, state=state, max_new_tokens=5)
    assert first.token_ids == second.token_ids
    # the question's forward evicted the document to `keep` (36 -> 32, then 37 with the question);
    # the 4th generated token crossed keep + chunk_size (41 > 40) and brought C back to keep + 1
    assert first.stats.compressions == state.stats.compressions + 2
    assert first.stats.final_kv_entries == KEEP + 1


def test_instruction_in_the_chunk_forward_equals_a_separate_probe(monkeypatch):
    """Shared cache: the instruction rides in each chunk's forward; the kept entries and the
    answer are those of the separate instruction probe."""
    from kvpot.methods.citrus import CItruS

    model = build("llama3")
    torch.manual_seed(11)
    context, question = torch.randint(3, VOCAB, (400,)), torch.randint(3, VOCAB, (6,))

    def run():
        engine = kvpot.Engine(model, method=CItruS(chunk_size=32, keep=48, cache="shared"))
        state = engine.prefill_ids(context, question)
        out = engine.generate_ids(context, question, max_new_tokens=30, ignore_eos=True)
        return out, [layer.positions[:, :, : layer.n].clone() for layer in state.cache.layers]

    fused, fused_kept = run()
    monkeypatch.setattr(CItruS, "tail_probe", lambda self, cache, step: None)
    separate, separate_kept = run()
    assert fused.token_ids == separate.token_ids and fused.stats.compressions == separate.stats.compressions > 0
    assert fused.stats.max_kv_entries == separate.stats.max_kv_entries
    for a, b in zip(fused_kept, separate_kept):
        assert torch.equal(a, b)


def test_fixed_instruction_lets_the_shared_cache_read_without_a_question(tiny_dir):
    """Language modelling (Fig. 7) has no question: `instruction` gives the shared cache one."""
    engine = kvpot.Engine.from_pretrained(str(tiny_dir), method=CItruS(chunk_size=16, keep=32, cache="shared"))
    text_ids = torch.randint(3, 200, (200,))
    with pytest.raises(KvpotError, match="needs the instruction"):
        engine.score_ids(text_ids)
    engine.method = CItruS(chunk_size=16, keep=32, cache="shared", instruction="generic")
    scored = engine.score_ids(text_ids)
    assert scored.nll.shape == (199,) and torch.isfinite(scored.nll).all()  # every token but the first
    from kvpot.methods.infinipot import GENERIC_CATALYST

    probe = len(engine.tokenizer.encode(GENERIC_CATALYST, add_special_tokens=False))  # the instruction, while probed
    assert scored.stats.max_kv_entries <= engine.method.max_entries() + probe and scored.stats.compressions > 0
    engine.method = CItruS(chunk_size=16, keep=32, cache="shared", instruction="Summarize the text.")
    other = engine.score_ids(text_ids)
    assert not torch.equal(other.nll, scored.nll)  # the instruction steers which entries stay
