"""InfiniPot: the pot bound, Code 1's selection, exactness without distillation, NuC values."""

import pytest
import torch

import kvpot
import kvpot.scoring as scoring
from conftest import VOCAB, build, reference_greedy
from kvpot.errors import KvpotError
from kvpot.methods.infinipot import NUC, InfiniPot, select

POT = 32


@pytest.fixture(scope="module")
def model():
    return build("llama3")


@pytest.mark.parametrize("times", [2, 8, 64])
@pytest.mark.parametrize("catalyst", ["question", None], ids=["CaP-Q", "no-CaP"])
def test_pot_bound_holds_in_prefill_and_decoding(model, times, catalyst):
    torch.manual_seed(times)
    context, question = torch.randint(3, VOCAB, (POT * times,)), torch.randint(3, VOCAB, (5,))
    method = InfiniPot(pot_size=POT, catalyst=catalyst)
    engine = kvpot.Engine(model, method=method)
    out = engine.generate_ids(context, question, max_new_tokens=64, ignore_eos=True)
    assert out.stats.max_kv_entries <= POT
    assert out.stats.max_kv_entries == POT  # the pot does fill (catalyst included) before distilling
    assert out.stats.compressions >= (POT * times) // POT  # one distillation per |M|-|C|-|P| tokens
    assert out.stats.new_tokens == 64


def test_generic_catalyst_state_answers_many_questions_within_the_pot(model):
    from test_cli import byte_tokenizer

    engine = kvpot.Engine(model, byte_tokenizer(), method=InfiniPot(pot_size=128, compress_size=32))
    state = engine.prefill("The grass is green. " * 40)  # 800 characters: a pot of 128 holds 38 new per cycle
    assert state.stats.max_kv_entries <= 128 and state.stats.compressions >= 20
    # the generic catalyst is Table 2's CaP-G sentence, one token per character here
    assert state.cache.method_state["infinipot.catalyst"].numel() == len(
        "Summarize the critical points highlighted in this section.")
    first = engine.generate(question="What colour?", state=state, max_new_tokens=6)
    second = engine.generate(question="What colour?", state=state, max_new_tokens=6)
    assert first.token_ids == second.token_ids and first.stats.max_kv_entries <= 128


def test_selection_matches_code_1_on_a_hand_built_example():
    cap = torch.tensor([[[0.9, 0.1, 0.5, 0.3, 0.8, 0.2], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]]])
    nuc = torch.tensor([[[0.0, 5.0, 1.0, 0.5, 0.2, 4.0], [0.0, 5.0, 1.0, 0.5, 0.2, 4.0]]])
    # |C| = 4, T = 2: NuC keeps tokens 1 and 5 in both heads, CaP fills the rest per head
    keep = select(cap, nuc, keep=4, nuc_slots=2)
    assert keep[0].tolist() == [[0, 1, 4, 5], [1, 3, 4, 5]]
    # CaP only (ratio 0): top-4 attention per head
    assert select(cap, nuc, 4, 0)[0].tolist() == [[0, 2, 3, 4], [2, 3, 4, 5]]
    # NuC without CaP: T by NuC, the rest most recent
    assert select(None, nuc, 4, 2)[0].tolist() == [[1, 3, 4, 5], [1, 3, 4, 5]]
    # neither: the most recent |C| (sequential fill)
    assert select(None, nuc, 3, 0)[0].tolist() == [[3, 4, 5], [3, 4, 5]]


@pytest.mark.parametrize("with_cap", [True, False])
def test_ranking_every_layer_in_one_call_picks_what_each_layer_picks_alone(with_cap):
    """`distill` ranks all layers at once ([layers, b, kv_heads, n]): the same indices as one `select` a layer."""
    torch.manual_seed(0)
    caps, nucs = torch.rand(5, 1, 4, 64), torch.rand(5, 1, 4, 64)
    together = select(caps if with_cap else None, nucs, keep=24, nuc_slots=9)
    alone = [select(caps[i] if with_cap else None, nucs[i], keep=24, nuc_slots=9) for i in range(5)]
    assert together.shape == (5, 1, 4, 24)
    assert all(torch.equal(together[i], alone[i]) for i in range(5))


def test_equals_full_when_the_pot_holds_everything(model):
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (70,))
    expected = reference_greedy(model, ids, 20)
    for catalyst in ("question", None):
        engine = kvpot.Engine(model, method=InfiniPot(pot_size=200, compress_size=100, catalyst=catalyst))
        out = engine.generate_ids(ids[:60], ids[60:], max_new_tokens=20)
        assert out.token_ids == expected and out.stats.compressions == 0


class ChunkedPot(InfiniPot):
    """InfiniPot forced to read 16 tokens per forward, to exercise chunk boundaries."""

    def next_chunk(self, cache, remaining):
        return min(16, super().next_chunk(cache, remaining))


def test_nuc_in_slices_equals_cross_entropy_of_full_logits(model, monkeypatch):
    torch.manual_seed(6)
    ids = torch.randint(3, VOCAB, (75,))
    model.set_attn_implementation("sdpa")  # an Engine switched it to kvpot
    with torch.no_grad():
        logits = model(ids.view(1, -1)).logits[0].float()
    want = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
    monkeypatch.setattr(scoring, "MAX_LOGIT_ELEMENTS", 5 * VOCAB)  # 5-row slices
    engine = kvpot.Engine(model, method=ChunkedPot(pot_size=100, compress_size=50, catalyst=None))
    state = engine.prefill_ids(ids)
    for layer in state.cache.layers:
        nuc = layer.score(NUC)[0]  # [kv_heads, 75], the same per head
        assert nuc[:, 0].eq(0).all()  # nothing predicts the first token
        torch.testing.assert_close(nuc[0, 1:], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(nuc[1, 1:], want, rtol=1e-4, atol=1e-4)


def test_kept_entries_keep_their_nuc_and_catalyst_is_never_kept(model):
    torch.manual_seed(7)
    ids = torch.randint(3, VOCAB, (40,))
    question = torch.tensor([90, 91, 92, 93])
    method = InfiniPot(pot_size=24, compress_size=8, nuc_ratio=0.5, catalyst="question")
    engine = kvpot.Engine(model, method=method)
    state = engine.prefill_ids(ids, question)
    for layer in state.cache.layers:
        positions = layer.positions[0, :, : layer.n]
        assert positions.max() < 44  # context + question only: catalyst probes left nothing behind
        # entries are in original order per head, and CR-RoPE numbered them 0..n-1
        assert torch.all(positions[:, 1:] > positions[:, :-1])
        assert layer.rope_positions[0, :, : layer.n].tolist() == [list(range(layer.n))] * 2


@pytest.mark.parametrize("share", ["layer", "model"])
def test_shared_selection_gives_each_kept_token_one_position(model, share):
    """share='layer': a layer's KV heads keep the same tokens, so CR-RoPE gives a token one
    position per layer; 'model': every layer keeps the same tokens too. The pot bound holds."""
    torch.manual_seed(11)
    ids, question = torch.randint(3, VOCAB, (200,)), torch.tensor([90, 91, 92, 93])
    state = kvpot.Engine(model, method=InfiniPot(pot_size=24, compress_size=12, catalyst="question",
                                                 share=share)).prefill_ids(ids, question)
    assert state.stats.max_kv_entries <= 24 and state.stats.compressions >= 10
    kept = [layer.positions[0, :, : layer.n] for layer in state.cache.layers]
    for layer, tokens in zip(state.cache.layers, kept):
        assert torch.equal(tokens, tokens[:1].expand_as(tokens))  # every head holds the same tokens
        assert layer.rope_positions[0, :, : layer.n].tolist() == [list(range(layer.n))] * tokens.shape[0]
    if share == "model":
        assert all(torch.equal(tokens[0], kept[0][0]) for tokens in kept)
    else:  # per layer: the layers of this random model disagree somewhere
        assert any(not torch.equal(tokens[0], kept[0][0]) for tokens in kept)


def test_shared_selection_ranks_the_mean_over_heads_and_layers():
    from kvpot.methods.infinipot import select_shared

    nuc = torch.zeros(1, 2, 5)
    caps = [torch.tensor([[[9.0, 0, 0, 1, 0], [0, 0, 0, 1, 8]]]), torch.tensor([[[0.0, 0, 0, 8, 0], [0, 0, 0, 1, 0]]])]
    # per head, head 0 of layer 0 would keep token 0 and head 1 token 4; the mean ranks token 3 first
    assert select_shared(caps, [nuc, nuc], keep=1, nuc_slots=0).tolist() == [[[3]]]
    assert select_shared(caps[:1], [nuc], keep=2, nuc_slots=0).tolist() == [[[0, 4]]]
    nuc = torch.tensor([[[0.0, 5, 0, 0, 0]]]).expand(1, 2, 5)  # NuC's pick comes first, then CaP's mean
    assert select_shared(caps, [nuc, nuc], keep=2, nuc_slots=1).tolist() == [[[1, 3]]]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(pot_size=10, compress_size=10), "must be smaller than pot_size"),
        (dict(pot_size=10, nuc_ratio=1.5), "nuc_ratio must be in"),
        (dict(pot_size=0), "pot_size must be a positive"),
        (dict(positions="shift"), "positions must be one of"),
        (dict(share="heads"), "share must be one of"),
    ],
)
def test_bad_parameters_are_refused(kwargs, fragment):
    with pytest.raises(KvpotError, match=fragment):
        InfiniPot(**kwargs)


def test_catalyst_that_fills_the_pot_and_missing_question_are_refused(model):
    engine = kvpot.Engine(model, method=InfiniPot(pot_size=8, compress_size=4, catalyst="question"))
    with pytest.raises(KvpotError, match="cannot hold the compressed entries"):
        engine.generate_ids(torch.arange(3, 40), [5, 6, 7, 8, 9])
    with pytest.raises(KvpotError, match="needs the question"):
        engine.prefill_ids(torch.arange(3, 40))


def test_catalyst_in_the_filling_forward_equals_a_separate_probe(model, monkeypatch):
    """The catalyst rides in the forward that fills the pot (no second pass over the weights);
    its scores, and so the kept entries and the answer, are those of a separate probe."""
    torch.manual_seed(7)
    context, question = torch.randint(3, 90, (300,)), torch.randint(3, 90, (6,))

    def run():
        engine = kvpot.Engine(model, method=InfiniPot(pot_size=64, compress_size=32, catalyst="question"))
        state = engine.prefill_ids(context, question)
        out = engine.generate_ids(context, question, max_new_tokens=40, ignore_eos=True)
        kept = [layer.positions[:, :, : layer.n].clone() for layer in state.cache.layers]
        return out, kept

    fused, fused_kept = run()
    probes = []
    original_probe = kvpot.Engine.probe
    monkeypatch.setattr(kvpot.Engine, "probe", lambda *a, **k: probes.append(1) or original_probe(*a, **k))
    assert not probes
    monkeypatch.setattr(InfiniPot, "tail_probe", lambda self, cache, step: None)
    separate, separate_kept = run()
    assert len(probes) >= separate.stats.compressions > 0  # the old path probes at every distillation
    assert fused.token_ids == separate.token_ids
    assert fused.stats.compressions == separate.stats.compressions
    assert fused.stats.max_kv_entries == separate.stats.max_kv_entries <= 64  # the catalyst counts in the pot
    for a, b in zip(fused_kept, separate_kept):
        assert torch.equal(a, b)


def test_a_state_prefilled_with_its_question_decodes_without_it_again(model):
    """`prefill_ids(context, question)` then `generate_ids(state=...)`: the question catalyst (CaP-Q) was
    read with the context and keeps serving the distillations of decoding; the tokens are those of
    one `generate_ids(context, question)` call. (This raised 'needs the question' before.)"""
    torch.manual_seed(3)
    context, question = torch.randint(3, VOCAB, (POT * 6,)), torch.randint(3, VOCAB, (5,))
    engine = kvpot.Engine(model, method=InfiniPot(pot_size=POT, catalyst="question"))
    whole = engine.generate_ids(context, question, max_new_tokens=40, ignore_eos=True)
    state = engine.prefill_ids(context, question)
    resumed = engine.generate_ids(state=state, max_new_tokens=40, ignore_eos=True)
    assert resumed.token_ids == whole.token_ids
    assert resumed.stats.max_kv_entries <= POT and resumed.stats.compressions > state.stats.compressions
