"""Readers of a shared document against readers with a copy each, on a real model (issue 48's exactness target: on
SmolLM2-135M in bf16, >= 95% of answers identical texts, shared against copy-per-reader).

Each method reads `--documents` passkey documents once (`Engine.prefill`). Then `--readers` questions per document
are answered twice, in one batch each (`Engine.generate_batch(states=...)`, greedy):
- with a copy of the document's entries in every reader's slot;
- with the entries read from one shared copy (`share_documents=True`, the cascade attention).

The questions are the passkey's own and a few others about the same document. In float32 on a CPU the two are equal
by construction (the tests check the tokens). In bf16 the cascade kernel sums a reader's attention in two segments,
so a near-tie between two tokens can go either way. This counts how often the texts part. With `--batch-invariant`
both paths run `Engine(batch_invariant=True)`: a shared reader then reads its question apart over the document and
decodes through the decode kernel at its fixed splits, reading the document's entries where they are (a joined
region, `kvpot.engine.documents`), which should give the copied reader's texts exactly.

    python benchmarks/shared-document-h100/agreement.py --out DIR [--model smollm2-135m] [--device cuda]
        [--dtype bfloat16] [--method infinipot --method streaming ...] [--length 4k] [--documents 4] [--readers 8]
        [--reader-room 64] [--batch-invariant]

Writes DIR/agreement.json (per method: identical answers, the 95% Wilson interval, passkey accuracy of both
paths, each differing pair's texts) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# CItruS reads a stored document without its instruction cache: the question is not known while it is read
METHODS = ["infinipot", "streaming", "h2o", "tova", "snapkv", "citrus:cache=none"]
# asked of every document beside its own passkey question (a reader's question is its private tail)
OTHER_QUESTIONS = [
    "What is the pass key? Answer with the number only.",
    "Repeat the pass key twice.",
    "What is the text above about?",
    "Summarize the text above in one sentence.",
    "Which number appears in the text?",
    "What is the first sentence of the text?",
    "Is there a pass key in the text? Answer yes or no.",
]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--method", action="append", help=f"repeatable; default: {', '.join(METHODS)}")
    p.add_argument("--budget", type=int, default=1024, help="each method's KV budget (default 1,024)")
    p.add_argument("--length", default="4k", help="document length in tokens (4k, 8192, ...)")
    p.add_argument("--documents", type=int, default=4, help="documents (at most the scheduler's 4 shared rows)")
    p.add_argument("--readers", type=int, default=8, help="questions asked of each document")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reader-room", type=int, default=None,
                   help="the shared readers hold tail slots of this many entries (Scheduler(reader_room=...))")
    p.add_argument("--batch-invariant", action="store_true",
                   help="both paths under Engine(batch_invariant=True): shared readers join the document region "
                        "(kvpot.engine.documents) and should give the copied readers' texts exactly")
    args = p.parse_args(argv)
    import torch

    from kvpot import Engine
    from kvpot.errors import KvpotError
    from kvpot.eval.config import parse_length
    from kvpot.eval.stats import wilson_interval
    from kvpot.methods.spec import MethodSpec, build_method, takes_budget

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    length = parse_length(args.length)
    if not 1 <= args.documents <= 4:
        raise SystemExit("--documents: 1 to 4 (the scheduler loads 4 shared documents at once by default)")
    report = {"args": vars(args) | {"out": str(args.out)}, "device": torch.cuda.get_device_name() if device == "cuda"
              else "cpu", "dtype": str(dtype), "methods": {}}
    engine = None
    for name in args.method or METHODS:
        # a method with no budget (`full`, `truncate`) holds the whole document
        method = build_method(name, budget=args.budget if takes_budget(MethodSpec.parse(name).name) else None)
        if engine is None:
            engine = Engine.from_pretrained(args.model, method=method, device=device, dtype=dtype,
                                            batch_invariant=args.batch_invariant)
        else:  # one model for every method
            engine = Engine(engine.model, engine.tokenizer, method=method, batch_invariant=args.batch_invariant)
        try:
            report["methods"][name] = compare(engine, args, length)
        except KvpotError as error:  # said, and the other methods still run
            report["methods"][name] = {"error": str(error)}
            print(f"{name:12s} error: {error}", flush=True)
    done = [m for m in report["methods"].values() if "error" not in m]
    total, count = sum(m["identical"] for m in done), sum(m["answers"] for m in done)
    report["identical"], report["answers"] = total, count
    report["interval95"] = list(wilson_interval(total, count)) if count else None
    print(f"all          identical {total}/{count}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "agreement.json").write_text(json.dumps(report, indent=1))


def compare(engine, args, length: int) -> dict:
    """One method's answers, copied and shared, compared."""
    from kvpot.eval.stats import wilson_interval
    from kvpot.tasks.generators import make_sample

    name = engine.method.name
    began = time.perf_counter()
    states, questions, keys = [], [], []
    for d in range(args.documents):
        sample = make_sample("passkey", engine.tokenizer, length, depth=(d + 1) / (args.documents + 1), seed=d)
        state = engine.prefill(sample.context)
        asked = [sample.question, *OTHER_QUESTIONS][: args.readers]
        asked += [f"{sample.question} ({i})" for i in range(args.readers - len(asked))]
        states += [state] * len(asked)
        questions += asked
        keys += [sample.answers[0] if i < 2 else None for i in range(len(asked))]  # the two that ask for it
    answers, sharing = {}, {}
    for shared in (False, True):
        answers[shared], sharing[shared] = answer(engine, states, questions, args, shared)
    same = sum(a == b for a, b in zip(answers[False], answers[True]))
    low, high = wilson_interval(same, len(questions))
    passkey = {label: sum(key in text for key, text in zip(keys, answers[shared]) if key is not None)
               for label, shared in (("copied", False), ("shared", True))}
    result = {
        "answers": len(questions), "identical": same, "interval95": [low, high],
        "passkey_correct": passkey, "passkey_questions": sum(k is not None for k in keys),
        "seconds": time.perf_counter() - began, "sharing": sharing[True], "copied_sharing": sharing[False],
        "examples": [{"question": q, "key": k, "copied": a} for q, k, a in
                     list(zip(questions, keys, answers[False]))[: args.readers]],
        "differing": [{"question": q, "copied": a, "shared": b}
                      for q, a, b in zip(questions, answers[False], answers[True]) if a != b]}
    print(f"{name:12s} identical {same}/{len(questions)} [{low:.3f}, {high:.3f}]  passkey copied "
          f"{passkey['copied']} shared {passkey['shared']} of {result['passkey_questions']}  shared run: "
          f"{sharing[True].get('document_loads', 0)} loads, {sharing[True].get('copy_on_write', 0)} copies on write",
          flush=True)
    return result


def answer(engine, states, questions, args, shared: bool) -> tuple[list[str], dict]:
    """One batch of every (state, question), copied or shared (what `Engine.generate_batch` runs, with the
    scheduler at hand so that its sharing counts can be kept: a shared run that copied every reader would
    agree trivially)."""
    from kvpot.engine.offline import group_capacity
    from kvpot.engine.requests import Request
    from kvpot.engine.scheduler import Scheduler
    from kvpot.errors import KvpotError

    requests = [Request(None, engine.encode(None, q)[1], state=s, max_new_tokens=args.new_tokens)
                for s, q in zip(states, questions)]
    scheduler = Scheduler(engine, slots=len(states), capacity=group_capacity(engine, requests),
                          share_documents=shared, reader_room=args.reader_room if shared else None)
    for request in requests:
        scheduler.submit(request)
    scheduler.run()
    failed = [r.error for r in requests if r.status == "failed"]
    if failed:
        raise KvpotError(f"{len(failed)} readers failed; the first: {failed[0]}")
    keep = ("shared_documents", "document_loads", "tail_slot_readers", "copy_on_write")
    counts = {k: v for k, v in scheduler.report.items() if k in keep or k.startswith("copy_on_write_")}
    return [r.result(engine.tokenizer).text for r in requests], counts


if __name__ == "__main__":
    main()
