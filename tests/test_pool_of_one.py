"""A pool of one slot has no scratch row (`SlotPool(scratch=False)`, the default for one slot).

Its one bucket never pads, so a scratch row would only double a growing cache's memory. What used the scratch slot
in a larger pool must still hold without it: the steady rows' eviction inside the step (the one row is steady, or the
step appends only), a rider read in a mixed forward (eager there: no packed step's padding), and the warm-ups of the
captures ahead, which run on the slot itself while it is free.
"""

from __future__ import annotations

import pytest
import torch

import kvpot
import kvpot.engine.batch as batch_module
from kvpot.engine.offline import run_all
from kvpot.engine.pool import SlotPool
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.errors import KvpotError
from kvpot.positions import make_policy
from conftest import VOCAB, build
from test_batch import LENGTHS, NEW, alone, methods


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(4)  # (test_batch's prompts, another draw)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (4,)).tolist()) for n in LENGTHS[:3]]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model(request):
    return build(request.param)


def one_slot(model, method, prompts, capacity, mix=False, decode="static"):
    """The prompts through a scheduler of one slot, one after another (the slot reused)."""
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=1, capacity=capacity, decode=decode, mix=mix)
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize("name", sorted(methods()))
def test_a_pool_of_one_has_no_scratch_row_and_gives_each_request_its_tokens_alone(model, prompts, name, one_thread,
                                                                                    monkeypatch):
    method, capacity = methods()[name]
    chosen = prompts[:3]
    expected = alone(model, method, chosen)
    inside = []
    original = batch_module.evict_in_step
    monkeypatch.setattr(batch_module, "evict_in_step", lambda *a: inside.append(a[1].scratch) or original(*a))
    scheduler, requests = one_slot(model, method, chosen, capacity)
    pool = scheduler.pool
    assert pool.scratch is None and pool.rows == 1
    assert all(layer.keys.shape[0] == 1 for layer in pool.layers) and pool.lengths.shape[1] == 1
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    for key in ("max_kv_entries", "final_kv_entries", "compressions"):
        assert [getattr(r.stats, key) for r in requests] == [getattr(e.stats, key) for e in expected], key
    assert scheduler.pool.used == 0 and scheduler.idle
    if name in ("streaming", "h2o", "tova", "roco"):  # the one row, steady, steps as one sequence (its eviction
        assert not inside and scheduler.report["sequence_rows"] > 0  # captured at its counts: `kvpot.engine.alone`)


@pytest.mark.parametrize("name", ["infinipot", "citrus", "streaming", "d2o", "infinitehip"])
def test_a_pool_of_one_mixing_rides_without_padding(model, prompts, name, one_thread):
    """Mixing on, the row whose method reshapes its cache at a token rides in a mixed forward of its own, which runs
    eager (a packed step would pad into the scratch slot)."""
    method, capacity = methods()[name]
    chosen = prompts[:2]
    expected = alone(model, method, chosen)
    scheduler, requests = one_slot(model, method, chosen, capacity, mix=True)
    assert scheduler.pool.scratch is None and not scheduler.decoder.fixed_mix
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]


def test_a_pool_of_one_takes_half_the_memory_of_one_slot_beside_scratch(one_thread):
    llama = build("llama3")
    engine = kvpot.Engine(llama, method=kvpot.Full())
    policy = make_policy(engine.method.positions)

    def pool(scratch):
        made = SlotPool(llama.config, engine.rope, policy, 1, 64, torch.float32, torch.device("cpu"), scratch=scratch)
        return sum(layer.nbytes for layer in made.layers)

    assert 2 * pool(False) == pool(True)


def test_only_a_pool_of_one_goes_without_scratch_and_captures_only_while_free(model, prompts, one_thread):
    engine = kvpot.Engine(model, method=kvpot.StreamingLLM(sinks=4, window=44, chunk_size=16))
    policy = make_policy(engine.method.positions)
    with pytest.raises(KvpotError, match="only a pool of one"):
        SlotPool(model.config, engine.rope, policy, 2, 64, torch.float32, torch.device("cpu"), scratch=False)
    assert SlotPool(model.config, engine.rope, policy, 2, 64, torch.float32, torch.device("cpu")).rows == 3
    scheduler = Scheduler(engine, slots=1, decode="static")
    scheduler.submit(Request(*prompts[0], max_new_tokens=NEW, ignore_eos=True))
    scheduler.step()  # the request takes the slot
    scheduler.decoder.graphs_on = True  # (what a GPU's decoder has: the check comes before any capture)
    with pytest.raises(KvpotError, match="only before a request takes it"):
        scheduler.decoder.capture([None])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["streaming", "h2o", "infinipot", "full", "d2o"])
def test_a_pool_of_one_captured_ahead_gives_each_request_its_tokens_alone_on_cuda(name, prompts):
    """Captured ahead on its own slot (warm-ups write it, then its count goes back to 0), then requests one after
    another through CUDA graphs: the tokens alone, and nothing more captured."""
    llama = build("llama3").cuda()
    method, capacity = methods()[name]
    cuda_prompts = [(torch.tensor(c).cuda(), torch.tensor(q).cuda()) for c, q in prompts[:3]]
    expected = alone(llama, method, cuda_prompts)
    scheduler = Scheduler(kvpot.Engine(llama, method=method), slots=1, capacity=capacity, decode="graph")
    captured = scheduler.capture()
    assert captured > 0 and scheduler.pool.scratch is None
    assert int(scheduler.pool.lengths.abs().sum()) == 0 and int(scheduler.decoder.next_position[0]) == 0
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in cuda_prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert scheduler.decoder.captures == captured and scheduler.decoder.replays > 0
