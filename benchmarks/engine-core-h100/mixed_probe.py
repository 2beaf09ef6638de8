"""Where a batched step's time goes while prompts are read: the same requests through the scheduler with
prompt chunks in the decoding rows' forward (mix) and in forwards of their own (apart), each step timed on
the device, and two steps' CUDA time by operator in each mode (torch.profiler).

    python benchmarks/engine-core-h100/mixed_probe.py --out DIR [--shape llama3-8b] [--decoding 32]

`--decoding` requests decode (short prompts read first) while `--reading` requests of `--length` tokens
are read, `--prefill-tokens` per step. Writes DIR/mixed_probe.json: per mode the step times (ms) while
prompts were read, the forwards, and the profiler's top operators of two steps.

Each step is timed between two device synchronizations, so its time is the host's launches plus the device's
tail: where the host bounds a step, this is more than a stream of steps takes (one prompt alone: 74-83 ms a step
here against 46 ms of device work, records/engine-core-h200/host-bound/). `prefill_ops.py` times a whole read.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--method", default="infinipot:pot_size=4096")
    p.add_argument("--decoding", type=int, default=32)
    p.add_argument("--reading", type=int, default=4)
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--print-profiles", action="store_true", help="print each mode's profiler table")
    p.add_argument("--modes", default="apart,mix,apart,mix",
                   help="comma-separated, each run in turn (a mode's second run is the one kept: the first warms): "
                        "apart (prompt chunks in forwards of their own), mix (in the decoding rows' forward, "
                        "attended by the varlen kernel), mix-sdpa (mixed, each chunk attended alone as before the "
                        "varlen kernel: `sequence_attention`), mix-apart (mixed, and after a mixed forward the "
                        "chunks that could mix read in forwards of their own, the rule before `Scheduler.mix_waits`)")
    args = p.parse_args(argv)
    import torch

    from kvpot.bench.backends import sdpa_backends
    from kvpot.bench.common import IdTokenizer
    from kvpot.engine import Engine, mixed
    from kvpot.engine.scheduler import Request, Scheduler
    from kvpot.engine.trace import StepTrace
    from kvpot.methods.spec import build_method
    from kvpot.models import shapes

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = shapes.build(args.shape, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=0)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    report = {"args": vars(args) | {"out": str(args.out)}, "modes": {}}
    with sdpa_backends("no-cudnn", device):
        varlen = mixed.MixedCache._varlen
        for mode in args.modes.split(","):
            mixed.MixedCache._varlen = varlen if mode != "mix-sdpa" else (lambda self: False)
            Scheduler.mix_waits = mode != "mix-apart"
            engine = Engine(model, IdTokenizer(vocab), method=build_method(args.method), chat_template=False)
            scheduler = Scheduler(engine, slots=args.decoding + args.reading, prefill_tokens=args.prefill_tokens,
                                  mix=mode.startswith("mix"))
            scheduler.capture()
            decoders = [Request(torch.randint(3, vocab, (256,), generator=gen).tolist(), [5, 6], max_new_tokens=4096,
                                ignore_eos=True) for _ in range(args.decoding)]
            for request in decoders:
                scheduler.submit(request)
            while any(r.status != "decoding" for r in decoders):
                scheduler.step()
                failed = [r.error for r in decoders if r.status == "failed"]
                if failed:
                    raise SystemExit(f"a request failed: {failed[0]}")
            readers = [Request(torch.randint(3, vocab, (args.length,), generator=gen).tolist(), [5, 6],
                               max_new_tokens=1, ignore_eos=True) for _ in range(args.reading)]
            for request in readers:
                scheduler.submit(request)
            scheduler.report = dict.fromkeys(scheduler.report, 0)
            scheduler.trace = StepTrace()  # what each step ran (kvpot.engine.trace)
            times, forwards, profile = [], [], None
            # CPU activity too, with shapes: the table then names each operator and its input shapes, which
            # says whose work a kernel is (the model's norms and MLP, kvpot's attention, the method's scoring)
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA],
                                              record_shapes=True) if device == "cuda" else None
            while any(not r.done for r in readers):
                if device == "cuda":
                    torch.cuda.synchronize()
                begun = time.perf_counter()
                if profiler is not None and len(times) == 5:
                    profiler.__enter__()
                scheduler.step()
                if device == "cuda":
                    torch.cuda.synchronize()
                # the step's time before the profiler's own work: its exit and table took seconds, which were
                # once counted in the eighth step (the 8-10 s maxima of probe3/ and probe4/)
                times.append((time.perf_counter() - begun) * 1000)
                forwards.append(scheduler.report.get("forwards", 0))
                if profiler is not None and len(times) == 8:
                    profiler.__exit__(None, None, None)
                    profile = profiler.key_averages(group_by_input_shape=True).table(
                        sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=60,
                        max_shapes_column_width=90)
            scheduler.abort()
            by_step = [[round(t, 2), f] for t, f in zip(times, forwards)]  # each step's ms, forwards so far
            times.sort()
            report["modes"][mode] = {
                "steps": len(times), "step_ms_p50": times[len(times) // 2], "step_ms_max": times[-1],
                "step_ms_mean": sum(times) / len(times), "report": dict(scheduler.report), "profile": profile,
                "by_step": by_step, "trace": scheduler.trace.summary()}
            print(mode, {k: v for k, v in report["modes"][mode].items() if k not in ("profile", "by_step")}, flush=True)
            if profile and args.print_profiles:
                print(mode, profile, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mixed_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
