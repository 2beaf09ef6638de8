"""What a prefill chunk's forward costs the host: torch calls per call site, host syncs, and host against device time.

    python benchmarks/engine-core-h100/prefill_ops.py --out DIR [--shape llama3-8b] [--method infinipot:pot_size=4096]

One request's prompt of `--length` tokens is read through `Engine.prefill_ids` (the method's own chunks) `--repeats`
times. Then the same read runs:
- under a `TorchFunctionMode` that counts every torch call by the innermost kvpot or transformers line that made it
  (shape queries left out);
- with `torch.cuda.set_sync_debug_mode("warn")`, which warns at each call that makes the host wait for the device,
  counted by the kvpot line that made it;
- timed three ways: the host's time to return (nothing waited for at the end), the wall time with the device drained,
  and the device's kernel time (torch.profiler), with the 25 kernels that took most of it.
If the host time is near the wall time and the device time well under it, the host's launches bound the read.
Writes DIR/prefill_ops.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import traceback
import warnings
from pathlib import Path

QUERIES = {"__get__", "shape", "dim", "size", "device", "dtype", "numel", "is_cuda", "__len__", "stride", "data_ptr",
           "element_size", "is_floating_point", "is_contiguous"}


def call_site(skip: str) -> str:
    frames = [f for f in traceback.extract_stack()[:-2]
              if ("/kvpot/" in f.filename or "/transformers/" in f.filename) and skip not in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split('/src/')[-1].split('site-packages/')[-1]}:{f.lineno}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--method", default="infinipot:pot_size=4096")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scheduler", type=int, default=0, metavar="BUDGET",
                   help="read through a Scheduler with BUDGET prompt tokens a step (0: Engine.prefill_ids alone)")
    p.add_argument("--decoding", type=int, default=0, help="with --scheduler: requests decoding beside the read")
    p.add_argument("--eager-mix", action="store_true",
                   help="with --scheduler: mixed steps in this step's shapes, not the captured fixed-shape ones")
    p.add_argument("--rotate-on-load", action="store_true",
                   help="with --scheduler: captured mixed steps rotate keys of ranked positions in every tile that "
                        "reads them, not once a layer ahead (kvpot.engine.packed.ROTATE_AHEAD off)")
    p.add_argument("--compile-step", action="store_true",
                   help="Engine(compile_step=True); with --scheduler the captured mixed steps run the compiled layer "
                        "too (kvpot.engine.packed.COMPILED)")
    args = p.parse_args(argv)
    import torch
    from torch.overrides import TorchFunctionMode

    from kvpot.bench.common import IdTokenizer
    from kvpot.engine import Engine
    from kvpot.methods.spec import build_method
    from kvpot.models import shapes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = shapes.build(args.shape, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=0)
    engine = Engine(model, IdTokenizer(model.config.vocab_size), method=build_method(args.method), chat_template=False,
                    compile_step=args.compile_step)
    ids = torch.randint(3, model.config.vocab_size, (args.length,), generator=torch.Generator().manual_seed(0))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def read():
        return engine.prefill_ids(ids)

    if args.scheduler:
        import kvpot.engine.packed as packed_step
        from kvpot.engine.scheduler import Request, Scheduler

        packed_step.ROTATE_AHEAD = not args.rotate_on_load
        packed_step.COMPILED = args.compile_step

        scheduler = Scheduler(engine, slots=args.decoding + 1, prefill_tokens=args.scheduler)
        scheduler.decoder.fixed_mix = scheduler.decoder.fixed_mix and not args.eager_mix
        scheduler.capture()
        decoders = [Request(ids[:256].tolist(), [5, 6], max_new_tokens=100000, ignore_eos=True)
                    for _ in range(args.decoding)]
        for request in decoders:
            scheduler.submit(request)
        while any(r.status != "decoding" for r in decoders):
            scheduler.step()

        def read():  # noqa: F811 (the scheduler's read replaces the engine's)
            request = Request(ids.tolist(), [5, 6], max_new_tokens=1, ignore_eos=True)
            scheduler.submit(request)
            steps = 0
            while not request.done:
                scheduler.step()
                steps += 1
            if request.status == "failed":
                raise SystemExit(f"the read failed: {request.error}")
            read.steps = steps
            return None

    for _ in range(args.repeats):  # warm: kernels compiled, tables grown, allocator settled
        state = read()
    sync()
    compressions = state.stats.compressions if state is not None else None

    counts, total = collections.Counter(), [0]

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") not in QUERIES:
                total[0] += 1
                counts[call_site("prefill_ops")] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        read()
    sync()

    syncs = collections.Counter()
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            read()
        torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs[f"{w.filename.split('/src/')[-1].split('site-packages/')[-1]}:{w.lineno}"] += 1

    sync()
    begun = time.perf_counter()
    read()
    host = time.perf_counter() - begun
    sync()
    wall = time.perf_counter() - begun
    device_ms, kernels = None, []
    if device == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            read()
            sync()
        averages = prof.key_averages()
        device_ms = sum(e.self_device_time_total for e in averages) / 1000
        # where the device time goes, by kernel name (graph replays' kernels included): what a faster step must cut
        kernels = sorted(((e.key[:120], e.self_device_time_total / 1000, e.count) for e in averages
                          if e.self_device_time_total > 0), key=lambda k: -k[1])[:25]
    packed = scheduler.decoder.packed if args.scheduler else None
    graphs = packed.graphs if packed is not None else None
    report = {"args": vars(args) | {"out": str(args.out)}, "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "compressions": compressions, "steps": getattr(read, "steps", None),
              "packed": None if packed is None else {"steps": packed.steps, "captures": graphs.captures,
                                                     "replays": graphs.replays, "warmups": graphs.warmups},
              "torch_calls": total[0], "host_ms": host * 1000, "wall_ms": wall * 1000,
              "device_kernel_ms": device_ms,
              "top_kernels_ms_calls": kernels, "tokens_per_second": args.length / wall,
              "calls_by_site": counts.most_common(60), "syncs_by_site": syncs.most_common(40)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_ops.json").write_text(json.dumps(report, indent=1))
    print({k: v for k, v in report.items() if k not in ("calls_by_site", "syncs_by_site", "top_kernels_ms_calls")})
    print("kernels (ms, calls):", [(name[:60], round(ms, 1), n) for name, ms, n in kernels[:12]])
    print("syncs:", report["syncs_by_site"][:15])
    print("calls:", report["calls_by_site"][:25])


if __name__ == "__main__":
    main()
