"""The mixed step in fixed shapes (`kvpot.engine.packed`): the body a CUDA graph replays, run uncaptured on a CPU.

Every request must get the tokens it gets alone (greedy, float32), on two architectures, whichever method's chunks
ride in the packed forward: methods whose chunks observe their attention (H2O every chunk, InfiniPot with its
question as the catalyst probe, SnapKV at the prompt's end), ranked positions (StreamingLLM), score arrays
(H2O, Scissorhands). Steps the packed form does not take (CItruS' instruction cache, Self-Extend's positions, a
method's own attention) fall back to the eager mixed step, with the same tokens.
"""

from __future__ import annotations

import pytest
import torch

import kvpot
from conftest import VOCAB, build
from kvpot.engine.offline import run_all
from kvpot.engine.packed import ROWS, PackedStep, _Meta, token_bucket
from kvpot.engine.scheduler import Request, Scheduler
from test_batch import NEW, alone, methods

PACKED = ["full", "truncate", "streaming", "h2o", "tova", "snapkv", "infinipot", "infinipot-question", "d2o",
          "pyramidkv", "scissorhands", "sirllm", "cam"]
EAGER = ["citrus", "selfextend", "infinitehip"]  # the eager mixed step reads their chunks, or none mixes


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(1)
    lengths = (160, 90, 200, 33, 120)
    return [(torch.randint(3, VOCAB, (n,)).tolist(), torch.randint(3, VOCAB, (5,)).tolist()) for n in lengths]


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def model(request):
    return build(request.param)


def packed_run(model, method, prompts, capacity=None, fixed=True, prefill_tokens=4096):
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="static", mix=True, prefill_tokens=prefill_tokens)
    scheduler.decoder.fixed_mix = fixed
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    return scheduler, requests


@pytest.mark.parametrize("name", PACKED + EAGER)
def test_packed_steps_give_each_request_its_tokens_alone(model, prompts, name, one_thread):
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    scheduler, requests = packed_run(model, method, prompts, capacity)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert [r.stats.max_kv_entries for r in requests] == [e.stats.max_kv_entries for e in expected]
    assert [r.stats.compressions for r in requests] == [e.stats.compressions for e in expected]
    assert scheduler.report["mixed_forwards"] > 0 or name not in PACKED
    packed = scheduler.decoder.packed
    steps = packed.steps if packed is not None else 0
    assert (steps > 0) is (name in PACKED)
    assert scheduler.pool.used == 0 and scheduler.idle


@pytest.mark.parametrize("name", ["h2o", "infinipot-question", "snapkv"])
def test_observing_chunks_take_the_packed_observation(model, prompts, name, one_thread, monkeypatch):
    """Chunks that observe their attention get it from the packed observation (one call a layer for all rows),
    and a small budget spreads the prompts over many packed steps without changing a token."""
    from kvpot.engine import packed as module

    calls, original = [], module.observe_kernel
    monkeypatch.setattr(module, "observe_kernel", lambda *args: calls.append(args) or original(*args))
    method, capacity = methods()[name]
    expected = alone(model, method, prompts)
    scheduler, requests = packed_run(model, method, prompts, capacity, prefill_tokens=48)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    assert calls and scheduler.decoder.packed.steps > 0


def test_token_buckets_are_few_and_cover():
    assert [token_bucket(n) for n in (1, 64, 65, 200, 256, 257, 1088, 2048)] == [64, 64, 128, 256, 256, 512, 1280,
                                                                                 2048]
    sizes = {token_bucket(n) for n in range(1, 4097)}
    assert len(sizes) == 3 + 15  # 64, 128, then 256 .. 4,096 by 256


def test_meta_views_lay_out_one_buffer():
    meta = _Meta(tokens=64, layers=3, device=torch.device("cpu"))
    host = meta.host()
    host.ids[:] = 7
    host.cached[2, ROWS] = 5
    host.mean[-1] = 1
    meta.buffer.copy_(host.buffer)
    assert meta.ids.tolist() == [7] * 64 and meta.cached[2, ROWS] == 5 and meta.mean[-1] == 1
    assert meta.buffer.numel() == 5 * 64 + 5 * ROWS + 1 + 3 * (ROWS + 1)
    assert meta.cached.shape == (3, ROWS + 1) and meta.starts.shape == (ROWS + 1,)


def test_what_the_packed_step_refuses(model, one_thread):
    """More chunks than `ROWS`, or an observation it cannot compute, go to the eager mixed step."""
    from types import SimpleNamespace

    from kvpot.attention import AttentionRequest
    from kvpot.engine.mixed import Chunk

    method, _ = methods()["h2o"]
    scheduler = Scheduler(kvpot.Engine(model, method=method), slots=2, decode="static", mix=True)
    packed = PackedStep(scheduler.decoder)
    chunk = Chunk(SimpleNamespace(cache=scheduler.pool.cache(0)), torch.tensor([1, 2, 3]), None)
    assert packed.takes([chunk], [(None, None)])
    assert packed.takes([chunk], [(None, AttentionRequest(rows=(-2, None), row_reduce="mean"))])
    assert packed.takes([chunk], [((torch.tensor([4, 5]), AttentionRequest(rows=(-2, None))), None)])
    assert not packed.takes([chunk], [(None, AttentionRequest(head_reduce="max"))])
    assert not packed.takes([chunk], [(None, AttentionRequest(head_reduce="none"))])
    assert not packed.takes([chunk], [(None, AttentionRequest(over="cached"))])
    assert not packed.takes([chunk] * (ROWS + 1), [(None, None)] * (ROWS + 1))
    assert not packed.takes([], [])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["full", "streaming", "h2o", "infinipot-question", "snapkv", "d2o", "citrus"])
def test_captured_packed_steps_give_each_request_its_tokens_alone_on_cuda(name):
    """On a GPU the packed step is captured per key and replayed (float32, the Triton kernels: head dim 32), with a
    small prompt budget so that prompts are read over many steps beside the decoding rows."""
    from conftest import build_llama

    method, capacity = methods()[name]
    model = build_llama(head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2).cuda()
    gen = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(3, VOCAB, (n,), generator=gen).cuda(), torch.randint(3, VOCAB, (5,), generator=gen)
                .cuda()) for n in (160, 90, 200, 33, 120)]
    expected = alone(model, method, prompts)
    engine = kvpot.Engine(model, method=method)
    scheduler = Scheduler(engine, slots=3, capacity=capacity, decode="graph", mix=True, prefill_tokens=64)
    requests = [Request(c, q, max_new_tokens=NEW, ignore_eos=True) for c, q in prompts]
    run_all(scheduler, requests)
    assert [r.tokens for r in requests] == [e.token_ids for e in expected]
    packed = scheduler.decoder.packed
    if name == "citrus":  # its instruction cache: the eager mixed step
        assert packed is None or packed.steps == 0
    else:
        assert packed.steps > 0 and packed.graphs.replays > 0
