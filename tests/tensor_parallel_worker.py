"""One rank of the tensor-parallel check (`tests/test_tensor_parallel.py` starts it with torchrun).

Every rank loads the saved tiny model with transformers' tensor-parallel plan (`tp_size` = WORLD_SIZE), runs
every method of `cases()` one sequence at a time and a few through the batched scheduler, and writes what it
got to OUT/rank-R.json. The test computes the same runs in one process and compares. Run alone (no torchrun),
`run(model, ...)` gives the one-process answers from the same code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import kvpot
from kvpot.engine.scheduler import Request, Scheduler
from kvpot.errors import KvpotError

CONTEXT, QUESTION, NEW = 120, 6, 8


def cases() -> dict[str, kvpot.Method]:
    """Every method, sized to compress within CONTEXT tokens; the variants that reduce over KV heads or
    layers (and so gather every rank's scores) each appear."""
    return {
        "full": kvpot.Full(chunk_size=64),
        "truncate": kvpot.Truncate(budget=64, chunk_size=32),
        "streaming": kvpot.StreamingLLM(sinks=4, window=36, chunk_size=32),
        "h2o": kvpot.H2O(heavy=24, recent=16, chunk_size=32),
        "tova": kvpot.TOVA(budget=40, chunk_size=32),  # heads summed: gathered
        "snapkv": kvpot.SnapKV(budget=48, window=8, chunk_size=64),
        "pyramidkv": kvpot.PyramidKV(budget=32, window=8, beta=2, chunk_size=64),
        "infinipot": kvpot.InfiniPot(pot_size=64, catalyst="question"),
        "infinipot-layer": kvpot.InfiniPot(pot_size=64, catalyst="question", share="layer"),  # gathered
        "infinipot-model": kvpot.InfiniPot(pot_size=64, catalyst="question", share="model"),  # gathered
        "citrus-shared": kvpot.CItruS(chunk_size=32, keep=32, cache="shared"),  # layer-wise: gathered
        "citrus-individual": kvpot.CItruS(chunk_size=32, keep=32, cache="individual"),
        "citrus-head": kvpot.CItruS(chunk_size=32, keep=32, selection="head"),
        "d2o": kvpot.D2O(budget=24, chunk_size=64),  # layer budgets from every head's variance: gathered
        "sirllm": kvpot.SirLLM(pot_size=48, compress_size=24, sinks=2),
        "cam": kvpot.CaM(start=4, recent=24, merge_budget=4, chunk_size=32),
        "scissorhands": kvpot.Scissorhands(budget=40, drop=12, history=8, chunk_size=32),
        "roco": kvpot.RoCo(budget=40, chunk_size=32),
        "selfextend": kvpot.SelfExtend(group_size=4, window=16, chunk_size=32),
        "infllm": kvpot.InfLLM(initial=4, window=32, block_size=4, representatives=2, topk=2, lookup=16,
                               chunk_size=32, kernels="torch"),  # unit scores all-reduced
        "infinitehip-head": kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(32, 16, 8), early_keep=16,
                                              query_block=8, chunk_size=64, refresh=(4, 2, 1), selection="head",
                                              kernels="torch"),
        "infinitehip-shared": kvpot.InfiniteHiP(sink=8, window=16, chunks=(32, 8, 2), keep=(32, 16, 8), early_keep=16,
                                                query_block=8, chunk_size=64, refresh=(4, 2, 1), kernels="torch"),
    }


BATCHED = ("streaming", "tova", "h2o", "infinipot", "infinipot-model", "citrus-shared", "d2o")
CORE = ("streaming", "h2o", "infinipot")  # `Engine(runner="core")`: one sequence as a scheduler of one slot's request


def inputs() -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    generator = torch.Generator().manual_seed(11)
    context = torch.randint(3, 200, (CONTEXT,), generator=generator)
    question = torch.randint(3, 200, (QUESTION,), generator=generator)
    contexts = [torch.randint(3, 200, (CONTEXT - 16 * i,), generator=generator).tolist() for i in range(3)]
    return context, question, contexts


def one(model, tokenizer, method: kvpot.Method) -> dict:
    engine = kvpot.Engine(model, tokenizer, method=method)
    context, question, _ = inputs()
    try:
        result = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
        sampled = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True, temperature=0.9,
                                      seed=5)
    except KvpotError as err:
        return {"error": str(err)}
    return {"tokens": result.token_ids, "sampled": sampled.token_ids, "max_kv_entries": result.stats.max_kv_entries}


def core(model, tokenizer, method: kvpot.Method) -> dict:
    """`one`'s greedy generation through the core: every rank submits it to its scheduler of one slot."""
    engine = kvpot.Engine(model, tokenizer, method=method, runner="core")
    context, question, _ = inputs()
    result = engine.generate_ids(context, question, max_new_tokens=NEW, ignore_eos=True)
    return {"tokens": result.token_ids, "runner": result.stats.decode["runner"]}


def batched(model, tokenizer, method: kvpot.Method) -> dict:
    """Three prompts of different lengths (one sampling, seeded) through the scheduler, and one cancelled."""
    engine = kvpot.Engine(model, tokenizer, method=method)
    _, question, contexts = inputs()
    scheduler = Scheduler(engine, slots=2, capacity=256)
    requests = [Request(context_ids=c, question_ids=question.tolist(), max_new_tokens=NEW, ignore_eos=True,
                        temperature=0.8 if i == 1 else 0.0, seed=7 if i == 1 else None)
                for i, c in enumerate(contexts)]
    cancelled = Request(context_ids=contexts[0], max_new_tokens=NEW, ignore_eos=True)
    for request in [*requests, cancelled]:
        scheduler.submit(request)
    scheduler.step()
    cancelled.cancel_requested = True  # on every rank here; the agreement takes rank 0's at the next step
    scheduler.run()
    return {"tokens": [r.tokens for r in requests], "cancelled": cancelled.status, "slots": scheduler.pool.slots,
            "steps": scheduler.report["steps"]}


def shortest_first(model, tokenizer) -> dict:
    """Three prompts read shortest first, a few tokens a step, with a patience that rank 0's clock never reaches in
    the run: on the other ranks the clock runs 10,000 times faster, so a rank planning by its own clock would see
    every prompt past its patience and read them in arrival order (other chunks in other forwards than rank 0's)."""
    import time

    engine = kvpot.Engine(model, tokenizer, method=kvpot.StreamingLLM(sinks=4, window=36, chunk_size=32))
    _, question, contexts = inputs()
    scheduler = Scheduler(engine, slots=3, capacity=256, prefill_tokens=24, prompt_order="shortest",
                          prompt_patience=60.0)
    requests = [Request(context_ids=c, question_ids=question.tolist(), max_new_tokens=NEW, ignore_eos=True)
                for c in contexts]
    real = time.perf_counter
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:
        time.perf_counter = lambda: 10_000 * real()
    try:
        for request in requests:
            scheduler.submit(request)
        firsts = []
        while not scheduler.idle:
            firsts += [r.id for r in requests if r.tokens and r.id not in firsts]
            scheduler.step()
        firsts += [r.id for r in requests if r.tokens and r.id not in firsts]
    finally:
        time.perf_counter = real
    return {"tokens": [r.tokens for r in requests], "first_token_order": [[r.id for r in requests].index(i)
                                                                         for i in firsts],
            "steps": scheduler.report["steps"]}


def run(model, tokenizer) -> dict:
    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    methods = cases()
    routed_first = routed(model)  # before any Engine sets the model's attention to kvpot's
    out = {"one": {name: _logged(name, one, model, tokenizer, m) for name, m in methods.items()},
           "batched": {name: _logged(f"batched {name}", batched, model, tokenizer, methods[name]) for name in BATCHED}}
    out["core"] = {name: _logged(f"core {name}", core, model, tokenizer, methods[name]) for name in CORE}
    out["shortest_first"] = _logged("shortest first", shortest_first, model, tokenizer)
    out["kv_heads"] = sorted(_seen_heads(model, tokenizer))
    out["routed"] = routed_first
    return out


def routed(model) -> dict:
    """One single-token forward under `SingleRowLinear` on this device (the mode the engine applies to decoding
    steps where kvpot's matrix-vector kernel runs): what each `kvpot::gemv` call received, and the logits' top
    tokens beside a forward without the mode. Under tensor parallelism transformers' TP forward must hand the
    mode each rank's local shard (plain tensors), with its collectives around the product."""
    from kvpot.engine import linear

    seen, original = [], linear.gemv_op

    def counting(x, weight, bias):
        seen.append([list(weight.shape), type(weight).__name__, type(x).__name__])
        return original(x, weight, bias)

    ids = inputs()[0][:1].view(1, 1).to(model.device)
    linear.gemv_op = counting
    try:
        with torch.no_grad(), linear.SingleRowLinear(devices=(model.device.type,)):
            mode = model(input_ids=ids).logits[0, -1].float()
    finally:
        linear.gemv_op = original
    with torch.no_grad():
        plain = model(input_ids=ids).logits[0, -1].float()
    return {"calls": seen, "top": mode.topk(5).indices.tolist(), "plain_top": plain.topk(5).indices.tolist(),
            "max_diff": float((mode - plain).abs().max())}


def _seen_heads(model, tokenizer) -> set[int]:
    """The KV heads each layer's cache holds after a prefill (the rank's own under tensor parallelism)."""
    state = kvpot.Engine(model, tokenizer).prefill_ids(inputs()[0][:16])
    return {layer.kv_heads for layer in state.cache.layers}


def _logged(name, fn, *args):
    print(f"[rank {os.environ.get('RANK', '-')}] {name}", file=sys.stderr, flush=True)
    return fn(*args)


def main(model_dir: str, out_dir: str) -> None:
    import faulthandler

    from kvpot.models import load_pretrained

    # a collective that one rank never joins waits forever: print every thread's stack and leave instead
    faulthandler.dump_traceback_later(int(os.environ.get("KVPOT_TP_WATCHDOG", "600")), exit=True)

    world = int(os.environ["WORLD_SIZE"])
    # float32 on a GPU too: the one-process reference is float32 on one GPU (bfloat16 rounds the ranks' partial
    # sums of the row-wise projections differently from one GPU's whole sums)
    model, tokenizer = load_pretrained(model_dir, tp_size=world, dtype=torch.float32)
    result = run(model, tokenizer)
    result["world"] = world
    rank = int(os.environ["RANK"])
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:3])
