"""Where the batched step of N document readers spends its time (issue 48): one stored document, N readers
decoding, each step timed on the device with its CUDA graph (as `kvpot bench throughput` runs it), then the same
steps uncaptured under torch.profiler (CUDA time by operator and input shapes), with the document shared and
copied per reader.

    python benchmarks/shared-document-h100/step_probe.py --out DIR [--readers 64] [--length 128k] [--modes ...]

Writes DIR/step_probe.json: per mode (shared, copied) the graph step's p50/mean ms over `--steps` steps, the
eager step's, and the profiler's top operators of `--profile-steps` eager steps. `--start-steps N` adds each of the
first steps' times from the readers' submission (admission, fed questions, their first tokens) and host profiles of
the slowest, and the garbage collector's pauses in each (ms, full passes).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import time
from pathlib import Path


def _steps(scheduler, count: int, sync) -> list[float]:
    times = []
    for _ in range(count):
        sync()
        begun = time.perf_counter()
        scheduler.step()
        sync()
        times.append((time.perf_counter() - begun) * 1000)
    return times


def _stats(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"p50_ms": ordered[len(ordered) // 2], "mean_ms": sum(ordered) / len(ordered), "max_ms": ordered[-1],
            "steps": len(ordered)}


def probe(engine, state, args, share: bool, decode: str) -> dict:
    import torch

    from kvpot.engine.requests import Request
    from kvpot.engine.scheduler import Scheduler

    vocab = engine.model.config.vocab_size
    scheduler = Scheduler(engine, slots=args.readers, prefill_tokens=args.prefill_tokens, decode=decode,
                          share_documents=share, mix=args.mix)
    scheduler.capture()
    gen = torch.Generator().manual_seed(1)
    requests = [Request(None, torch.randint(3, vocab, (32,), generator=gen).tolist(), state=state,
                        max_new_tokens=10_000, ignore_eos=True) for _ in range(args.readers)]
    for request in requests:
        scheduler.submit(request)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    start, hosts, pauses = [], {}, []
    collected = [0.0, 0]  # the collector's pauses (ms, full passes) in the step being timed

    def pause(phase, info, began=[0.0]):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            collected[0] += (time.perf_counter() - began[0]) * 1000
            collected[1] += info["generation"] == 2

    gc.callbacks.append(pause)
    profiler_start = None
    if args.profile_start and torch.cuda.is_available():  # the GPU's kernels over the start steps
        profiler_start = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA], record_shapes=True)
        profiler_start.__enter__()
    while any(r.status != "decoding" for r in requests) or len(start) < args.start_steps:
        # the steps from the readers' submission on, each timed with the device (and its host profile kept):
        # admission, the fed questions, the step where they start decoding
        profiler = cProfile.Profile() if args.start_steps else None
        collected[:] = [0.0, 0]
        sync()
        begun = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        scheduler.step()
        if profiler is not None:
            profiler.disable()
            hosts[len(start)] = profiler
        sync()
        start.append(round((time.perf_counter() - begun) * 1000, 2))
        pauses.append([round(collected[0], 2), collected[1]])
        failed = [r.error for r in requests if r.status == "failed"]
        if failed:
            raise SystemExit(f"a request failed: {failed[0]}")
    gc.callbacks.remove(pause)
    if profiler_start is not None:
        profiler_start.__exit__(None, None, None)
        start_table = profiler_start.key_averages(group_by_input_shape=True).table(
            sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60, max_shapes_column_width=90)
        print(start_table, flush=True)
    slowest = sorted(range(len(start)), key=lambda i: -start[i])[:3]
    start_profiles = {}
    for i in slowest if args.start_steps else ():
        text = io.StringIO()
        pstats.Stats(hosts[i], stream=text).sort_stats("cumulative").print_stats(40)
        start_profiles[str(i)] = text.getvalue()
    _steps(scheduler, 8, sync)  # warm
    out = {"decode": decode, **_stats(_steps(scheduler, args.steps, sync)), "report": dict(scheduler.report),
           "pool_bytes": scheduler.pool.nbytes, "start_ms": start, "start_gc": pauses,
           "start_profiles": start_profiles,
           "start_profile": start_table if profiler_start is not None else None}
    if args.profile_steps and torch.cuda.is_available():
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
            _steps(scheduler, args.profile_steps, sync)
        out["profile"] = profiler.key_averages(group_by_input_shape=True).table(
            sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=60, max_shapes_column_width=90)
        out["profile_total_cuda_ms"] = sum(e.self_device_time_total for e in profiler.key_averages()) / 1000
    scheduler.abort()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--method", default="infinipot:pot_size=4096")
    p.add_argument("--readers", type=int, default=64)
    p.add_argument("--length", default="128k")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--start-steps", type=int, default=0,
                   help="time each of the first N steps from the readers' submission (at least until all decode), "
                        "with host profiles (cProfile) of the three slowest in the JSON")
    p.add_argument("--modes", default="shared:graph,copied:graph,shared:static",
                   help="comma-separated KIND:DECODE[:APPEND]: KIND shared or copied, DECODE graph or static, APPEND "
                        "reference to run the batched step's cache append in PyTorch (kvpot.kernels.append_reference) "
                        "instead of its Triton kernel")
    p.add_argument("--mix", default="auto", help="Scheduler(mix=...): on reads each reader's question as a chunk of "
                   "a mixed step over the shared document (docs/design.md, *A reader's question read as a chunk*)")
    p.add_argument("--prefill-tokens", type=int, default=1024, help="the scheduler's prompt tokens a step")
    p.add_argument("--profile-start", action="store_true",
                   help="torch.profiler's kernel table over the --start-steps (printed and kept in the JSON)")
    p.add_argument("--compile-step", action="store_true",
                   help="the step's layers through torch.compile, as `kvpot bench throughput --compile-step` runs them")
    p.add_argument("--launch-shape", default=None, metavar="BLOCK_N,WARPS,STAGES,SPLITS",
                   help="run the batched decode attention at this launch shape instead of the library's "
                        "(kvpot.kernels.decode.launch_shape and default_splits; engine-core-h100/decode_sweep.py)")
    args = p.parse_args(argv)
    import torch

    from kvpot.bench.backends import sdpa_backends
    from kvpot.bench.common import IdTokenizer
    from kvpot.engine import Engine, batch
    from kvpot.kernels.append_reference import append_rows_reference
    from kvpot.methods.spec import build_method
    from kvpot.models import shapes

    if args.launch_shape:
        import kvpot.kernels.decode as decode_kernel

        block_n, warps, stages, splits = (int(x) for x in args.launch_shape.split(","))
        decode_kernel.launch_shape = lambda *a: (block_n, warps, stages)
        decode_kernel.default_splits = lambda *a, **k: splits
    device = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: a smoke run of this script)
    model = shapes.build(args.shape, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=0)
    vocab = model.config.vocab_size
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "modes": {}}
    append_kernel = batch.append_kernel
    with sdpa_backends("no-cudnn", device):
        engine = Engine(model, IdTokenizer(vocab), method=build_method(args.method), chat_template=False,
                        compile_step=args.compile_step)
        document = torch.randint(3, vocab, (int(args.length.lower().replace('k', '')) * 1024 if args.length.lower().endswith('k') else int(args.length),), generator=torch.Generator().manual_seed(0))
        state = engine.prefill_ids(document.tolist())
        report["document_entries"] = [layer.n for layer in state.cache.layers][:1]
        for mode in args.modes.split(","):
            kind, decode, *append = mode.split(":")
            batch.append_kernel = append_kernel if append != ["reference"] else (lambda device: append_rows_reference)
            result = probe(engine, state, args, kind == "shared", decode)
            gc.collect()  # the mode's pool goes before the next one's is sized from free memory
            if device == "cuda":
                torch.cuda.empty_cache()
            report["modes"][mode] = result
            print(mode, {k: v for k, v in result.items() if k not in ("profile", "report", "start_profiles")}, flush=True)
            if "profile" in result:
                print(result["profile"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
