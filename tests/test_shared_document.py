"""Readers of one stored document sharing its entries (`Scheduler(share_documents=True)`, `kvpot.engine.documents`).

The two-segment attention (a row's shared document, then its own tail, merged by log-sum-exp) is checked against
the one-segment reference over the same entries copied into each row's slot, over named shapes; every method's
readers get the tokens of the copy-per-reader path (float32, CPU) and of the one-sequence engine; the document is
loaded once, counted once in the pool's bytes, released by its last reader and evicted least recently used; each
method's copy-on-write events are those its `copies_document` declares. `pytest -k shared_document` selects all.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, build, rope_table
from test_batch import methods

import kvpot
from kvpot.engine.documents import DocumentRegion, copy_reason
from kvpot.engine.offline import run_all
from kvpot.engine.scheduler import Request, Scheduler
import kvpot.engine.scheduler as scheduler_module
from kvpot.errors import KvpotError
from torch.utils._python_dispatch import TorchDispatchMode
from kvpot.kernels.decode_reference import decode_attention_batch_reference
from kvpot.kernels.shared_reference import decode_attention_shared_reference

NEW = 20

# (name, query heads, kv heads, head dim, capacity, documents' lengths, each slot's (document row or -1, length),
#  each batch row's slot): several readers per document, rows without one, empty tails, an empty slot
SHARED_SHAPES = [
    ("gqa4-two-docs", 8, 2, 64, 96, [60, 33], [(0, 70), (0, 60), (1, 90), (-1, 41), (1, 34)], [0, 1, 2, 3, 4]),
    ("gqa1-one-doc-many-readers", 4, 4, 32, 64, [50], [(0, 51), (0, 64), (0, 55), (0, 50)], [0, 1, 2, 3, 3]),
    ("gqa8-short-doc", 16, 2, 64, 48, [1], [(0, 1), (0, 2), (-1, 0), (-1, 48)], [3, 0, 1, 2]),
    ("gqa3-full-doc", 6, 2, 32, 40, [40, 12], [(0, 40), (1, 40), (1, 12)], [2, 1, 0, 1]),
]


def shared_inputs(shape, rope: bool, seed: int = 0):
    """The shared layout and the same entries copied per slot (the reference's input)."""
    name, heads, kv, d, capacity, doc_lengths, slots, rows = shape
    g = torch.Generator().manual_seed(seed)
    S, D = len(slots), len(doc_lengths)
    keys, values = torch.randn(S, kv, capacity, d, generator=g), torch.randn(S, kv, capacity, d, generator=g)
    doc_keys, doc_values = torch.randn(D, kv, capacity, d, generator=g), torch.randn(D, kv, capacity, d, generator=g)
    key_positions = torch.randint(0, 2 * capacity, (S, kv, capacity), generator=g)
    doc_positions = torch.randint(0, 2 * capacity, (D, kv, capacity), generator=g)
    doc_rows = torch.tensor([doc for doc, _ in slots])
    lengths = torch.tensor([n for _, n in slots])
    copied_keys, copied_values, copied_positions = keys.clone(), values.clone(), key_positions.clone()
    for slot, (doc, _) in enumerate(slots):
        if doc >= 0:
            n = doc_lengths[doc]
            copied_keys[slot, :, :n], copied_values[slot, :, :n] = doc_keys[doc, :, :n], doc_values[doc, :, :n]
            copied_positions[slot, :, :n] = doc_positions[doc, :, :n]
            keys[slot, :, :n] = float("nan")  # a shared row's own first entries are never read
            values[slot, :, :n] = float("nan")
    for slot, (_, n) in enumerate(slots):  # nor anything past a length
        for buffer in (keys, values, copied_keys, copied_values):
            buffer[slot, :, n:] = float("nan")
    for doc, n in enumerate(doc_lengths):
        doc_keys[doc, :, n:], doc_values[doc, :, n:] = float("nan"), float("nan")
    query = torch.randn(len(rows), heads, d, generator=g)
    rope_args = {}
    if rope:
        cos, sin = rope_table(2 * capacity + 1, d, torch.float32, device="cpu")
        query_positions = torch.randint(0, 2 * capacity, (S,), generator=g)
        rope_args = dict(cos=cos, sin=sin, query_positions=query_positions)
    shared = (query, keys, values, torch.tensor(rows), lengths, doc_keys, doc_values, doc_rows, torch.tensor(doc_lengths))
    copied = (query, copied_keys, copied_values, torch.tensor(rows), lengths)
    return shared, copied, rope_args, (key_positions, doc_positions, copied_positions)


@pytest.mark.parametrize("rope", [True, False], ids=["rope-on-load", "pre-rotated"])
@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=[s[0] for s in SHARED_SHAPES])
def test_shared_document_reference_merges_two_segments_exactly(shape, rope):
    shared, copied, rope_args, (key_positions, doc_positions, copied_positions) = shared_inputs(shape, rope)
    batch, kv, capacity = len(shape[7]), shape[2], shape[4]
    probs, expected_probs = torch.full((batch, kv, capacity), float("nan")), torch.zeros(batch, kv, capacity)
    extra = dict(key_positions=key_positions, doc_key_positions=doc_positions) if rope else {}
    out = decode_attention_shared_reference(*shared, 0.125, probs=probs, **rope_args, **extra)
    expected = decode_attention_batch_reference(*copied, 0.125, probs=expected_probs, **rope_args,
                                                **(dict(key_positions=copied_positions) if rope else {}))
    assert torch.isfinite(out).all() and torch.isfinite(probs).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-5)


def test_shared_document_reference_refuses_a_region_unlike_the_pool():
    shared, *_ = shared_inputs(SHARED_SHAPES[0], rope=False)
    query, keys, values, rows, lengths, doc_keys, doc_values, doc_rows, doc_lengths = shared
    with pytest.raises(KvpotError, match="document region"):
        decode_attention_shared_reference(query, keys, values, rows, lengths, doc_keys[:, :1], doc_values[:, :1],
                                          doc_rows, doc_lengths, 0.1)
    with pytest.raises(KvpotError, match="doc_rows"):
        decode_attention_shared_reference(query, keys, values, rows, lengths, doc_keys, doc_values, doc_rows[:2],
                                          doc_lengths, 0.1)


# ---------------------------------------------------------------------- through the scheduler
@pytest.fixture(scope="module")
def model():
    return build("llama3")


@pytest.fixture(scope="module")
def context():
    return torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(3)).tolist()


QUESTIONS = [torch.randint(3, VOCAB, (k,), generator=torch.Generator().manual_seed(k)).tolist() for k in (3, 6, 2, 5)]


def readers(model, method, capacity, state, share: bool, slots: int = 3, documents: int = 2, questions=QUESTIONS,
            **options):
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=slots, capacity=capacity, decode="static",
                          share_documents=share, documents=documents, **options)
    requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in questions]
    run_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize("name", sorted(methods()))
def test_shared_document_readers_get_the_copy_per_reader_tokens(model, context, name, one_thread):
    """Every method: readers sharing the document get the tokens of readers with a copy each, and of the
    one-sequence engine; the copy-on-write events are the ones the method declares (`copies_document`)."""
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method, decode="eager")
    # CItruS' instruction caches and InfiniPot's question catalyst read the document with its question
    state = engine.prefill_ids(context, [4, 5] if name in ("citrus-shared", "citrus-individual",
                                                           "infinipot-question") else None)
    alone = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS]
    _, copied = readers(model, method, capacity, state, share=False)
    scheduler, shared = readers(model, method, capacity, state, share=True)
    assert [r.tokens for r in shared] == [r.tokens for r in copied] == [a.token_ids for a in alone]
    assert [r.stats.compressions for r in shared] == [a.stats.compressions for a in alone]
    report, declared = scheduler.report, type(method).copies_document
    assert report["shared_readers"] == 0 and scheduler.pool.used == 0  # every reader ended, or copied
    if declared == "never":
        assert report["copy_on_write"] == 0 and report["document_loads"] == 1
    elif declared == "when_full":  # one copy per reader whose pot filled after the stored state
        filled = sum(a.stats.compressions > state.stats.compressions for a in alone)
        assert report["copy_on_write"] == report["copy_on_write_eager"] == filled
    else:
        assert declared == "at_admission" and not method.feeds_question
        assert report["copy_on_write"] == report["copy_on_write_question"] == len(QUESTIONS)
        assert report["document_loads"] == 0  # nobody read the region: it was never loaded


SHARING = [name for name, (method, _) in sorted(methods().items()) if method.copies_document != "at_admission"]


@pytest.mark.parametrize("name", SHARING)
def test_shared_document_questions_read_as_chunks_over_the_region(model, context, name, one_thread):
    """Mixing on: a reader's question is read as a chunk of the mixed step, attending the document in the region
    (`documents.question_chunk`), where its method's chunk only appends (`Method.chunk_appends`); the others are fed.
    The tokens are the one-sequence engine's, no reader copies for its question, and no question token is fed
    that a chunk could read."""
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(context, [4, 5] if name == "infinipot-question" else None)
    alone = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS]
    scheduler, shared = readers(model, method, capacity, state, share=True, slots=4, mix="on")
    assert [r.tokens for r in shared] == [a.token_ids for a in alone]
    chunked = [method.chunk_appends(state.cache, len(q)) for q in QUESTIONS]
    report = scheduler.report
    assert any(chunked) and report["mixed_forwards"] >= 1
    assert report["fed_tokens"] == sum(len(q) for q, c in zip(QUESTIONS, chunked) if not c)
    assert report["copy_on_write_question"] == 0 and report["document_loads"] == 1
    filled = sum(a.stats.compressions > state.stats.compressions for a in alone)
    assert report["copy_on_write"] == report["copy_on_write_eager"] == filled


def test_shared_document_questions_fill_packed_steps_of_their_rows(model, context, one_thread, monkeypatch):
    """The fixed-shape mixed step (a GPU's, uncaptured here): 12 readers' questions read as chunks at most
    `packed_cache.ROWS` (8) a step, every such step packed (none eager: 32 a step ran eagerly on an H100), the
    readers' chunks attending the region; tokens as alone, nothing fed, nothing copied for a question."""
    from kvpot.engine.packed_cache import ROWS

    method = kvpot.Full(chunk_size=64)
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(context)
    g = torch.Generator().manual_seed(5)
    questions = [torch.randint(3, VOCAB, (4,), generator=g).tolist() for _ in range(12)]
    expected = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=4, ignore_eos=True).token_ids
                for q in questions]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=12, capacity=256, decode="static",
                          share_documents=True, mix="on")
    scheduler.decoder.fixed_mix = True
    chunks, forward = [], scheduler_module.mixed_forward
    monkeypatch.setattr(scheduler_module, "mixed_forward",
                        lambda decoder, slots, live, observe, parts: chunks.append(len(parts))
                        or forward(decoder, slots, live, observe, parts))
    requests = [Request(None, q, state=state, max_new_tokens=4, ignore_eos=True) for q in questions]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert sorted(chunks, reverse=True)[:2] == [ROWS, 12 - ROWS]  # 8, then the 4 that waited
    assert scheduler.decoder.packed.steps == len(chunks)  # every mixed step packed
    report = scheduler.report
    assert report["fed_tokens"] == 0 and report["copy_on_write"] == 0 and report["document_loads"] == 1


@pytest.mark.parametrize("packed", [False, True], ids=["eager", "packed"])
def test_shared_document_a_reader_alone_reads_its_question_as_a_chunk(model, context, packed, one_thread):
    """A reader with nobody decoding beside it: its question still mixes (a mixed step of one chunk and no rows),
    rather than wait for rows that never come or be read apart, copying the document."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(context)
    expected = engine.generate_ids(question_ids=QUESTIONS[0], state=state, max_new_tokens=4, ignore_eos=True)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static", share_documents=True,
                          mix="on")
    scheduler.decoder.fixed_mix = packed
    request = Request(None, QUESTIONS[0], state=state, max_new_tokens=4, ignore_eos=True)
    run_all(scheduler, [request])
    assert request.tokens == expected.token_ids
    report = scheduler.report
    assert report["mixed_forwards"] >= 1 and report["fed_tokens"] == 0 and report["copy_on_write_question"] == 0
    assert (scheduler.decoder.packed is not None and scheduler.decoder.packed.steps >= 1) == packed


def test_shared_document_every_method_declares_when_it_copies():
    from kvpot.methods import METHODS

    for name, cls in METHODS.items():
        assert vars(cls).get("copies_document") in ("never", "when_full", "at_admission"), name
        assert (cls.copies_document == "at_admission") == (not cls.feeds_question), name  # no fed question: a forward
        assert (cls.copies_document == "never") == (not cls.evicts_while_decoding and cls.feeds_question), name


@pytest.mark.parametrize("mix", ["off", "on"])  # questions fed, or read as chunks of the mixed step
def test_shared_document_readers_read_the_region_not_their_slot(model, context, mix, one_thread):
    """While shared, a reader's slot holds no copy of the document's keys (zeros), yet its tokens are right."""
    method = kvpot.Full(chunk_size=64)
    state = kvpot.Engine(model, method=method, decode="eager").prefill_ids(context)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=4, capacity=256, decode="static",
                          share_documents=True, mix=mix)
    requests = [scheduler.submit(Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True)) for q in QUESTIONS]
    for _ in range(3):  # admitted, questions read (fed, or as chunks), decoding
        scheduler.step()
    assert (scheduler.report["fed_tokens"] == 0) == (mix == "on")
    region, n = scheduler.pool.documents, state.cache.layers[0].n
    assert region.readers == 4 and region.documents == 1 and scheduler.report["shared_readers"] == 4
    assert len(region.loaded[id(state)].readers) == 4  # one document, four references
    for layer in scheduler.pool.layers:
        assert not layer.keys[:4, :, :n].any()  # nothing copied into the slots
    scheduler.run()
    assert all(len(r.tokens) == NEW for r in requests)
    assert region.readers == 0 and region.documents == 1  # the last reader ended: loaded, no reference left


def test_shared_document_is_counted_once_in_the_pool_bytes(model, context, one_thread):
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    state = kvpot.Engine(model, method=method, decode="eager").prefill_ids(context)
    sizes = {}
    for share in (False, True):
        for count in (1, 4):
            scheduler = Scheduler(kvpot.Engine(model, method=method), slots=4, decode="static", share_documents=share,
                                  documents=2)
            for q in QUESTIONS[:count]:
                scheduler.submit(Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True))
            scheduler.step()  # admitted: the same score buffers in both pools
            assert not share or scheduler.pool.documents.readers == count
            sizes[share, count] = scheduler.pool.nbytes
    config = model.config
    kv, d = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=model.dtype).element_size()
    # per document row and layer: keys and values, and one int64 RoPE position per entry; then the region's counts
    row = config.num_hidden_layers * kv * scheduler.capacity * (2 * d * element + 8)
    region = 2 * row + 8 * (config.num_hidden_layers * 2 + scheduler.pool.slots + 1)
    assert scheduler.pool.documents.nbytes == region
    # one reader or four: the document counts once, beside slots as large as a copied reader's
    assert sizes[True, 1] == sizes[True, 4] == sizes[False, 4] + region


class IndexPuts(TorchDispatchMode):
    """Counts the indexed writes (`aten.index_put_`) run inside it."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.index_put_.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("share", [False, True], ids=["copied", "shared"])
def test_shared_document_admission_copies_a_state_once_for_all_its_readers(model, context, share, one_thread):
    """Readers of one state admitted in one step are loaded in one indexed write per layer and buffer, not one per
    reader (64 readers' loads took 202 ms of host time at the first step on an H100); their tokens stay the alone ones."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    state = kvpot.Engine(model, method=method, decode="eager").prefill_ids(context)
    counts, tokens = {}, {}
    for count in (2, 4):  # (a reader alone reads its question in a forward of its own, not fed)
        scheduler = Scheduler(kvpot.Engine(model, method=method), slots=4, decode="static", share_documents=share)
        requests = [scheduler.submit(Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True))
                    for q in QUESTIONS[:count]]
        with IndexPuts() as puts:
            scheduler.step()  # admission, then the first fed step (its writes do not depend on the batch)
        counts[count] = puts.count
        scheduler.run()
        tokens[count] = [r.tokens for r in requests]
    assert counts[2] == counts[4] > 0
    assert tokens[4][:2] == tokens[2]


def test_shared_document_a_slot_reused_before_the_flush_keeps_its_last_load(model, context, one_thread):
    """A deferred load of a slot released (a request failing at admission) and taken again before the pool flushes
    is dropped: the slot holds the state it loaded last, whichever source was grouped first."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    engine = kvpot.Engine(model, method=method, decode="eager")
    first, second = engine.prefill_ids(context), engine.prefill_ids(context[::-1][:90])
    pool = Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static").pool
    a = pool.acquire()
    pool.load(a, second.cache, defer=True)
    b = pool.acquire()
    pool.load(b, first.cache, defer=True)
    pool.release(b)
    assert pool.acquire() == b
    pool.load(b, second.cache, defer=True)
    pool.flush()
    for storage, source in zip(pool.layers, second.cache.layers):
        n = source.n
        for row in (a, b):
            assert torch.equal(storage.positions[row, :, :n], source.positions[0, :, :n])
            assert torch.equal(storage.keys[row, :, :n], source.keys[0, :, :n])
    assert pool.lengths[:, b].tolist() == [layer.n for layer in second.cache.layers]
    for layer in second.cache.layers:  # a state's buffers in other dtypes are cast, as a copy casts
        layer.positions = layer.positions.int()
    pool.load(a, second.cache)
    for storage, source in zip(pool.layers, second.cache.layers):
        assert storage.positions.dtype == torch.long
        assert torch.equal(storage.positions[a, :, : source.n], source.positions[0, :, : source.n].long())


def test_shared_document_lru_keeps_documents_with_readers(model, one_thread):
    """Two document rows, three documents: a document whose readers ended leaves for a new one (least recently
    used first); while both rows have readers, a reader of a third gets its own copy ("full")."""
    method = kvpot.Full(chunk_size=64)
    engine = kvpot.Engine(model, method=method, decode="eager")
    g = torch.Generator().manual_seed(5)
    states = [engine.prefill_ids(torch.randint(3, VOCAB, (n,), generator=g).tolist()) for n in (40, 50, 60)]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=3, capacity=128, decode="static",
                          share_documents=True, documents=2)
    region = scheduler.pool.documents
    assert isinstance(region, DocumentRegion) and region.rows == 2
    first = [scheduler.submit(Request(None, [5, 6], state=s, max_new_tokens=4, ignore_eos=True)) for s in states]
    scheduler.step()
    assert region.documents == 2 and region.readers == 2 and scheduler.report["copy_on_write_full"] == 1
    scheduler.run()
    assert all(r.status == "finished" for r in first) and region.readers == 0
    loaded = [d.state() for d in region.loaded.values()]
    assert loaded == states[:2]  # both kept loaded after their readers ended (least recent first)
    scheduler.submit(Request(None, [7], state=states[2], max_new_tokens=4, ignore_eos=True))
    scheduler.step()
    assert [d.state() for d in region.loaded.values()] == [states[1], states[2]]  # the oldest left
    assert region.loaded[id(states[2])].row == 0  # and its row was reused
    scheduler.run()
    scheduler.submit(Request(None, [8, 9], state=states[1], max_new_tokens=4, ignore_eos=True))
    scheduler.step()
    assert scheduler.report["document_loads"] == 3  # a loaded document is read again without a load
    scheduler.run()


def test_shared_document_copy_reasons_follow_the_step_plan(model, context):
    """Why a reader copies before a step: `copy_reason` over the plans a method gives (the scheduler copies
    exactly when it is not None)."""
    method = kvpot.Full(chunk_size=64)
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=2, capacity=256, decode="static",
                          share_documents=True)
    cache = scheduler.pool.cache(0)
    assert copy_reason(scheduler, cache, "append") is None
    assert copy_reason(scheduler, cache, "steady") == "steady"
    assert copy_reason(scheduler, cache, "eager") == "eager"
    extend = Scheduler(kvpot.Engine(model, method=kvpot.SelfExtend(group_size=4, window=16)), slots=1, capacity=256,
                       decode="static", share_documents=True)
    assert copy_reason(extend, extend.pool.cache(0), "append") == "positions"  # renumbers entries while decoding


def test_shared_document_refusals(model, monkeypatch):
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=64))
    with pytest.raises(KvpotError, match="documents"):
        Scheduler(engine, slots=2, capacity=64, decode="static", share_documents=True, documents=0)
    with monkeypatch.context() as patch:  # where mix="auto" mixes (a CUDA GPU), shared documents' pools mix too
        real = scheduler_module.resolve_mix
        patch.setattr(kvpot.kernels, "available", lambda device: True)
        patch.setattr(kvpot.kernels, "supports_head_dim", lambda head_dim: True)  # the tiny model's 16
        patch.setattr(scheduler_module, "resolve_mix", lambda mix, _, *args, **kw: real(mix, torch.device("cuda"),
                                                                                          *args, **kw))
        shared = Scheduler(engine, slots=2, capacity=64, decode="static", share_documents=True)
        assert shared.mix is True and shared.pool.documents is not None
        apart = Scheduler(engine, slots=2, capacity=64, decode="static", share_documents=True, mix="off")
        assert apart.mix is False and apart.pool.documents is not None  # asked for: apart
        assert Scheduler(engine, slots=2, capacity=64, decode="static").mix is True
    plain = Scheduler(engine, slots=2, capacity=64, decode="static")
    assert plain.pool.documents is None and "copy_on_write" not in plain.report  # the default path: untouched


def test_shared_document_generate_batch_answers_questions_of_one_state(one_thread):
    """`Engine.generate_batch(states=..., share_documents=True)`: the texts of the copy-per-reader path."""
    engine = kvpot.Engine.from_pretrained(kvpot.REFERENCE_MODEL, method=kvpot.InfiniPot(pot_size=256))
    state = engine.prefill("The vault code is 4417. The harbour code is 9021. " * 8)
    questions = ["What is the vault code?", "What is the harbour code?", "Which codes are there?"]
    copied = engine.generate_batch(questions=questions, states=[state] * 3, max_new_tokens=10)
    shared = engine.generate_batch(questions=questions, states=[state] * 3, max_new_tokens=10, share_documents=True)
    # tail slots: 3 slots of 128 lanes hold one whole 256-entry slot, and the readers' tails
    tails = engine.generate_batch(questions=questions, states=[state] * 3, max_new_tokens=10, share_documents=True,
                                  reader_room=128)
    assert [r.text for r in shared] == [r.text for r in copied] == [r.text for r in tails]
    assert all(r.stats.max_kv_entries <= 256 for r in shared)


@pytest.mark.parametrize("mix", ["auto", "on"])
def test_shared_document_bench_throughput_row_beside_copy_per_reader(capsys, tmp_path, mix):
    """`kvpot bench throughput --document --share-documents`: a shared-document row beside the copy-per-reader
    row, the same output tokens, its scheduler record counting the document and its readers' copies; `--mix`
    reaches the shared row too ("auto" leaves it apart)."""
    import json

    from kvpot.cli import main

    out = tmp_path / "out"
    code = main(["bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out), "--method",
                 "infinipot:pot_size=128", "--users", "3", "--lengths", "96", "--new-tokens", "4",
                 "--question-tokens", "4", "--document", "--share-documents", "--sequential-users", "1", "--mix", mix])
    assert code == 0, capsys.readouterr().err
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    shared, copied = rows["infinipot [batch, shared document]"], rows["infinipot [batch]"]
    assert shared["mix"] is (mix == "on") and copied["mix"] is (mix == "on")  # (auto: off on a CPU anyway)
    assert shared["completed"] == copied["completed"] == 3 and shared["output_tokens"] == copied["output_tokens"] == 12
    record = shared["scheduler"]
    assert record["document_loads"] == 1 and record["copy_on_write"] == 0 and record["shared_readers"] == 0
    assert (record["fed_tokens"] == 0) == (mix == "on")  # mixing: the questions read as chunks over the region
    assert shared["pool_bytes"] > copied["pool_bytes"]  # the document region, counted once beside the slots
    assert "copy_on_write" not in copied["scheduler"]
    code = main(["bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out), "--method", "full",
                 "--share-documents"])
    assert code == 2 and "give --document" in capsys.readouterr().err  # sharing needs a stored document


@pytest.mark.parametrize("mix, room", [("auto", None), ("on", None), ("on", 512)], ids=["auto", "on", "on-tail-slots"])
def test_shared_document_serve_readers_of_an_uploaded_document(tmp_path, mix, room):
    """`kvpot serve --share-documents`: questions about one uploaded document (POST /v1/documents), asked at once,
    read it from one copy; /metrics shows the document, its readers and no copy (InfiniPot's pot never fills).
    With `--mix on` the pool mixes (a fresh prompt asked beside the readers is read in their forward); with
    `--reader-room` the readers hold tail slots."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from serve_process import MODEL, PASSKEY, QUESTION, Server

    server = Server(tmp_path / "states", "--share-documents", "--max-slots", "4", "--mix", mix,
                    *(["--reader-room", str(room)] if room else []))
    try:
        pools = server.http("GET", "/health").json()["pools"]
        assert [pool["mix"] for pool in pools] == [mix == "on"]  # "auto" leaves shared documents' readers apart
        assert [pool["reader_room"] for pool in pools] == [room]
        created = server.http("POST", "/v1/documents", json={"text": PASSKEY * 4})
        assert created.status_code == 200, created.text
        document = created.json()["id"]
        client = server.client()

        decoding = threading.Event()  # set at the first reader's first streamed token

        def ask(_):  # streamed: the fresh prompt below is asked once the readers decode
            stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                    max_tokens=48, temperature=0, stream=True,
                                                    extra_body={"document_id": document})
            text = ""
            for chunk in stream:
                decoding.set()
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            return text

        def fresh():  # the passkey in a prompt of its own, read while the readers decode (not the document's text,
            # which the server would find stored and answer from: a reader whose question is read apart)
            assert decoding.wait(60)
            out = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
                {"role": "user", "content": PASSKEY * 3 + "\n" + QUESTION}])
            return out.choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            other = pool.submit(fresh)
            answers = list(pool.map(ask, range(3)))
        assert answers.count(answers[0]) == 3 and "12345" in answers[0]
        assert "12345" in other.result()
        # its prompt in the readers' forward where mixing is asked for, apart otherwise
        assert (server.metric("mixed_forwards_total") > 0) == (mix == "on")
        assert server.metric("shared_documents") == 1 and server.metric("shared_document_readers") == 0
        shared = server.http("GET", "/health").json()["pools"][0]["shared"]
        assert server.metric("copy_on_write_total") == 0, {k: v for k, v in shared.items() if v}
        assert shared["tail_slot_readers"] == (3 if room else 0)
    finally:
        server.stop()


@pytest.mark.parametrize("mix", ["auto", "on", "packed"])
def test_shared_document_readers_beside_fresh_prompts_and_a_cancellation(model, context, mix, one_thread,
                                                                          monkeypatch):
    """Fresh prompts decode beside a document's readers (their rows read no document); a reader cancelled
    mid-answer drops its reference at once, and the others keep the tokens they get alone. With mix="on" the
    fresh prompts' chunks are read in the readers' forward (their rows attending the shared document there), and
    a reader whose pot fills copies its document, then rides in that forward as a one-token chunk. "packed": the
    same in the fixed-shape mixed step a GPU captures (`kvpot.engine.packed`; uncaptured here)."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(context)
    g = torch.Generator().manual_seed(9)
    fresh = [(torch.randint(3, VOCAB, (n,), generator=g).tolist(), [7, 8]) for n in (50, 90)]
    expected = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True).token_ids
                for q in QUESTIONS[:3]]
    expected += [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True).token_ids for c, q in fresh]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=6, decode="static", share_documents=True,
                          mix="on" if mix == "packed" else mix)
    scheduler.decoder.fixed_mix = mix == "packed" or scheduler.decoder.fixed_mix
    sharing = []  # each mixed forward: the readers of the shared document in it
    forward = scheduler_module.mixed_forward
    monkeypatch.setattr(scheduler_module, "mixed_forward",
                        lambda decoder, slots, *a: sharing.append(sum(scheduler.pool.documents.shares(s) for s in slots))
                        or forward(decoder, slots, *a))
    readers_ = [scheduler.submit(Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True))
                for q in QUESTIONS[:4]]
    others = [scheduler.submit(Request(c, q, max_new_tokens=NEW, ignore_eos=True)) for c, q in fresh]
    for _ in range(3):
        scheduler.step()
    region = scheduler.pool.documents
    before = region.readers
    assert before >= 1 and readers_[3].slot in region.reading
    scheduler.cancel(readers_[3])
    scheduler.step()
    assert readers_[3].status == "cancelled" and region.readers == before - 1
    scheduler.run()
    assert [r.tokens for r in readers_[:3] + others] == expected
    assert region.readers == 0 and scheduler.pool.used == 0
    report = scheduler.report
    assert report["document_loads"] == 1
    if mix != "auto":  # chunks beside the readers' rows, and the riders (copied first: nothing reads a slot's zeros)
        assert report["mixed_forwards"] == len(sharing) > 0 and report["riding_rows"] > 0
        packed = scheduler.decoder.packed
        assert (packed is not None and packed.steps > 0) == (mix == "packed" or scheduler.decoder.fixed_mix)
        assert max(sharing) >= 2  # readers' rows read the region inside mixed forwards
        assert 0 < report["copy_on_write_eager"] <= report["riding_rows"]  # (fresh prompts' pots fill and ride too)
    else:
        assert report["mixed_forwards"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("room", [None, 32], ids=["whole-slots", "tail-slots"])
def test_shared_document_captured_packed_steps_beside_readers_on_cuda(room):
    """On a GPU, fresh prompts read in captured packed steps beside readers of a shared document (float32, the
    Triton kernels: head dim 32): every request gets its tokens alone, the readers' rows read the region inside
    replayed steps, and readers whose pot fills copy their document, then ride. With tail slots
    (`reader_room`) too: the kernels read the arena's overlapping views."""
    from conftest import build_llama

    model = build_llama(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    engine = kvpot.Engine(model, method=method, decode="eager")
    context = torch.randint(3, VOCAB, (120,), generator=torch.Generator().manual_seed(3)).tolist()
    state = engine.prefill_ids(context)
    g = torch.Generator().manual_seed(9)
    fresh = [(torch.randint(3, VOCAB, (n,), generator=g).tolist(), [7, 8]) for n in (50, 90, 130)]
    expected = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True).token_ids
                for q in QUESTIONS]
    expected += [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True).token_ids for c, q in fresh]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=7, decode="graph", share_documents=True, mix="on",
                          prefill_tokens=32, reader_room=room)
    assert (scheduler.pool.lanes is not None) == (room is not None)
    requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS]
    requests += [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in fresh]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    packed, report = scheduler.decoder.packed, scheduler.report
    assert packed is not None and packed.steps > 0 and packed.graphs.replays > 0
    assert report["document_loads"] == 1 and report["riding_rows"] > 0
    assert report["fed_tokens"] == 0 and report["copy_on_write_question"] == 0  # questions read as chunks, shared
