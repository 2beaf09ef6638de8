"""`kvpot bench throughput`: many users at once, kvpot batched against one at a time and transformers.

A workload is `--users` requests, each `--lengths` prompt tokens (random) plus its own
`--question-tokens` question, `--new-tokens` generated each (greedy, end-of-sequence off), all
arriving together. With `--document`, every user asks about one stored document instead: it is
read once (timed apart, `document_prefill_seconds`) and each request starts from its state.

Rows per method and length:
- `METHOD [batch]`: kvpot's scheduler (`kvpot.engine.scheduler`), `--slots` sequences at once
  (default: every user, within free memory), `--prefill-tokens` prompt tokens read per step;
- `METHOD [one at a time]`: `Engine.generate_ids` for each user after the other (the engine before
  batching), `--sequential-users` of them (default all);
- `hf [generate_batch]` (`--baseline hf`): transformers' continuous batching (paged attention) over the
  full prompts, stopped after `--hf-timeout` seconds and recorded as unfinished if it runs out.

Each row: output tokens per second over the workload's wall time, time to first token p50/p95
(from the workload's start: queueing counts), inter-token latency p50/p99 (gaps between a request's
delivered tokens), peak GPU memory. Before timing, the batch runs a short warm-up of the same
shape (kernels compile, each batch size's CUDA graph is captured).
"""

from __future__ import annotations

import statistics
import time

from kvpot.bench.common import IdTokenizer, checkpoint, free_memory, mark_oom, peak_memory, random_tokens, \
    reset_peak, synchronize
from kvpot.bench.config import BenchConfig
from kvpot.errors import KvpotError

WARMUP_PROMPT = 256  # warm-up prompts: long enough for one chunk of every method, short enough to cost nothing


def bench_throughput(config: BenchConfig, model, runs, results, progress) -> None:
    from tqdm.auto import tqdm

    entries = [(run, kind) for run in runs for kind in ("batch", "sequential")] + \
              [("hf", "hf") for name in config.baselines if name == "hf"]
    with tqdm(total=len(entries) * len(config.lengths), unit="run", desc="bench throughput",
              disable=not progress) as bar:
        for length in config.lengths:
            for entry, kind in entries:
                label = entry if isinstance(entry, str) else entry.label
                name = {"batch": f"{label} [batch]", "sequential": f"{label} [one at a time]",
                        "hf": "hf [generate_batch]"}[kind]
                bar.set_postfix_str(f"{name} @ {length} tokens")
                row = {"method": name, "kind": kind, "length": length, "oom": False, "skipped": False,
                       "users": config.users, "new_tokens": config.new_tokens, "document": config.document}
                try:
                    prompts = _prompts(config, model, length)
                    if kind == "hf":
                        row.update(_hf_guarded(config, model, prompts))
                    else:
                        row.update(_kvpot_row(config, model, entry, prompts, kind))
                except KvpotError as err:  # a method that cannot run this workload: say why, go on
                    row["error"] = str(err)
                except Exception as err:  # noqa: BLE001 - only out-of-memory errors are recorded
                    mark_oom(row, err)
                free_memory(config.devices)
                results["rows"].append(row)
                checkpoint(results, config.out)
                bar.update()


def _prompts(config: BenchConfig, model, length: int) -> dict:
    """The workload's token ids: per user a context (or one shared document) and a question."""
    vocab = model.config.vocab_size
    questions = [random_tokens(vocab, config.question_tokens, config.seed + 7919 * (user + 1), config.device)
                 for user in range(config.users)]
    if config.document:
        document = random_tokens(vocab, length, config.seed + length, config.device)
        return {"document": document, "contexts": [document] * config.users, "questions": questions}
    contexts = [random_tokens(vocab, length, config.seed + length + 104729 * (user + 1), config.device)
                for user in range(config.users)]
    return {"document": None, "contexts": contexts, "questions": questions}


def _kvpot_row(config: BenchConfig, model, run, prompts: dict, kind: str, tokenizer=None) -> dict:
    """`tokenizer`: the one a method's own prompt (InfiniPot's catalyst) is encoded with; `bench serve`
    passes its server's, so both rows read the same tokens."""
    from kvpot.engine import Engine

    engine = Engine(model, tokenizer or IdTokenizer(model.config.vocab_size), method=run.method, chat_template=False,
                    # bench serve's config (also passed here) has no compile_step: its server compiles nothing
                    decode=config.decode, compile_step=getattr(config, "compile_step", False),
                    linear=getattr(config, "linear", "auto"))
    extra, state = {}, None
    if prompts["document"] is not None:
        synchronize(config.devices)
        begun = time.perf_counter()
        state = engine.prefill_ids(prompts["document"])
        extra["document_prefill_seconds"] = time.perf_counter() - begun
    if kind == "sequential":
        return {**extra, **_sequential(config, engine, prompts, state)}
    return {**extra, **_batched(config, engine, prompts, state)}


def _requests(config: BenchConfig, prompts: dict, state, users: int | None = None):
    from kvpot.engine.requests import Request

    count = config.users if users is None else users
    if state is not None:
        return [Request(None, q, state=state, max_new_tokens=config.new_tokens, ignore_eos=True)
                for q in prompts["questions"][:count]]
    return [Request(c, q, max_new_tokens=config.new_tokens, ignore_eos=True)
            for c, q in zip(prompts["contexts"][:count], prompts["questions"][:count])]


def _batched(config: BenchConfig, engine, prompts: dict, state) -> dict:
    from kvpot.engine.offline import run_all
    from kvpot.engine.requests import Request
    from kvpot.engine.scheduler import Scheduler

    capacity = None
    if engine.method.max_entries() is None:  # a growing cache: each slot holds its whole prompt
        # the longest prompt: `bench serve`'s prompts from text differ in length from user to user
        capacity = max(c.numel() + q.numel() for c, q in zip(prompts["contexts"], prompts["questions"])) + \
            config.new_tokens
    scheduler = Scheduler(engine, slots=config.slots or None, capacity=capacity, max_slots=config.users,
                          prefill_tokens=config.prefill_tokens, decode=config.decode)
    # warm-up of the same batch sizes: kernels compile and each bucket's graph is captured, untimed
    vocab = engine.model.config.vocab_size
    warm = [Request(random_tokens(vocab, WARMUP_PROMPT, config.seed + index, config.device), q, max_new_tokens=4,
                    ignore_eos=True) for index, q in enumerate(prompts["questions"][: scheduler.pool.slots])]
    run_all(scheduler, warm)
    scheduler.capture()  # every batch size, as the server does at its start
    scheduler.report = dict.fromkeys(scheduler.report, 0)  # the timed workload's counts alone
    captured = scheduler.decoder.captures
    requests = _requests(config, prompts, state)
    before = reset_peak(config.devices)
    synchronize(config.devices)
    begun = time.perf_counter()
    run_all(scheduler, requests)
    synchronize(config.devices)
    wall = time.perf_counter() - begun
    ttft = [r.first_token_time - begun for r in requests]
    gaps = [1000 * (b - a) for r in requests for a, b in zip(r.token_times, r.token_times[1:])]
    return {**_rates(requests, wall, ttft, gaps), "peak_memory_bytes": peak_memory(config.devices),
            "memory_before_bytes": before, "slots": scheduler.pool.slots, "capacity": scheduler.capacity,
            "slot_bytes": scheduler.slot_bytes(), "pool_bytes": scheduler.pool.nbytes,
            "prefill_tokens_per_step": scheduler.prefill_tokens, "scheduler": dict(scheduler.report),
            "graphs": {"captures": scheduler.decoder.captures, "captured_in_warmup": captured,
                       "replays": scheduler.decoder.replays},
            "max_kv_entries": max(r.stats.max_kv_entries for r in requests)}


def _sequential(config: BenchConfig, engine, prompts: dict, state) -> dict:
    """Each user after the other through the one-sequence engine (its own CUDA-graph decoding)."""
    users = config.sequential_users or config.users
    requests = _requests(config, prompts, state, users)
    before = reset_peak(config.devices)
    synchronize(config.devices)
    begun = time.perf_counter()
    ttft, gaps, made = [], [], 0
    for request in requests:
        started = time.perf_counter() - begun
        if state is not None:
            result = engine.generate_ids(question_ids=request.question_ids, state=state,
                                         max_new_tokens=config.new_tokens, ignore_eos=True, time_steps=True)
        else:
            result = engine.generate_ids(request.context_ids, request.question_ids, max_new_tokens=config.new_tokens,
                                         ignore_eos=True, time_steps=True)
        ttft.append(started + result.stats.prefill_seconds)
        gaps += result.stats.decode.get("step_ms") or []
        made += len(result.token_ids)
    synchronize(config.devices)
    wall = time.perf_counter() - begun
    rates = _rates_of(made, users, users, wall, ttft, gaps)
    return {**rates, "peak_memory_bytes": peak_memory(config.devices), "memory_before_bytes": before,
            "users_run": users, "slots": 1}


def _hf_row(config: BenchConfig, model, prompts: dict) -> dict:
    """transformers' continuous batching over the full prompts (a stored document is read per user)."""
    import torch
    from transformers import GenerationConfig

    inputs = [torch.cat([c, q]).tolist() for c, q in zip(prompts["contexts"], prompts["questions"])]
    generation = GenerationConfig(max_new_tokens=config.new_tokens, do_sample=False)
    model.set_attn_implementation("sdpa")  # continuous batching refuses kvpot's; the next Engine sets it back
    before = reset_peak(config.devices)
    synchronize(config.devices)
    begun = time.perf_counter()
    manager = model.init_continuous_batching(generation_config=generation)
    manager.start()
    finished: dict[str, object] = {}
    try:
        ids = [_hf_add(manager, ids, config.new_tokens) for ids in inputs]
        deadline = begun + config.hf_timeout
        while len(finished) < len(ids) and time.perf_counter() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                finished[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=30)
    wall = time.perf_counter() - begun
    done = list(finished.values())
    made = sum(len(r.generated_tokens) for r in done)
    ttft, gaps = [], []
    for r in done:
        stamps = getattr(r, "timestamps", None) or []
        if stamps:
            ttft.append(stamps[0] - begun if stamps[0] > begun else stamps[0] - r.created_time)
            gaps += [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
    errors = sorted({r.error for r in done if getattr(r, "error", None)})
    row = _rates_of(made, len(done), len(inputs), wall, ttft, gaps)
    return {**row, "unfinished": len(done) < len(inputs), "timeout_seconds": config.hf_timeout,
            "errors": errors[:3], "peak_memory_bytes": peak_memory(config.devices), "memory_before_bytes": before,
            "baseline": "transformers continuous batching (init_continuous_batching), greedy, EOS off"}


def _hf_guarded(config: BenchConfig, model, prompts: dict) -> dict:
    """The baseline's row, or what stopped it (a baseline that fails is recorded, not fatal)."""
    try:
        return _hf_row(config, model, prompts)
    except Exception as err:  # an out-of-memory error is still marked as such by the caller
        from kvpot.bench.common import is_oom

        if is_oom(err):
            raise
        return {"error": f"{type(err).__name__}: {err}", "completed": 0, "requests": len(prompts["contexts"])}


def _hf_add(manager, ids: list[int], new_tokens: int) -> str:
    """One request, with per-token timestamps where this transformers records them; EOS never matches."""
    try:
        return manager.add_request(ids, max_new_tokens=new_tokens, record_timestamps=True, eos_token_id=-1)
    except TypeError:  # an older signature
        return manager.add_request(ids, max_new_tokens=new_tokens)


def _rates(requests, wall: float, ttft: list[float], gaps: list[float]) -> dict:
    made = sum(len(r.tokens) for r in requests)
    done = sum(1 for r in requests if r.status == "finished")
    return _rates_of(made, done, len(requests), wall, ttft, gaps)


def _rates_of(made: int, done: int, total: int, wall: float, ttft: list[float], gaps: list[float]) -> dict:
    return {
        "output_tokens": made, "completed": done, "requests": total, "wall_seconds": wall,
        "output_tokens_per_second": made / wall if wall > 0 else None,
        "ttft_p50_seconds": _quantile(ttft, 0.5), "ttft_p95_seconds": _quantile(ttft, 0.95),
        "itl_p50_ms": _quantile(gaps, 0.5), "itl_p99_ms": _quantile(gaps, 0.99),
        "itl_max_ms": max(gaps) if gaps else None,
    }


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(100 * q) - 1))]
