"""Tail slots (`Scheduler(share_documents=True, reader_room=...)`, `kvpot.engine.pool`): a reader of a shared document
that never copies it holds only its tail's lanes of one arena, not a whole slot.

Checked: the arena's bookkeeping (`Lanes`: no two slots hold one lane, a whole slot waits for its lanes, widening);
every sharing method's readers get the tokens of the copy-per-reader path and of the one-sequence engine with tail
slots (fed questions, and questions read as chunks), readers whose pot would fill hold whole slots, fresh prompts run
beside tail readers, and the pool's bytes follow the arena's lanes. `pytest -k shared_document` selects all.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from test_batch import methods
import test_shared_document

import kvpot
from kvpot.engine.documents import reader_lanes
from kvpot.engine.offline import run_all
from kvpot.engine.pool import Lanes, SlotPool, arena_view
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.errors import KvpotError
from kvpot.positions import make_policy

NEW = 20
ROOM = 32  # a reader's own entries: its question (at most 6 tokens here) and NEW new ones
QUESTIONS = [torch.randint(3, VOCAB, (k,), generator=torch.Generator().manual_seed(k)).tolist() for k in (3, 6, 2, 5)]
model, context = test_shared_document.model, test_shared_document.context  # the fixtures: its model and document
SHARING = [name for name, (method, _) in sorted(methods().items()) if method.copies_document != "at_admission"]


def held_apart(pool) -> bool:
    """No two slots (the scratch slot included) hold one lane of the arena."""
    lanes, seen = pool.lanes, set()
    for slot, (lo, hi) in lanes.held.items():
        span = set(range(slot * lanes.stride + lo, slot * lanes.stride + hi))
        if seen & span:
            return False
        seen |= span
    return True


# ---------------------------------------------------------------------- the arena
def test_shared_document_tail_arena_views_overlap_by_the_stride():
    view = arena_view(4, 2, 10, 3, 4, torch.float32, torch.device("cpu"))
    assert view.shape == (4, 2, 10, 3) and view.untyped_storage().nbytes() == 2 * (3 * 4 + 10) * 3 * 4
    view[1, :, 4] = 7.0  # slot 1's lane 4 is slot 2's lane 0
    assert (view[2, :, 0] == 7.0).all() and (view[0, :, 8] == 7.0).all()


def test_shared_document_tail_lanes_keep_slots_apart():
    lanes = Lanes(slots=4, capacity=12, stride=4)
    assert lanes.held == {4: (0, 12)}  # the scratch slot's whole slot
    assert lanes.free(0, 8, 12)
    lanes.hold(0, 8, 12)  # slot 0's tail: arena lanes 8..12, slot 1's 4..8 and slot 2's 0..4
    assert not lanes.free(1, 4, 8) and lanes.free(1, 8, 12) and not lanes.free(2, 0, 1)
    lanes.hold(1, 0, 4)  # arena 4..8: inside slot 0's whole slot
    assert not lanes.widen(0)
    assert lanes.held[0] == (8, 12)
    lanes.drop(1)
    assert lanes.widen(0) and lanes.held[0] == (0, 12)
    lanes.drop(0)
    assert lanes.held == {4: (0, 12)} and lanes.free(0, 0, 12)


def test_shared_document_tail_pool_acquires_the_lowest_slot_whose_lanes_are_free(model):
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=64))
    pool = SlotPool(model.config, engine.rope, make_policy(engine.method.positions), 10, 16, torch.float32,
                    torch.device("cpu"), stride=4)  # an arena of 10 * 4 + 16 lanes; the scratch slot holds 40..56
    assert pool.acquire(12, 16) == 0 and pool.acquire(12, 16) == 1  # arena 12..16 and 16..20
    assert pool.acquire() == 5  # a whole slot: slot 5's 0..16 is arena 20..36
    assert pool.acquire() is None  # no other whole slot ends before the scratch slot's lanes
    assert pool.acquire(12, 16) == 6 and held_apart(pool)  # slots 2..4's 12..16 lie in slot 5's
    with pytest.raises(KvpotError, match="tail slot"):
        pool.widen(1)  # slot 1's whole slot is arena 4..20: slot 0's tail is there
    pool.release(0)
    pool.widen(1)
    assert pool.lanes.held[1] == (0, 16) and held_apart(pool)
    with pytest.raises(KvpotError, match="stride"):
        SlotPool(model.config, engine.rope, make_policy(engine.method.positions), 2, 16, torch.float32,
                 torch.device("cpu"), stride=0)


# ---------------------------------------------------------------------- through the scheduler
def readers(model, method, capacity, state, room, slots=8, questions=QUESTIONS, new=NEW, **options):
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=slots, capacity=capacity, decode="static",
                          share_documents=True, reader_room=room, **options)
    requests = [Request(None, q, state=state, max_new_tokens=new, ignore_eos=True) for q in questions]
    placed = {}
    original = scheduler.pool.acquire

    def acquire(lo=0, hi=None):  # each request's lanes as placed, and the arena apart at every admission
        slot = original(lo, hi)
        if slot is not None:
            placed[slot] = placed.get(slot, []) + [scheduler.pool.lanes.held[slot]]
            assert held_apart(scheduler.pool)
        return slot

    scheduler.pool.acquire = acquire
    run_all(scheduler, requests)
    return scheduler, requests, placed


@pytest.mark.parametrize("mix", ["off", "on"])  # questions fed, or read as chunks of the mixed step
@pytest.mark.parametrize("name", SHARING)
def test_shared_document_tail_readers_get_the_copy_per_reader_tokens(model, context, name, mix, one_thread):
    """Every method that shares a document while decoding: readers in tail slots get the tokens of readers with a
    copy each and of the one-sequence engine; a reader is given a tail exactly where it never copies."""
    method, capacity = methods()[name]
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(context, [4, 5] if name == "infinipot-question" else None)
    alone = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS]
    copied = Scheduler(kvpot.Engine(model, method=method), slots=4, capacity=capacity, decode="static", mix=mix)
    copies = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS]
    run_all(copied, copies)
    scheduler, shared, placed = readers(model, method, capacity, state, ROOM, mix=mix)
    assert [r.tokens for r in shared] == [r.tokens for r in copies] == [a.token_ids for a in alone]
    assert all(r.status == "finished" for r in shared)
    report, doc = scheduler.report, min(layer.n for layer in state.cache.layers)
    filled = sum(a.stats.compressions > state.stats.compressions for a in alone)
    assert report["copy_on_write"] == filled  # the readers whose pot filled, each in a whole slot
    whole = sum(held == (0, scheduler.capacity) for holds in placed.values() for held in holds)
    assert whole == filled and len(placed) >= 1
    assert report["tail_slot_readers"] == len(QUESTIONS) - filled
    for holds in placed.values():
        for lo, hi in holds:
            assert (lo, hi) == (0, scheduler.capacity) or lo == doc and hi - lo <= ROOM + 64
    assert scheduler.pool.lanes.held == {scheduler.pool.slots: (0, scheduler.capacity)}  # every lane given back


def test_shared_document_tail_readers_wait_for_lanes_and_a_whole_slot_for_its_own(model, context, one_thread):
    """More readers than the arena's lanes hold, and fresh prompts (whole slots) among them: every request ends
    with the one-sequence engine's tokens (the arena holds one whole slot at a time beside readers' tails)."""
    method = kvpot.Full(chunk_size=64)
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(context)
    fresh = [(context[:50], [7, 8]), (context[30:90], [9])]
    expected = [engine.generate_ids(question_ids=q, state=state, max_new_tokens=NEW, ignore_eos=True).token_ids
                for q in QUESTIONS * 2]
    expected += [engine.generate_ids(c, q, max_new_tokens=NEW, ignore_eos=True).token_ids for c, q in fresh]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=8, capacity=192, decode="static",
                          share_documents=True, reader_room=ROOM, mix="on")
    requests = [Request(None, q, state=state, max_new_tokens=NEW, ignore_eos=True) for q in QUESTIONS * 2]
    requests += [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in fresh]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == expected
    assert scheduler.report["copy_on_write"] == 0 and scheduler.report["document_loads"] == 1


def test_shared_document_tail_lanes_follow_the_reader(model, context):
    """`reader_lanes`: a tail `[n_doc, n_doc + question + new tokens)` where the reader shares to its end; the whole
    slot for a fresh prompt, a question read in a forward of its own, or a pot that fills."""
    method = kvpot.InfiniPot(pot_size=64, catalyst=None)
    engine = kvpot.Engine(model, method=method, decode="eager")
    state = engine.prefill_ids(context)
    n = state.cache.layers[0].n
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=4, decode="static", share_documents=True,
                          reader_room=ROOM, mix="on")
    assert reader_lanes(scheduler, Request(None, [5, 6], state=state, max_new_tokens=3)) == (n, n + 5)
    assert reader_lanes(scheduler, Request(None, [5, 6], state=state, max_new_tokens=64 - n)) == (0, None)  # fills
    assert reader_lanes(scheduler, Request(context[:20], [5], max_new_tokens=3)) == (0, None)  # a fresh prompt
    assert reader_lanes(scheduler, Request(None, None, state=state, max_new_tokens=3)) == (0, None)  # no question
    plain = Scheduler(kvpot.Engine(model, method=method), slots=4, decode="static", share_documents=True)
    assert plain.pool.lanes is None and reader_lanes(plain, Request(None, [5], state=state)) == (0, None)


def test_shared_document_tail_pool_bytes_follow_the_lanes(model, context):
    method = kvpot.Full(chunk_size=64)
    whole = Scheduler(kvpot.Engine(model, method=method), slots=8, capacity=192, decode="static",
                      share_documents=True)
    tails = Scheduler(kvpot.Engine(model, method=method), slots=8, capacity=192, decode="static",
                      share_documents=True, reader_room=ROOM)
    layer, kv_lanes = tails.pool.layers[0], 8 * ROOM + 192  # 8 readers' strides and the scratch slot
    per_lane = 2 * layer.kv_heads * layer.head_dim * 4
    assert whole.pool.layers[0].nbytes - layer.nbytes == (9 * 192 - kv_lanes) * per_lane
    assert tails.slot_bytes() < whole.slot_bytes()


def test_shared_document_tail_refusals(model):
    engine = kvpot.Engine(model, method=kvpot.Full(chunk_size=64))
    with pytest.raises(KvpotError, match="share_documents"):
        Scheduler(engine, slots=2, capacity=64, decode="static", reader_room=16)
    with pytest.raises(KvpotError, match="reader_room"):
        Scheduler(engine, slots=2, capacity=64, decode="static", share_documents=True, reader_room=0)
    # a room as wide as a slot, or slots whose lanes hold no whole slot: whole slots, apart as without tails
    for slots, room in ((2, 64), (3, 16)):
        scheduler = Scheduler(engine, slots=slots, capacity=64, decode="static", share_documents=True, reader_room=room)
        assert scheduler.pool.lanes is None and scheduler.pool.stride is None
        assert scheduler.slot_bytes() == Scheduler(engine, slots=slots, capacity=64, decode="static").slot_bytes()


def test_shared_document_tail_bench_throughput_row(capsys, tmp_path):
    """`kvpot bench throughput --document --share-documents --reader-room N`: the shared row's readers hold tail
    slots, with the copy-per-reader row's output tokens and a smaller pool; `--reader-room` alone is refused."""
    import json

    from kvpot.cli import main

    out = tmp_path / "out"
    argv = ["bench", "throughput", "--shape", "tiny", "--device", "cpu", "--out", str(out), "--method",
            "infinipot:pot_size=128", "--users", "3", "--lengths", "96", "--new-tokens", "4", "--question-tokens", "4",
            "--document", "--sequential-users", "1", "--mix", "on"]
    assert main([*argv, "--share-documents", "--reader-room", "16"]) == 0, capsys.readouterr().err
    rows = {row["method"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    shared, copied = rows["infinipot [batch, shared document]"], rows["infinipot [batch]"]
    assert shared["completed"] == copied["completed"] == 3 and shared["output_tokens"] == copied["output_tokens"] == 12
    assert shared["scheduler"]["copy_on_write"] == 0 and shared["scheduler"]["document_loads"] == 1
    assert shared["scheduler"]["tail_slot_readers"] == 3  # every reader (the warm-up reads fresh prompts only)
    assert shared["slot_bytes"] < copied["slot_bytes"]
    assert main([*argv, "--reader-room", "16"]) == 2 and "--share-documents" in capsys.readouterr().err
