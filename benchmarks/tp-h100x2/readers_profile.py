"""Where the batched step of READERS readers of one stored document goes, one GPU or a tensor-parallel rank (issue 45).

`kvpot bench throughput --document` gives the readers' tok/s; this probe times the steady decoding step itself
(every reader decoding, CUDA graphs, `--compile-step` with COMPILE=1) and profiles STEPS of them under
torch.profiler (kernels by device time: attention, products, all-reduces, the method's work), so a TP=2 step
can be set beside one GPU's part by part. Run alone (`python3 ...`) or under `torchrun --nproc-per-node 2`
(rank 0 writes). Writes OUT/readers-tp<N>[-compiled].json.

    python3 benchmarks/tp-h100x2/readers_profile.py OUT
    torchrun --standalone --nproc-per-node 2 benchmarks/tp-h100x2/readers_profile.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from kvpot.bench.common import IdTokenizer, machine, profile_ops, random_tokens, synchronize
from kvpot.engine import Engine
from kvpot.engine.offline import run_all
from kvpot.engine.requests import Request
from kvpot.engine.scheduler import Scheduler
from kvpot.methods import InfiniPot
from kvpot.models.parallel import is_rank_zero, world_size
from kvpot.models.shapes import build

READERS, LENGTH, TIMED, STEPS, POT = (int(os.environ.get(k, d)) for k, d in
                                      (("READERS", 64), ("LENGTH", 131072), ("TIMED", 32), ("STEPS", 4), ("POT", 4096)))
SHAPE, DEVICE = os.environ.get("SHAPE", "llama3-8b"), os.environ.get("DEVICE", "cuda")  # tiny / cpu: a smoke run


def main(out: str) -> None:
    tp = world_size()
    if tp > 1 and DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = build(SHAPE, device=DEVICE, tp_size=tp)
    vocab = model.config.vocab_size
    engine = Engine(model, IdTokenizer(vocab), method=InfiniPot(pot_size=POT), chat_template=False,
                    compile_step=os.environ.get("COMPILE") == "1")
    state = engine.prefill_ids(random_tokens(vocab, LENGTH, 1, DEVICE))
    scheduler = Scheduler(engine, max_slots=READERS)
    questions = [random_tokens(vocab, 32, 7 + i, DEVICE).tolist() for i in range(READERS)]
    run_all(scheduler, [Request(random_tokens(vocab, 256, i, DEVICE).tolist(), q, max_new_tokens=4, ignore_eos=True)
                        for i, q in enumerate(questions)])
    scheduler.capture()
    requests = [Request(None, q, state=state, max_new_tokens=10_000, ignore_eos=True) for q in questions]
    for request in requests:
        scheduler.submit(request)
    while scheduler.decoding < min(READERS, scheduler.pool.slots):  # questions read: every row decodes from here
        scheduler.step()
    for _ in range(8):
        scheduler.step()
    synchronize(DEVICE)
    begun = time.perf_counter()
    for _ in range(TIMED):
        scheduler.step()
    synchronize(DEVICE)
    step_ms = (time.perf_counter() - begun) / TIMED * 1e3
    profile = profile_ops(lambda: [scheduler.step() for _ in range(STEPS)], DEVICE, rows=30)
    for request in requests:
        request.cancel_requested = True
    scheduler.run()
    if is_rank_zero():
        record = {"tp": tp, "readers": READERS, "length": LENGTH, "compile_step": engine.compile_step,
                  "linear": engine.linear, "step_ms": step_ms, "profiled_steps": STEPS, "profile": profile,
                  "slots": scheduler.pool.slots, "slot_bytes": scheduler.slot_bytes(),
                  "machine": machine(DEVICE), "commit": os.environ.get("KVPOT_GIT_COMMIT")}
        Path(out).mkdir(parents=True, exist_ok=True)
        name = f"readers-tp{tp}{'-compiled' if engine.compile_step else ''}.json"
        Path(out, name).write_text(json.dumps(record, indent=1))
        print(f"tp {tp}: step {step_ms:.2f} ms at {READERS} readers; device {profile['device_seconds'] / STEPS * 1e3:.2f}"
              f" ms/step in {profile['kernels'] // STEPS} kernels")
        for row in profile["top_device"][:12]:
            print(f"  {row['device_ms'] / STEPS:8.3f} ms/step  {row['calls'] // STEPS:5d}x  {row['op'][:90]}")


if __name__ == "__main__":
    main(sys.argv[1])
