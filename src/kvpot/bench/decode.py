"""`kvpot bench decode`: milliseconds per generated token after a context of each length."""

from __future__ import annotations

import time

from kvpot.bench.common import (
    FLOOR,
    SdpaFloor,
    engine_for,
    iterate,
    model_kv_bytes,
    peak_memory,
    peak_memory_by_device,
    profile_ops,
    random_tokens,
    reset_peak,
    synchronize,
)
from kvpot.bench.config import WARMUP_TOKENS, BenchConfig, baseline_labels
from kvpot.bench.hf import step_stats
from kvpot.bench.baselines import baseline_row
from kvpot.bench.breakdown import step_breakdown


def bench_decode(config: BenchConfig, model, runs, results, progress) -> None:
    import torch

    vocab = model.config.vocab_size
    kv_bytes = model_kv_bytes(model)
    question = random_tokens(vocab, config.question_tokens, config.seed + 1, config.device)
    engines = {run.label: engine_for(model, run, vocab, decode=config.decode, compile_step=config.compile_step,
                                     linear=config.linear, batch_invariant=config.batch_invariant,
                                     runner=config.runner) for run in runs}
    count = config.warmup_steps + config.decode_steps + 1  # +1: n tokens give n - 1 timed steps
    warm = min(WARMUP_TOKENS, config.lengths[0])
    warmup_seconds = {}  # per method: with --compile-step, mostly the step's compilation
    for run in runs:
        started = time.perf_counter()
        state = engines[run.label].prefill_ids(random_tokens(vocab, warm, config.seed + 2, config.device), question)
        engines[run.label].generate_ids(state=state, max_new_tokens=min(count, 8), ignore_eos=True, keep_state=False)
        synchronize(config.devices)
        warmup_seconds[run.label] = round(time.perf_counter() - started, 3)

    def floor_steps(steps: int) -> list[float]:
        times = []
        with torch.no_grad(), SdpaFloor(model):
            ids = torch.tensor([[5]], device=config.device)
            for _ in range(steps):
                synchronize(config.devices)
                started = time.perf_counter()
                hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
                int(model.get_output_embeddings()(hidden[0, -1]).argmax())
                times.append(time.perf_counter() - started)
        return times

    def measure(entry, length):
        if entry in baseline_labels(config):
            return baseline_row(config, model, entry, length, question, "decode")
        before = reset_peak(config.devices)
        if entry == FLOOR:
            steps, stats, prefill = floor_steps(config.warmup_steps + config.decode_steps), None, None
        else:
            engine = engines[entry.label]
            for other in engines.values():  # the other methods' kept pools of one (`Engine.core`) are not this row's
                if other is not engine:
                    other.core = None
            # a long context takes minutes to read: show its progress under the bench's bar
            state = engine.prefill_ids(random_tokens(vocab, length, config.seed + length, config.device), question,
                                       progress=progress)
            prefill = state.stats.prefill_seconds
            reset_peak(config.devices)
            # decode in the state's own cache (no copy of a 1M-entry cache) unless the profiler needs it again;
            # step times come from GPU events recorded after each step (no sync per step)
            result = engine.generate_ids(state=state, max_new_tokens=count, ignore_eos=True, time_steps=True,
                                         keep_state=config.profile or config.breakdown)
            stats = result.stats
            steps = [ms / 1000 for ms in stats.decode["step_ms"]]
        extra = {}
        if config.profile:  # 8 more steps, untimed, under the profiler (the engine copies the state first)
            extra["profile"] = profile_ops(
                (lambda: floor_steps(8)) if entry == FLOOR else
                (lambda: engine.generate_ids(state=state, max_new_tokens=9, ignore_eos=True)), config.devices)
        if config.breakdown and entry != FLOOR:
            extra["breakdown"] = step_breakdown(engine, state)
        if entry != FLOOR:
            del state
        timed = steps[config.warmup_steps :]
        return {
            **step_stats([1000 * s for s in timed]),
            "timing": "per-step: GPU events after each step (graph/static), host clock after each read-back (eager); "
                      "--runner core: host clock at each token's delivery",
            "decode": None if stats is None else {k: v for k, v in stats.decode.items() if k != "step_ms"},
            "prefill_seconds": prefill, "peak_memory_bytes": peak_memory(config.devices), "memory_before_bytes": before,
            "peak_memory_by_device": peak_memory_by_device(config.devices),
            "max_kv_entries": None if stats is None else stats.max_kv_entries,
            "kv_cache_bytes": None if stats is None else stats.max_kv_entries * kv_bytes,
            "final_kv_entries": None if stats is None else stats.final_kv_entries,
            "warmup_seconds": None if entry == FLOOR else warmup_seconds[entry.label],
            "method_report": None if stats is None else stats.method,
            "linear": None if entry == FLOOR else engine.linear,  # --linear as resolved on this device
            # --runner as resolved: the one-sequence decoder ("sequence"; the eager loop: None) or the core
            "runner": None if stats is None else stats.decode.get("runner"),
            **extra,
        }

    iterate(config, runs, results, progress, measure, "decode")
