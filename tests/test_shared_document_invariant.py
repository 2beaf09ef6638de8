"""Batch-invariant sharing: readers of a shared document under `Engine(batch_invariant=True)` (a joined region,
`kvpot.engine.documents.DocumentRegion.join`).

A joined reader reads its document's entries where they are (the region's row) and its own from its slot, through the
decode kernel at its fixed splits and through its question's forward, loading and rotating each entry as a copy of
it would be: its sums are then a copied reader's, bit for bit. Checked here: the kernel and its reference against
themselves over the same entries copied into each slot (named shapes, tail slots, and on CUDA long bf16 shapes), and
every method's readers through the scheduler against copied readers and the one-sequence engine. `pytest -k
shared_document` selects these too.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, interpreter_runtime_loops, needs_kernels
from test_batch import methods
import test_shared_document
from test_shared_document import NEW, QUESTIONS, SHARED_SHAPES, shared_inputs

import kvpot
from kvpot.engine.offline import run_all
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.kernels.decode_reference import decode_attention_batch_reference

interpreter_runtime_loops()


def both(kernel, shape, rope: bool, device="cpu", dtype=torch.float32, tails: int | None = None, **options):
    """`kernel` over the copied slots, and over the slots with the region (`documents`) beside them."""
    shared, copied, rope_args, (key_positions, doc_positions, copied_positions) = shared_inputs(shape, rope)

    def to(t):
        t = t.to(device)
        return t.to(dtype) if t.is_floating_point() and t.dim() > 1 and t.shape[-1] == shape[3] else t

    query, keys, values, rows, lengths, doc_keys, doc_values, doc_rows, doc_lengths = (to(t) for t in shared)
    rope_args = {k: v.to(device) for k, v in rope_args.items()}
    if tails is not None:  # each reader's tail in a tail slot of that stride (`kvpot.engine.pool.arena_view`)
        from test_shared_document_kernel import in_tails

        keys, values = (in_tails(t, doc_rows, lengths, shape[5], tails) for t in (keys, values))
    copy_positions = dict(key_positions=copied_positions.to(device)) if rope else {}
    expected = kernel(*(to(t) for t in copied), 0.125, **rope_args, **copy_positions, **options)
    documents = (doc_keys, doc_values, doc_positions.to(device) if rope else None, doc_rows, doc_lengths)
    out = kernel(query, keys, values, rows, lengths, 0.125, **rope_args,
                 **(dict(key_positions=key_positions.to(device)) if rope else {}), documents=documents, **options)
    return out, expected


@pytest.mark.parametrize("rope", [True, False], ids=["rope-on-load", "pre-rotated"])
@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=[s[0] for s in SHARED_SHAPES])
def test_shared_document_invariant_reference_reads_the_region_as_a_copy(shape, rope):
    out, expected = both(decode_attention_batch_reference, shape, rope)
    assert torch.isfinite(out).all() and torch.equal(out, expected)


@needs_kernels()
@pytest.mark.parametrize("split_entries", [64, None], ids=["fixed-splits", "batch-splits"])
@pytest.mark.parametrize("rope", [True, False], ids=["rope-on-load", "pre-rotated"])
@pytest.mark.parametrize("shape", SHARED_SHAPES, ids=[s[0] for s in SHARED_SHAPES])
def test_shared_document_invariant_kernel_gives_the_copied_sums_bit_for_bit(shape, rope, split_entries):
    from kvpot.kernels.decode import decode_attention_batch

    out, expected = both(decode_attention_batch, shape, rope, KERNEL_DEVICE, split_entries=split_entries)
    assert torch.isfinite(out).all() and torch.equal(out, expected)
    reference, _ = both(decode_attention_batch_reference, shape, rope)
    torch.testing.assert_close(out.cpu(), reference, atol=2e-5, rtol=1e-5)


@needs_kernels()
@pytest.mark.parametrize("stride", [16, 40])
def test_shared_document_invariant_kernel_reads_tail_slots(stride):
    """Readers in tail slots (their lanes overlap other slots'; every lane they do not hold is NaN)."""
    from kvpot.kernels.decode import decode_attention_batch

    shape = SHARED_SHAPES[1]  # one document, every slot a reader
    out, expected = both(decode_attention_batch, shape, True, KERNEL_DEVICE, tails=stride, split_entries=64)
    assert torch.isfinite(out).all() and torch.equal(out, expected)


@needs_kernels()
def test_shared_document_invariant_kernel_writes_the_copied_observation():
    from kvpot.kernels.decode import decode_attention_batch

    shape = SHARED_SHAPES[0]
    batch, kv, capacity = len(shape[7]), shape[2], shape[4]
    probs = [torch.zeros(batch, kv, capacity, device=KERNEL_DEVICE) for _ in range(2)]
    calls = iter(probs)
    out, expected = both(lambda *a, **k: decode_attention_batch(*a, probs=next(calls), **k), shape, True,
                         KERNEL_DEVICE, split_entries=64)
    assert torch.equal(out, expected) and torch.equal(probs[0], probs[1]) and probs[0].sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_shared_document_invariant_kernel_on_long_bf16_documents(dtype):
    from test_shared_document_kernel import LONG_SHAPES

    from kvpot.kernels.decode import decode_attention_batch

    for shape in LONG_SHAPES:
        for split_entries in (512, None):
            out, expected = both(decode_attention_batch, shape, True, "cuda", dtype, split_entries=split_entries)
            assert torch.isfinite(out).all() and torch.equal(out, expected), (shape[0], split_entries)


# ---------------------------------------------------------------------- through the scheduler
model, context = test_shared_document.model, test_shared_document.context  # the fixtures: its model and document


def invariant_readers(model, method, capacity, state, share: bool, **options):
    scheduler = Scheduler(kvpot.Engine(model, method=method, batch_invariant=True), slots=3, capacity=capacity,
                          decode="static", share_documents=share, **options)
    requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS]
    run_all(scheduler, requests)
    return scheduler, requests


# the methods that share under invariance (appending questions), one that copies at admission, one that attends itself
INVARIANT = [n for n, (m, _) in sorted(methods().items()) if m.copies_document != "at_admission"] + ["h2o", "infllm"]


@pytest.mark.parametrize("name", INVARIANT)
def test_shared_document_invariant_readers_get_the_copied_tokens(model, context, name, one_thread):
    """Joined readers get the copied readers' tokens and the one-sequence engine's; a question that only appends is
    read apart over the region without copying the document (the default path copies it: it reads no question apart)."""
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method, decode="eager", batch_invariant=True)
    state = engine.prefill_ids(context, [4, 5] if name == "infinipot-question" else None)
    alone = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS]
    _, copied = invariant_readers(model, method, capacity, state, share=False)
    scheduler, shared = invariant_readers(model, method, capacity, state, share=True)
    assert [r.tokens for r in shared] == [r.tokens for r in copied] == [a.token_ids for a in alone]
    report, region = scheduler.report, scheduler.pool.documents
    assert region.joined and not region.rotated and report["fed_tokens"] == 0 and report["mixed_forwards"] == 0
    apart = [method.chunk_appends(state.cache, len(q)) and state.cache.attention is None for q in QUESTIONS]
    assert report["copy_on_write_question"] == len(QUESTIONS) - sum(apart)
    assert report["document_loads"] == (1 if any(apart) else 0)
    filled = sum(a.stats.compressions > state.stats.compressions for a, joined in zip(alone, apart) if joined)
    assert report["copy_on_write_eager"] + report["copy_on_write_steady"] == filled


def test_shared_document_invariant_readers_leave_their_slots_empty_below_the_tail(model, context, one_thread):
    """While joined, a reader's slot holds none of the document's keys, in a whole slot or a tail slot, and its
    question's forward attends the document where it is."""
    method = kvpot.Full(chunk_size=64)
    state = kvpot.Engine(model, method=method, decode="eager").prefill_ids(context)
    for room in (None, 32):
        scheduler = Scheduler(kvpot.Engine(model, method=method, batch_invariant=True), slots=8, capacity=256,
                              decode="static", share_documents=True, reader_room=room)
        requests = [scheduler.submit(Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True))
                    for q in QUESTIONS]
        for _ in range(3):  # admitted, questions read apart, decoding
            scheduler.step()
        region, n = scheduler.pool.documents, state.cache.layers[0].n
        assert region.readers == 4 and scheduler.report["copy_on_write"] == 0
        assert scheduler.report["tail_slot_readers"] == (4 if room else 0)
        if room is None:
            for layer in scheduler.pool.layers:
                assert not layer.keys[:4, :, :n].any()  # nothing copied into the slots
        assert all(layer.document is not None for layer in scheduler.pool.caches[0].layers)
        scheduler.run()
        assert all(len(r.tokens) == NEW for r in requests) and region.readers == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["infinipot", "full"])
def test_shared_document_invariant_bf16_readers_get_the_copied_tokens_on_cuda(name):
    """bf16 with the Triton kernels and captured steps: joined readers' tokens are the copied readers', token for
    token (the default cascade path gives the same tokens in float32 only)."""
    from conftest import VOCAB, build

    method, capacity = methods()[name]
    model = build("llama3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2).to("cuda", torch.bfloat16)
    torch.manual_seed(11)
    context = torch.randint(3, VOCAB, (600,)).cuda()
    state = kvpot.Engine(model, method=method, batch_invariant=True).prefill_ids(context)
    questions = [torch.randint(3, VOCAB, (k,)).tolist() for k in (3, 6, 2, 5, 7, 4)]
    tokens = {}
    for share in (False, True):
        scheduler = Scheduler(kvpot.Engine(model, method=method, batch_invariant=True), slots=6, capacity=capacity and
                              1024, decode="graph", share_documents=share)
        requests = [Request(None, q, state=state, max_new_tokens=32, ignore_eos=True) for q in questions]
        run_all(scheduler, requests)
        tokens[share] = [r.tokens for r in requests]
    assert tokens[True] == tokens[False]
    assert scheduler.report["document_loads"] == 1 and scheduler.report["copy_on_write_question"] == 0
