"""`kvpot bench throughput`: many users at once, kvpot batched against one at a time and transformers.

A workload is `--users` requests, each `--lengths` prompt tokens (random) plus its own
`--question-tokens` question, `--new-tokens` generated each (greedy, end-of-sequence off), all
arriving together. With `--document`, every user asks about one stored document instead: it is
read once (timed apart, `document_prefill_seconds`) and each request starts from its state.
Open-loop load (`kvpot.bench.load`): `--arrival-rate R` spaces the arrivals (Poisson, R per second),
`--length-mix` / `--new-tokens-mix` draw each request's prompt length and new tokens, and every
latency is measured from the request's own arrival; `--slo-ttft` / `--slo-itl` add goodput.

Rows per method and length:
- `METHOD [batch]`: kvpot's scheduler (`kvpot.engine.scheduler`), `--slots` sequences at once
  (default: every user, within free memory), `--prefill-tokens` prompt tokens read per step;
- `METHOD [batch, mixed]` (`--mixed`) and `METHOD [batch, prompts apart]` (`--prompts-apart`): the same
  scheduler with prompt chunks read in the decoding rows' forward, or in forwards of their own, whatever
  `--mix` gives `METHOD [batch]` (each row records its `mix`);
- `METHOD [batch, shared document]` (`--document --share-documents`): the same scheduler with its readers sharing
  the stored document's entries (`Scheduler(share_documents=True)`, `kvpot.engine.documents`) at the same `--mix`;
  its `scheduler` record counts the shared documents, their readers and the copy-on-write events;
- `METHOD [one at a time]`: `Engine.generate_ids` for each user after the other (the engine before
  batching), `--sequential-users` of them (default all), in arrival order, each starting at its
  arrival or when the one before it ends, whichever is later;
- with `--batch-invariant`, kvpot's rows end in `, batch-invariant]` (`Engine(batch_invariant=True)`);
- `hf [generate_batch]` (`--baseline hf`): transformers' continuous batching (paged attention) over the
  full prompts, each added at its arrival while the manager runs, stopped after `--hf-timeout` seconds
  and recorded as unfinished if it runs out.

Each batch row also keeps `steps` (`kvpot.engine.trace`): per kind of step (decoding alone, mixed, prompt
forwards apart) the gap its users saw, p50 / p99 / max, and the slowest steps with what they ran.

Each row: output tokens per second over the workload's wall time, time to first token, inter-token
latency (gaps between a request's delivered tokens) and end-to-end latency p50/p95/p99, all from each
request's arrival (all at once: the workload's start; queueing counts), prompt tokens/s, the share of
requests within the SLOs and goodput, peak GPU memory. Before timing, the batch runs a short warm-up of the same
shape (kernels compile, each batch size's CUDA graph is captured).
"""

from __future__ import annotations

import time

from kvpot.bench.common import IdTokenizer, checkpoint, free_memory, mark_oom, peak_memory, random_tokens, \
    reset_peak, synchronize
from kvpot.bench.config import BenchConfig, json_seconds
from kvpot.bench.load import load_config, load_figures, request_record, request_row, run_open_loop, \
    workload_plan
from kvpot.errors import KvpotError

WARMUP_PROMPT = 256  # warm-up prompts: long enough for one chunk of every method, short enough to cost nothing


def bench_throughput(config: BenchConfig, model, runs, results, progress) -> None:
    from tqdm.auto import tqdm

    kinds = ("batch",) + (("mixed",) if config.mixed else ()) + (("apart",) if config.prompts_apart else ()) + \
        (("shared",) if config.share_documents else ()) + ("sequential",)
    entries = [(run, kind) for run in runs for kind in kinds] + \
              [("hf", "hf") for name in config.baselines if name == "hf"]
    with tqdm(total=len(entries) * len(config.lengths), unit="run", desc="bench throughput",
              disable=not progress) as bar:
        for length in config.lengths:
            for entry, kind in entries:
                label = entry if isinstance(entry, str) else entry.label
                name = {"batch": f"{label} [batch]", "mixed": f"{label} [batch, mixed]",
                        "apart": f"{label} [batch, prompts apart]",
                        "shared": f"{label} [batch, shared document]",
                        "sequential": f"{label} [one at a time]", "hf": "hf [generate_batch]"}[kind]
                if config.batch_invariant and kind != "hf":  # kvpot's rows decode batch-invariant: say so
                    name = name[:-1] + ", batch-invariant]"
                bar.set_postfix_str(f"{name} @ {length} tokens")
                row = {"method": name, "kind": kind, "length": length, "oom": False, "skipped": False,
                       "users": config.users, "new_tokens": config.new_tokens, "document": config.document,
                       **load_config(config)}
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
    vocab, plan = model.config.vocab_size, workload_plan(config, length)
    questions = [random_tokens(vocab, config.question_tokens, config.seed + 7919 * (user + 1), config.device)
                 for user in range(config.users)]
    if config.document:
        document = random_tokens(vocab, length, config.seed + length, config.device)
        return {"document": document, "contexts": [document] * config.users, "questions": questions, "plan": plan}
    contexts = [random_tokens(vocab, n, config.seed + n + 104729 * (user + 1), config.device)
                for user, n in enumerate(plan["lengths"])]
    return {"document": None, "contexts": contexts, "questions": questions, "plan": plan}


def _kvpot_row(config: BenchConfig, model, run, prompts: dict, kind: str, tokenizer=None) -> dict:
    """`tokenizer`: the one a method's own prompt (InfiniPot's catalyst) is encoded with; `bench serve`
    passes its server's, so both rows read the same tokens."""
    from kvpot.engine import Engine

    engine = Engine(model, tokenizer or IdTokenizer(model.config.vocab_size), method=run.method, chat_template=False,
                    # bench serve's config (also passed here) has no compile_step: its server compiles nothing
                    decode=config.decode, compile_step=getattr(config, "compile_step", False),
                    linear=getattr(config, "linear", "auto"), batch_invariant=getattr(config, "batch_invariant", False))
    extra, state = {}, None
    if prompts["document"] is not None:
        synchronize(config.devices)
        begun = time.perf_counter()
        state = engine.prefill_ids(prompts["document"])
        extra["document_prefill_seconds"] = time.perf_counter() - begun
    if kind == "sequential":
        return {**extra, **_sequential(config, engine, prompts, state)}
    mix = {"mixed": "on", "apart": "off"}.get(kind, config.mix)  # shared documents: --mix as given
    return {**extra, **_batched(config, engine, prompts, state, mix=mix, share=kind == "shared")}


def _requests(config: BenchConfig, prompts: dict, state, users: int | None = None):
    from kvpot.engine.requests import Request

    count = config.users if users is None else users
    new = _plan(config, prompts)["new_tokens"]
    if state is not None:
        return [Request(None, q, state=state, max_new_tokens=n, ignore_eos=True)
                for q, n in zip(prompts["questions"][:count], new)]
    return [Request(c, q, max_new_tokens=n, ignore_eos=True)
            for c, q, n in zip(prompts["contexts"][:count], prompts["questions"][:count], new)]


def _plan(config, prompts: dict) -> dict:
    """The prompts' load plan (arrivals, new tokens); prompts made elsewhere (`bench serve` from text)
    may come without one: the plan of their first context's length then."""
    return prompts.get("plan") or workload_plan(config, prompts["contexts"][0].numel())


def _prompt_tokens(prompts: dict, index: int) -> int:
    """Prompt tokens request `index` reads: its context and question (a stored document's question alone)."""
    own = 0 if prompts["document"] is not None else prompts["contexts"][index].numel()
    return own + prompts["questions"][index].numel()


def _batched(config: BenchConfig, engine, prompts: dict, state, mix: str = "auto", share: bool = False) -> dict:
    from kvpot.engine.offline import run_all
    from kvpot.engine.requests import Request
    from kvpot.engine.scheduler import Scheduler
    from kvpot.engine.trace import StepTrace

    plan = _plan(config, prompts)
    capacity = None
    if engine.method.max_entries() is None:  # a growing cache: each slot holds its whole prompt
        # the longest prompt: `bench serve`'s prompts from text differ in length from user to user
        capacity = max(c.numel() + q.numel() for c, q in zip(prompts["contexts"], prompts["questions"])) + \
            max(plan["new_tokens"])
    scheduler = Scheduler(engine, slots=config.slots or None, capacity=capacity, max_slots=config.users,
                          prefill_tokens=config.prefill_tokens, decode=config.decode, mix=mix, share_documents=share,
                          reader_room=config.reader_room if share else None,
                          prompt_order=config.prompt_order, prompt_patience=config.prompt_patience,
                          launch_ahead=config.launch_ahead, feed_questions=config.feed_questions)
    # warm-up of the same batch sizes: kernels compile and each bucket's graph is captured, untimed
    vocab = engine.model.config.vocab_size
    warm = [Request(random_tokens(vocab, _warm_length(engine, scheduler, q) if index == 0 else WARMUP_PROMPT,
                                  config.seed + index, config.device), q, max_new_tokens=4, ignore_eos=True)
            for index, q in enumerate(prompts["questions"][: scheduler.pool.slots])]
    run_all(scheduler, warm)
    scheduler.capture()  # every batch size, as the server does at its start
    scheduler.report = dict.fromkeys(scheduler.report, 0)  # the timed workload's counts alone
    captured = scheduler.decoder.captures
    scheduler.trace = StepTrace.for_device(engine.device)  # each timed step's work, gap and device time (`steps`)
    requests = _requests(config, prompts, state)
    before = reset_peak(config.devices)
    synchronize(config.devices)
    begun = run_open_loop(scheduler, requests, plan["arrivals"])  # each submitted once it has arrived
    synchronize(config.devices)
    wall = time.perf_counter() - begun
    records = [request_record(r, a, begun, _prompt_tokens(prompts, i))
               for i, (r, a) in enumerate(zip(requests, plan["arrivals"]))]
    return {**_rates(config, records, wall), "peak_memory_bytes": peak_memory(config.devices),
            "memory_before_bytes": before, "slots": scheduler.pool.slots, "capacity": scheduler.capacity,
            "slot_bytes": scheduler.slot_bytes(), "pool_bytes": scheduler.pool.nbytes,
            "prefill_tokens_per_step": scheduler.prefill_tokens, "mix": scheduler.mix, "steps": scheduler.trace.summary(),
            "prompt_order": scheduler.prompt_order, "prompt_patience": json_seconds(scheduler.prompt_patience),
            "batch_invariant": engine.batch_invariant, "launch_ahead": scheduler.launch_ahead,
            "feed_questions": scheduler.feed_questions,
            "scheduler": dict(scheduler.report),
            "graphs": {"captures": scheduler.decoder.captures, "captured_in_warmup": captured,
                       "replays": scheduler.decoder.replays},
            "mixed_step": _mixed_step(scheduler),
            "max_kv_entries": max(r.stats.max_kv_entries for r in requests)}


def _warm_length(engine, scheduler, question) -> int:
    """The first warm-up prompt's tokens: two forwards of the whole budget read alone and, for a bounded method, its
    cache filled once (its first compression), so that neither compiles nor picks its kernels inside the timed run. On
    an H200 the timed run's first 1,024-token forward took 3.5 s after 256-token warm-up prompts, the next ones
    ~0.13 s (records/engine-core-h200/packed-2/, each batch row's slowest steps)."""
    bound = engine.method.max_entries()
    if bound is not None:
        return max(WARMUP_PROMPT, bound + 2 * scheduler.prefill_tokens)
    room = scheduler.capacity - question.numel() - 8  # a growing cache holds the whole prompt and 4 new tokens
    return max(WARMUP_PROMPT, min(2 * scheduler.prefill_tokens, room))


def _mixed_step(scheduler) -> dict | None:
    """How the mixed steps ran: captured in fixed shapes (`kvpot.engine.packed`: its steps, captures, replays and
    uncaptured warm-ups, warm-up included) or eager; None where nothing mixes."""
    if not scheduler.mix:
        return None
    packed = scheduler.decoder.packed
    if not scheduler.decoder.fixed_mix or packed is None:
        return {"form": "eager" if not scheduler.decoder.fixed_mix else "fixed", "packed_steps": 0}
    graphs = packed.graphs
    return {"form": "fixed", "packed_steps": packed.steps, "captures": graphs.captures, "replays": graphs.replays,
            "warmups": graphs.warmups}


def _sequential(config: BenchConfig, engine, prompts: dict, state) -> dict:
    """Each user after the other through the one-sequence engine (its own CUDA-graph decoding), in order
    of arrival: a request starts at its arrival or when the one before it ends, whichever is later."""
    users = config.sequential_users or config.users
    requests, arrivals = _requests(config, prompts, state, users), _plan(config, prompts)["arrivals"][:users]
    before = reset_peak(config.devices)
    synchronize(config.devices)
    begun, records = time.perf_counter(), []
    for index, (request, arrival) in enumerate(zip(requests, arrivals)):
        time.sleep(max(0.0, begun + arrival - time.perf_counter()))  # not before it has arrived
        started = time.perf_counter()
        result = _generate(engine, request, state)
        ended = time.perf_counter()
        at = begun + arrival
        records.append({"arrival": arrival, "ttft": started - at + result.stats.prefill_seconds,
                        "gaps": [ms / 1000 for ms in result.stats.decode.get("step_ms") or []], "e2e": ended - at,
                        "output_tokens": len(result.token_ids), "prompt_tokens": _prompt_tokens(prompts, index),
                        "finished": True})
    synchronize(config.devices)
    wall = time.perf_counter() - begun
    return {**_rates(config, records, wall), "peak_memory_bytes": peak_memory(config.devices),
            "memory_before_bytes": before, "users_run": users, "slots": 1}


def _generate(engine, request, state):
    if state is not None:
        return engine.generate_ids(question_ids=request.question_ids, state=state,
                                   max_new_tokens=request.max_new_tokens, ignore_eos=True, time_steps=True)
    return engine.generate_ids(request.context_ids, request.question_ids, max_new_tokens=request.max_new_tokens,
                               ignore_eos=True, time_steps=True)


def _hf_row(config: BenchConfig, model, prompts: dict) -> dict:
    """transformers' continuous batching over the full prompts (a stored document is read per user), each
    request added at its arrival while the manager runs (`add_request` from this thread, the manager
    generating in its own)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    inputs = [torch.cat([c, q]).tolist() for c, q in zip(prompts["contexts"], prompts["questions"])]
    plan = _plan(config, prompts)
    generation = GenerationConfig(max_new_tokens=max(plan["new_tokens"]), do_sample=False)
    model.set_attn_implementation("sdpa")  # continuous batching refuses kvpot's; the next Engine sets it back
    before = reset_peak(config.devices)
    synchronize(config.devices)
    begun = time.perf_counter()
    # on a CPU its paged cache would take most of the RAM (20.7 GB for the CI's test workload with transformers
    # 5.13, which ran a CI worker out of memory): a tenth of it is ample for what a CPU run serves
    cpu = next(model.parameters()).device.type == "cpu"
    cb = {"continuous_batching_config": ContinuousBatchingConfig(max_memory_percent=0.1)} if cpu else {}
    manager = model.init_continuous_batching(generation_config=generation, **cb)
    manager.start()
    try:
        finished = _hf_serve(manager, inputs, plan, begun, begun + config.hf_timeout)
    finally:
        manager.stop(block=True, timeout=30)
    wall = time.perf_counter() - begun
    records = [_hf_record(finished.get(f"u{i}"), a, begun, len(ids)) for i, (ids, a) in
               enumerate(zip(inputs, plan["arrivals"]))]
    errors = sorted({r.error for r in finished.values() if getattr(r, "error", None)})
    row = _rates(config, records, wall)
    return {**row, "unfinished": len(finished) < len(inputs),
            "timeout_seconds": config.hf_timeout, "errors": errors[:3],
            "peak_memory_bytes": peak_memory(config.devices),
            "memory_before_bytes": before, "arrivals": "added at each arrival (add_request while the manager runs)",
            "baseline": "transformers continuous batching (init_continuous_batching), greedy, EOS off"}


def _hf_serve(manager, inputs: list, plan: dict, begun: float, deadline: float) -> dict:
    """Add each request once it has arrived, collect finished results until all are in or `deadline`."""
    waiting, finished = list(enumerate(plan["arrivals"]))[::-1], {}
    while len(finished) < len(inputs) and time.perf_counter() < deadline:
        now = time.perf_counter() - begun
        while waiting and waiting[-1][1] <= now:
            index, _ = waiting.pop()
            _hf_add(manager, inputs[index], plan["new_tokens"][index], f"u{index}")
        wait = min(1.0, max(0.001, waiting[-1][1] - now)) if waiting else 1.0
        result = manager.get_result(timeout=wait)
        if result is not None and result.is_finished():
            finished[result.request_id] = result
    return finished


def _hf_record(result, arrival: float, begun: float, prompt_tokens: int) -> dict:
    if result is None:  # not finished by --hf-timeout
        return {"arrival": arrival, "ttft": None, "gaps": [], "e2e": None, "output_tokens": 0,
                "prompt_tokens": prompt_tokens, "finished": False}
    stamps = list(getattr(result, "timestamps", None) or [])
    if stamps and stamps[0] < begun:  # relative to the request's creation
        stamps = [result.created_time + s for s in stamps]
    at = begun + arrival
    return {"arrival": arrival, "ttft": stamps[0] - at if stamps else None,
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "times": [t - begun for t in stamps],
            "e2e": stamps[-1] - at if stamps else None,
            "output_tokens": len(result.generated_tokens), "prompt_tokens": prompt_tokens,
            "finished": not getattr(result, "error", None)}


def _hf_guarded(config: BenchConfig, model, prompts: dict) -> dict:
    """The baseline's row, or what stopped it (a baseline that fails is recorded, not fatal)."""
    try:
        return _hf_row(config, model, prompts)
    except Exception as err:  # an out-of-memory error is still marked as such by the caller
        from kvpot.bench.common import is_oom

        if is_oom(err):
            raise
        return {"error": f"{type(err).__name__}: {err}", "completed": 0, "requests": len(prompts["contexts"])}


def _hf_add(manager, ids: list[int], new_tokens: int, request_id: str) -> str:
    """One request, with per-token timestamps where this transformers records them; EOS never matches."""
    try:
        return manager.add_request(ids, request_id=request_id, max_new_tokens=new_tokens, record_timestamps=True,
                                   eos_token_id=-1)
    except TypeError:  # an older signature
        return manager.add_request(ids, request_id=request_id, max_new_tokens=new_tokens)


def _rates(config, records: list[dict], wall: float) -> dict:
    """A row's figures from its requests' records (`kvpot.bench.load`): rates, latencies from arrival, SLOs."""
    made = sum(r["output_tokens"] for r in records)
    return {"output_tokens": made, "completed": sum(r["finished"] for r in records), "requests": len(records),
            "wall_seconds": wall, "output_tokens_per_second": made / wall if wall > 0 else None,
            **load_figures(records, wall, getattr(config, "slo_ttft", None), getattr(config, "slo_itl", None)),
            "per_request": [request_row(r) for r in records]}
