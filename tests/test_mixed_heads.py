"""What a mixed step does once for all its chunks after the forward (`kvpot.engine.mixed.after_chunks`): the head's
products (`chunk_heads`) and the token scores' writes to the pool (`token_scores.store_chunks`) give each chunk what
its own products and writes give (`Engine._after_forward`, `token_scores.store_forward`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvpot
from conftest import VOCAB, build_llama
from kvpot import scoring
from kvpot.engine import mixed
from kvpot.engine.scheduler import Scheduler
from kvpot.methods.base import Step
from kvpot.methods.token_scores import store_chunks, store_forward


@pytest.fixture(scope="module")
def model():
    return build_llama()


def chunks_of(lengths: list[int], hidden_size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    chunks, hiddens = [], []
    for i, q in enumerate(lengths):
        logits = None if i == 0 else torch.randn(VOCAB, generator=g)  # the first starts a stream
        ids = torch.randint(3, VOCAB, (q,), generator=g)
        chunks.append(mixed.Chunk(SimpleNamespace(logits=logits), ids, Step("context", q)))
        hiddens.append(torch.randn(q, hidden_size, generator=g))
    return chunks, hiddens


@pytest.mark.parametrize("slice_rows", [3, 1000], ids=["rows-in-slices", "one-slice"])
@pytest.mark.parametrize("method", ["infinipot", "full"])
def test_chunk_heads_give_each_chunk_its_own_products(model, method, slice_rows, monkeypatch):
    """Each chunk's last logits and (InfiniPot) its tokens' -log p, the first from the logits before it (0 at a
    stream's start), as `Engine._after_forward` computes them alone; a one-token chunk (a riding row) is left to its
    own head. With `token_nll`'s rows cut in slices of 3, the chunks' rows fall in different slices."""
    monkeypatch.setattr(scoring, "MAX_LOGIT_ELEMENTS", slice_rows * VOCAB)
    engine = kvpot.Engine(model, method=kvpot.InfiniPot(pot_size=64, catalyst=None) if method == "infinipot"
                          else kvpot.Full())
    chunks, hiddens = chunks_of([5, 1, 7, 2, 4], model.config.hidden_size)
    heads = mixed.chunk_heads(engine, chunks, hiddens)
    assert heads[1] is None
    for chunk, hidden, head in zip(chunks, hiddens, heads):
        if chunk.ids.numel() == 1:
            continue
        logits, nll = head
        torch.testing.assert_close(logits, engine.head(hidden[-1]).float(), atol=1e-5, rtol=1e-5)
        if method == "full":
            assert nll is None
        else:
            torch.testing.assert_close(nll, engine._token_nll(chunk.run.logits, hidden, chunk.ids), atol=1e-5,
                                       rtol=1e-5)
    assert mixed.chunk_heads(engine, chunks[:1], hiddens[:1]) == [None]  # one chunk: its own products, as alone


def slot_caches(model, counts: list[int]):
    """Pool slots holding `counts[i]` entries in every layer (random keys), as a mixed step's chunks leave them."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=len(counts), capacity=64, decode="static")
    pool, caches = scheduler.pool, []
    for slot, n in enumerate(counts):
        cache = pool.cache(slot)
        cache.begin_forward(torch.arange(n), n - 1, None)
        for layer in cache.layers:
            shape = (1, layer.kv_heads, n, layer.head_dim)
            layer.append(torch.randn(shape), torch.randn(shape))
        caches.append(cache)
    return pool, caches


def test_chunk_scores_written_at_once_are_what_each_chunk_writes(model):
    """`store_chunks` writes every chunk's newest entries' scores in one indexed write a layer: the pool's score
    buffers end as `store_forward`'s, chunk by chunk, leave them; `store_forward` writes nothing once told so."""
    from kvpot.methods.infinipot import NUC

    pool, caches = slot_caches(model, [9, 4, 12])
    scores = [torch.rand(q) + 1 for q in (3, 4, 5)]  # each chunk's tokens: the last q entries of its slot
    assert store_chunks(caches, NUC, scores)
    at_once = [layer.score(NUC).clone() for layer in pool.layers]
    for layer in pool.layers:
        layer.score(NUC).zero_()
    for cache, s in zip(caches, scores):
        store_forward(cache, NUC, Step("context", len(s), token_nll=s))
    for layer, once in zip(pool.layers, at_once):
        assert torch.equal(layer.score(NUC), once)
        assert once.count_nonzero() == layer.kv_heads * sum(len(s) for s in scores)  # every head, nothing else
    before = [layer.score(NUC).clone() for layer in pool.layers]
    store_forward(caches[0], NUC, Step("context", 3, token_nll=torch.full((3,), 99.0), scores_stored=True))
    assert all(torch.equal(layer.score(NUC), b) for layer, b in zip(pool.layers, before))


def test_chunk_scores_of_caches_it_cannot_index_are_left_to_each_chunk(model):
    """A cache whose layers hold different counts (or one that is not a pool slot's) is not written at once: False,
    nothing written."""
    from kvpot.methods.infinipot import NUC

    pool, caches = slot_caches(model, [6, 6])
    caches[1].layers[0].n -= 1
    assert not store_chunks(caches, NUC, [torch.ones(2), torch.ones(2)])
    assert all(layer.score(NUC).count_nonzero() == 0 for layer in pool.layers)
    from kvpot.cache import PotCache

    plain = PotCache(len(caches[0].layers), caches[0].rope, caches[0].policy)
    assert not store_chunks([caches[0], plain], NUC, [torch.ones(2), torch.ones(2)])


def test_a_slot_s_views_are_made_once(model):
    """Each new sequence in a slot takes the views of its row made at the slot's first use (`PoolLayer.row_views`),
    and they are views of the pool: a write through them lands there."""
    pool, caches = slot_caches(model, [3, 5])
    again = pool.cache(0)
    for layer, before in zip(again.layers, caches[0].layers):
        assert layer.keys is before.keys and layer.rope_positions is before.rope_positions
        assert layer.keys.data_ptr() == layer.storage.keys[0].data_ptr()
    again.layers[0].values[0, 0, 0, 0] = 42.0
    assert pool.layers[0].values[0, 0, 0, 0] == 42.0 and pool.layers[0].values[1, 0, 0, 0] != 42.0
