"""Guarantee 2: when nothing is evicted, kvpot's greedy output is model.generate's, token for token."""

import pytest
import torch

import kvpot
from conftest import ROPE_VARIANTS, VOCAB, build, build_llama, reference_greedy

NEW = 20
CONTEXT, QUESTION = 61, 9  # odd sizes so that chunks end mid-way


def roomy_methods(total: int):
    """Every method with a budget at least the input plus the new tokens, and small chunks."""
    return [
        kvpot.Full(chunk_size=16),
        kvpot.Truncate(budget=total, chunk_size=16),
        kvpot.StreamingLLM(sinks=4, window=total, chunk_size=16),
        kvpot.H2O(heavy=total, recent=total, chunk_size=16),
        kvpot.TOVA(budget=total, chunk_size=16),
        kvpot.SnapKV(budget=total, window=8, chunk_size=16),
        kvpot.PyramidKV(budget=total, window=8, chunk_size=16),
        kvpot.Scissorhands.from_budget(total, chunk_size=16),
        kvpot.RoCo(budget=total, chunk_size=16),
        kvpot.SirLLM(pot_size=total + 1),
        kvpot.CaM(start=4, recent=total, chunk_size=16),
        kvpot.InfLLM(initial=4, window=total, block_size=8, topk=2, lookup=16, chunk_size=16),  # a window past the input
        kvpot.SelfExtend(group_size=1, window=total, chunk_size=16),  # every key a neighbour
    ]


@pytest.mark.parametrize("with_question", [False, True], ids=["context-only", "with-question"])
def test_every_method_equals_generate_when_nothing_is_evicted(arch, with_question):
    model = build(arch)
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (CONTEXT + QUESTION,))
    expected = reference_greedy(model, ids, NEW)
    context, question = (ids[:CONTEXT], ids[CONTEXT:]) if with_question else (ids, None)
    for method in roomy_methods(ids.numel() + NEW):
        engine = kvpot.Engine(model, method=method)
        out = engine.generate_ids(context, question, max_new_tokens=NEW)
        assert out.token_ids == expected, f"{arch} {method.name}"
        assert out.stats.compressions == 0


@pytest.mark.parametrize("rope", sorted(ROPE_VARIANTS))
def test_full_equals_generate_for_every_rope_variant(rope):
    # 700 tokens: past the yarn/llama3 original windows, so the scaled frequencies matter.
    model = build_llama(ROPE_VARIANTS[rope], max_position_embeddings=512)
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (700,))
    expected = reference_greedy(model, ids, NEW)
    out = kvpot.Engine(model, method=kvpot.Full(chunk_size=256)).generate_ids(ids, max_new_tokens=NEW)
    assert out.token_ids == expected


def test_state_reuse_matches_one_shot_and_leaves_state_unchanged():
    model = build("llama3")
    torch.manual_seed(3)
    context, question = torch.randint(3, VOCAB, (80,)), torch.randint(3, VOCAB, (7,))
    engine = kvpot.Engine(model, method=kvpot.StreamingLLM(sinks=4, window=40, chunk_size=16))
    state = engine.prefill_ids(context)
    snapshot = [(layer.n, layer.keys[:, :, : layer.n].clone()) for layer in state.cache.layers]
    first = engine.generate_ids(question_ids=question, state=state, max_new_tokens=12)
    second = engine.generate_ids(question_ids=question, state=state, max_new_tokens=12)
    assert first.token_ids == second.token_ids
    for layer, (n, keys) in zip(state.cache.layers, snapshot):
        assert layer.n == n and torch.equal(layer.keys[:, :, :n], keys)
    # Full: prefill + question on the state equals one-shot generation.
    full = kvpot.Engine(model, method=kvpot.Full(chunk_size=32))
    one_shot = full.generate_ids(context, question, max_new_tokens=12)
    reused = full.generate_ids(question_ids=question, state=full.prefill_ids(context), max_new_tokens=12)
    assert one_shot.token_ids == reused.token_ids


def test_a_handed_over_state_decodes_the_same_without_a_copy_and_is_then_spent():
    model = build("llama3")
    torch.manual_seed(5)
    context, question = torch.randint(3, VOCAB, (90,)), torch.randint(3, VOCAB, (5,))
    engine = kvpot.Engine(model, method=kvpot.StreamingLLM(sinks=4, window=40, chunk_size=16))
    state = engine.prefill_ids(context)
    kept = engine.generate_ids(question_ids=question, state=state, max_new_tokens=10)
    cache = state.cache
    handed = engine.generate_ids(question_ids=question, state=state, max_new_tokens=10, keep_state=False)
    assert handed.token_ids == kept.token_ids
    layer = cache.layers[0]
    assert state.cache is None
    assert int(layer.positions[..., : layer.n].max()) > context.numel() + question.numel()  # decoded in place
    with pytest.raises(kvpot.KvpotError, match="spent"):
        engine.generate_ids(question_ids=question, state=state, max_new_tokens=2)


def test_score_ids_equals_the_full_forward_loss():
    """With Full, chunked scoring equals the cross-entropy of one whole-sequence forward."""
    import kvpot.scoring as scoring

    model = build("qwen2")
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (90,))
    with torch.no_grad():
        logits = model(ids.view(1, -1)).logits[0, :-1].float()
    want = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=32))
    old = scoring.MAX_LOGIT_ELEMENTS
    try:
        scoring.MAX_LOGIT_ELEMENTS = 7 * VOCAB  # slices of 7 rows, dividing no chunk
        got = engine.score_ids(ids)
    finally:
        scoring.MAX_LOGIT_ELEMENTS = old
    torch.testing.assert_close(got.nll, want, rtol=1e-4, atol=1e-4)
    assert got.stats.max_kv_entries == 90


def test_chat_template_puts_context_first_and_question_last():
    """Like kvpress' pipeline: one user turn, context then question, then the generation prompt;
    the split happens exactly where the question starts, and generating from the two parts equals
    generating from the whole templated prompt."""
    from test_cli import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    model = build("qwen2")
    engine = kvpot.Engine(model, tokenizer, method=kvpot.Full(chunk_size=16))
    def text(ids):  # this character tokenizer's decode() puts spaces between tokens
        return "".join(tokenizer.convert_ids_to_tokens(ids))

    context_ids, question_ids = engine.encode("The sky is blue.", "Colour?")
    assert text(context_ids) == "<user>The sky is blue."
    assert text(question_ids) == "Colour?</user><assistant>"
    whole = torch.tensor(tokenizer.encode("<user>The sky is blue.Colour?</user><assistant>", add_special_tokens=False))
    assert torch.equal(torch.tensor(context_ids + question_ids), whole)
    expected = reference_greedy(model, whole, 8)
    model.set_attn_implementation("kvpot")
    assert engine.generate("The sky is blue.", "Colour?", max_new_tokens=8).token_ids == expected
    # chat_template=False: the raw text, question appended verbatim
    plain = kvpot.Engine(model, tokenizer, chat_template=False)
    assert text(sum(plain.encode("Sky.", "Why?"), [])) == "Sky.Why?"


def test_teacher_forced_generation_scoring():
    """prompt_tokens: Full gives the same losses token by token; D2O then holds its budget while
    decoding, as in generate."""
    model = build("llama3")
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (120,))
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=32))
    whole = engine.score_ids(ids)
    forced = engine.score_ids(ids, prompt_tokens=40)
    torch.testing.assert_close(forced.nll, whole.nll, rtol=1e-4, atol=1e-4)
    assert forced.stats.context_tokens == 40 and forced.stats.new_tokens == 80
    d2o = kvpot.Engine(model, method=kvpot.D2O(budget=16, layer_budget=False)).score_ids(ids, prompt_tokens=40)
    assert d2o.stats.final_kv_entries == 16 < d2o.stats.max_kv_entries  # compressed after the prompt, held there
    assert not torch.allclose(d2o.nll[40:], whole.nll[40:])
    with pytest.raises(kvpot.errors.KvpotError, match="prompt_tokens"):
        engine.score_ids(ids, prompt_tokens=0)
