"""A steady step's per-layer replacements on CUDA side streams (`kvpot.methods.replace.spread`).

The layers' launches run side by side on `replace.streams` streams, which fork from the step's stream and
join it after the last layer (in a captured graph: parallel branches). Nothing a layer's replacement
reads or writes belongs to another layer, so the tokens must be those of one stream, in half precision
where every evicting method's kernel runs. On a CPU, `spread` is `enumerate`."""

from __future__ import annotations

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.methods import replace

NEW = 40


class _Layer:
    def __init__(self, device):
        self.device = torch.device(device)


def test_spread_is_enumerate_off_cuda():
    layers = [_Layer("cpu") for _ in range(5)]
    assert list(replace.spread(layers)) == list(enumerate(layers))
    assert list(replace.spread([])) == []


def methods():
    return {
        "streaming": kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16),
        "h2o": kvpot.H2O(heavy=24, recent=24, chunk_size=16),
        "tova": kvpot.TOVA(budget=48, chunk_size=16),
        "d2o": kvpot.D2O(budget=40, chunk_size=64),
        "roco": kvpot.RoCo(budget=48, chunk_size=16),
        "cam": kvpot.CaM(start=8, recent=40, chunk_size=16, merge_budget=8),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(methods()))
def test_side_streams_give_the_tokens_of_one_stream(name, monkeypatch):
    model = build("llama3", num_hidden_layers=6, layer_types=["full_attention"] * 6).cuda().to(torch.bfloat16)
    torch.manual_seed(3)
    context = torch.randint(3, VOCAB, (160,), device="cuda")
    question = torch.randint(3, VOCAB, (6,), device="cuda")
    outs = {}
    for streams in (1, 4):
        monkeypatch.setattr(replace, "streams", streams)
        engine = kvpot.Engine(model, method=methods()[name], decode="graph", runner="sequence")
        outs[streams] = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    assert outs[4].token_ids == outs[1].token_ids
    assert outs[4].stats.decode["replays"] == outs[1].stats.decode["replays"] > 0
    assert outs[4].stats.compressions == outs[1].stats.compressions > 0
