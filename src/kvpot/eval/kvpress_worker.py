"""kvpress presses answering `kvpot eval`'s samples, in kvpress' own interpreter: `python -m kvpot.eval.kvpress_worker`.

kvpress 0.5.x needs transformers < 5.3, older than kvpot's, so `kvpot eval --baseline kvpress` writes its
cases (token ids: the same special prefix or chat template, context, question and answer length every
kvpot method reads) to a file and starts this module with PYTHONPATH = the kvpress folder, then kvpot's
`src/` (`kvpot.eval.kvpress`, as `kvpot bench` does with `kvpot.bench.kvpress_runner`). It imports only
torch, transformers, kvpress and kvpot's light modules (`kvpot.bench.kvpress_runner`, `kvpot.compat`).

For each case and each compression ratio r, the press answers through kvpress' pipeline protocol on
token ids (`kvpot.bench.kvpress_runner.answer`): the context prefilled under `press(compression_ratio=r)`,
which keeps `int(n * (1 - r))` of its n entries per layer and KV head before the question is seen; the
question at the positions after the uncompressed context; greedy decoding until an EOS id or the case's
`max_new_tokens`. On CUDA, SDPA runs without cuDNN's attention (`kvpress_runner.attention_backends`: cuDNN
builds a plan per key length, per layer and step for PyramidKVPress); the last line says which backends ran.
Each answer is one JSON line of `--out` (the case's key, token ids, the entries each
layer kept, seconds), flushed as it finishes; the parent decodes and scores it with the case's own metric.
Answers already in `--out` (same case key and ratio: a stopped run's) are kept and not asked again.
With `--deadline S`, no answer starts unless the longest one so far fits in what is left of S seconds
(counted from this process's start, model loading included); at the deadline, or at SIGTERM, the worker
stops answering and exits normally. The last stdout line is one JSON object: the press, its settings,
versions and counts (`answers` now, `already` there, `left` unanswered, `stopped`: deadline, SIGTERM or
null), or `{"error": ..., "import_error": true}` (exit 3) when kvpress cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvpot.bench.kvpress_runner import IMPORT_ERROR_EXIT, _dist_version, answer, attention_backends
from kvpot.eval.limits import Deadline, Interrupted, Terminate, read_jsonl

#: our name -> kvpress class (presses that take `compression_ratio` and run with SDPA attention)
PRESSES = {
    "snapkv": "SnapKVPress", "expected_attention": "ExpectedAttentionPress", "streaming_llm": "StreamingLLMPress",
    "tova": "TOVAPress", "knorm": "KnormPress", "pyramidkv": "PyramidKVPress", "random": "RandomPress",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvpot.eval.kvpress_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", required=True, help="cases.jsonl written by kvpot.eval.kvpress")
    p.add_argument("--model-dir", required=True, help="a transformers model folder (or Hub id)")
    p.add_argument("--press", required=True, choices=sorted(PRESSES))
    p.add_argument("--ratios", required=True, help="compression ratios in [0, 1), e.g. 0.25,0.5,0.75")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", help="torch dtype name of the model (kvpot's rows' dtype)")
    p.add_argument("--out", required=True, help="answers.jsonl to append to (answers already there are kept)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="start no answer that would not finish within SECONDS of this process's start; then "
                        "exit normally, reporting how many (case, ratio) pairs were answered and left")
    args = p.parse_args(argv)
    try:
        args.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError:
        p.error(f"--ratios: {args.ratios!r} is not a list of numbers")
    if not args.ratios or any(not 0.0 <= r < 1.0 for r in args.ratios):
        p.error("--ratios must hold numbers in [0, 1)")
    if args.deadline is not None and args.deadline < 0:
        p.error("--deadline must be a number of seconds, at least 0")
    return args


def answer_all(args, deadline: Deadline | None = None) -> dict:
    import dataclasses

    import torch

    try:  # transformers too: its version check failing at import is the environment's fault as well
        import transformers
        from transformers import AutoModelForCausalLM

        import kvpress
    except Exception as err:  # noqa: BLE001 - any failure to import them is reported, not raised
        return {"error": f"cannot import kvpress: {type(err).__name__}: {err}".splitlines()[0][:300],
                "import_error": True}
    transformers.utils.logging.disable_progress_bar()
    press_class = getattr(kvpress, PRESSES[args.press])
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    model.set_attn_implementation("sdpa")  # kvpress' presses score from hidden states; no eager weights
    backends = attention_backends(args.device)  # no cuDNN plan to build per key length (PyramidKVPress: per layer)
    stop = Terminate()
    with stop.installed():
        counts = _answer_cases(args, lambda case, ratio: answer(
            model, press_class(compression_ratio=ratio), torch.tensor(case["context_ids"], device=args.device),
            torch.tensor(case["question_ids"], device=args.device), case["max_new_tokens"], set(case["eos_ids"])),
            deadline or Deadline(None))
    press = press_class(compression_ratio=args.ratios[0])
    settings = {k: v for k, v in dataclasses.asdict(press).items() if isinstance(v, (int, float, str, bool))} \
        if dataclasses.is_dataclass(press) else {}
    return {"press": PRESSES[args.press], "press_settings": settings, **counts, "dtype": args.dtype,
            "sdpa_backends": backends,
            "versions": {"kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
                         "transformers": transformers.__version__, "torch": torch.__version__}}


def _answer_cases(args, answer_one, deadline: Deadline) -> dict:
    """Answer every (case, ratio) not already in `args.out`, until the deadline or SIGTERM (`Interrupted`,
    from a handler the caller installed); how many were answered, already there, and left."""
    import torch

    already = {(a["key"], a["ratio"]) for a in read_jsonl(args.out, repair=True) if a.get("key") is not None}
    counts = {"answers": 0, "already": 0, "left": 0, "stopped": None}
    with open(args.cases, encoding="utf-8") as cases, open(args.out, "a", encoding="utf-8") as out:
        try:
            with torch.no_grad():
                for case in (json.loads(line) for line in cases if line.strip()):
                    for ratio in args.ratios:
                        if (case.get("key"), ratio) in already:
                            counts["already"] += 1
                            continue
                        if counts["stopped"] or not deadline.allows():
                            counts["stopped"] = counts["stopped"] or "deadline"
                            continue
                        with deadline.step():
                            tokens, kept, timings = answer_one(case, ratio)
                            out.write(json.dumps({"case": case["case"], "key": case.get("key"), "ratio": ratio,
                                                  "tokens": tokens, "kept": kept, **timings}) + "\n")
                            out.flush()
                        counts["answers"] += 1
        except Interrupted:  # a line being written may be cut: read_jsonl drops it
            counts["stopped"] = "SIGTERM"
    with open(args.cases, encoding="utf-8") as cases:  # every (case, ratio), also those never reached
        total = sum(1 for line in cases if line.strip()) * len(args.ratios)
    counts["left"] = total - counts["answers"] - counts["already"]
    return counts


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = answer_all(args, Deadline(args.deadline))
    except Exception as err:  # noqa: BLE001 - the parent reads one JSON line, whatever happened
        print(json.dumps({"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}))
        return 1
    print(json.dumps(result))
    return IMPORT_ERROR_EXIT if result.get("import_error") else 0


if __name__ == "__main__":
    sys.exit(main())
