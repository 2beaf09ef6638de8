"""The bundled reference model: loads offline through transformers' Auto classes and meets its
accuracy bars inside its window on a CI-sized sample (the full 100-sample tables are in
records/reference-model/)."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kvpot
from kvpot.models.reference import REFERENCE_MODEL, has_reference_model
from kvpot.tasks import make_sample, score

pytestmark = pytest.mark.skipif(not has_reference_model(), reason="the reference model is not bundled")

LENGTH = 1900  # context + question + answer stay inside the 2,048-token window
DEPTHS = [0.05 + 0.9 * i / 29 for i in range(30)]


@pytest.fixture(scope="module")
def engine():
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be fetched
    tokenizer = AutoTokenizer.from_pretrained(REFERENCE_MODEL)
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_MODEL, dtype=torch.float32)
    assert model.config.max_position_embeddings == 2048
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert sum(p.numel() for p in model.parameters()) <= 8_000_000
    return kvpot.Engine(model, tokenizer, method=kvpot.Full())


def accuracy(engine, task: str) -> float:
    tokenizer = engine.tokenizer
    scores = []
    for index, depth in enumerate(DEPTHS):
        sample = make_sample(task, tokenizer, LENGTH, depth=depth, seed=1000 + index)
        context = [tokenizer.bos_token_id, *sample.context_ids]
        out = engine.generate_ids(context, sample.question_ids, max_new_tokens=16)
        scores.append(score(sample, tokenizer.decode(out.token_ids, skip_special_tokens=True)))
    return sum(scores) / len(scores)


@pytest.mark.slow
def test_passkey_bar_inside_the_window(engine, all_threads):
    assert accuracy(engine, "passkey") >= 0.99  # 30/30


@pytest.mark.slow
def test_single_needle_niah_bar_inside_the_window(engine, all_threads):
    assert accuracy(engine, "niah") >= 0.95  # at least 29/30


def test_text_generation_offline(engine):
    out = engine.generate("The grass is green. The sky is blue. The sun is", max_new_tokens=8)
    assert out.text.startswith(" yellow")
