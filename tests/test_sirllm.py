"""SirLLM: token-entropy selection with sinks, recent and decay, in a pot that never overflows."""

import json

import pytest
import torch

import kvpot
from conftest import VOCAB, build, run
from kvpot.errors import KvpotError
from kvpot.methods.base import Step
from kvpot.methods.sirllm import SCORE


@pytest.fixture(scope="module")
def model():
    return build("llama3")


def _append(cache, source, start: int, count: int) -> None:
    """Append `count` entries of `source` (stream positions start..) to every layer of `cache`."""
    for layer, other in zip(cache.layers, source.layers):
        layer.append_entries(other, start)
        layer.truncate(layer.n - (other.n - start - count))


def _positions(cache) -> list[list[int]]:
    """Stream positions of every layer's and head's entries."""
    return [row.tolist() for layer in cache.layers for row in layer.positions[0, :, : layer.n]]


def test_keeps_sinks_recent_and_highest_entropy_and_decays_between_rounds(model):
    """Two pot fillings on hand-set entropies: sink + recent + top entropies, then x decay."""
    torch.manual_seed(0)
    source = kvpot.Engine(model, method=kvpot.Full()).prefill_ids(torch.randint(3, VOCAB, (30,))).cache
    outcomes = {}
    for decay in (0.5, 1.0):
        method = kvpot.SirLLM(pot_size=8, compress_size=4, sinks=1, recent=1, decay=decay, positions="absolute")
        state = kvpot.Engine(model, method=method).prefill_ids(torch.randint(3, VOCAB, (7,)))  # below the pot
        cache = state.cache
        assert cache.lengths() == [7, 7]
        for layer in cache.layers:
            layer.score(SCORE)[:] = torch.tensor([0.0, 6.0, 1.0, 5.0, 2.0, 0.5, 0.1]).view(1, 1, 7)
        _append(cache, source, 20, 1)  # stream position 20, entropy 3: the pot is full
        assert method.after_forward(cache, Step("context", 1, token_nll=torch.tensor([3.0])))
        # sink 0, recent 20, then the two highest entropies of the rest (6 at 1, 5 at 3), in every head and layer
        assert all(row == [0, 1, 3, 20] for row in _positions(cache))
        for layer in cache.layers:
            expected = torch.tensor([0.0, 6.0, 5.0, 3.0]) * decay
            torch.testing.assert_close(layer.score(SCORE)[0], expected.expand(layer.kv_heads, -1))
        _append(cache, source, 21, 4)  # positions 21..24, entropies 4, 0.2, 0.3, 0.1: full again
        assert method.after_forward(cache, Step("context", 4, token_nll=torch.tensor([4.0, 0.2, 0.3, 0.1])))
        outcomes[decay] = _positions(cache)[0]
    # decayed, position 3 (5 -> 2.5) loses to the new key token at 21 (4); undecayed it keeps its place
    assert outcomes[0.5] == [0, 1, 21, 24]
    assert outcomes[1.0] == [0, 1, 3, 24]


def test_the_pot_bound_holds_in_prefill_and_decoding(model):
    torch.manual_seed(1)
    method = kvpot.SirLLM(pot_size=64, decay=0.9, recent=4)
    engine = kvpot.Engine(model, method=method)
    state = engine.prefill_ids(torch.randint(3, VOCAB, (512,)))
    assert state.stats.max_kv_entries <= 64
    assert state.stats.compressions == (512 - 64) // 32 + 1  # every filling of the pot compresses
    out = engine.generate_ids(question_ids=torch.randint(3, VOCAB, (6,)), state=state, max_new_tokens=100,
                              ignore_eos=True)
    assert out.stats.max_kv_entries <= method.max_entries() == 64
    assert out.stats.compressions > state.stats.compressions  # decoding filled the pot again


def test_configuration_is_validated():
    with pytest.raises(KvpotError, match="compress_size"):
        kvpot.SirLLM(pot_size=16, compress_size=16)
    with pytest.raises(KvpotError, match="exceed compress_size"):
        kvpot.SirLLM(pot_size=16, sinks=4, recent=5)
    with pytest.raises(KvpotError, match="decay"):
        kvpot.SirLLM(decay=0.0)
    with pytest.raises(KvpotError, match="positions"):
        kvpot.SirLLM(positions="reset")
    assert kvpot.make_method("sirllm", budget=256).pot_size == 256
    assert kvpot.make_method("sirllm", decay="0.7").decay == 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from test_cli import byte_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    build("llama3").save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("spec,key,value", [("sirllm:decay=0.9", "pot_size", 64), ("cam:merge_budget=8", "start", 32)])
def test_the_cli_runs_both_methods_with_a_budget(capsys, model_dir, spec, key, value):
    code, out, err = run(capsys, "generate", "--model", str(model_dir), "--method", spec, "--budget", "64",
                         "--context", "Once upon a time " * 12, "--question", "What?", "--max-new-tokens", "3",
                         "--json")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["method"][key] == value and payload["method_spec"] == spec
    assert payload["stats"]["max_kv_entries"] <= kvpot.make_method(spec.split(":")[0], budget=64).max_entries()
    code, out, _ = run(capsys, "methods", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert "Yao" in rows["sirllm"]["paper"] and "Zhang" in rows["cam"]["paper"]
