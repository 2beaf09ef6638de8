"""kvpress on the samples `kvpot eval` reads: SmolLM2 (or any model folder), passkey/niah, same seeds.

kvpress 0.5.5 needs transformers < 5.3 and kvpot a newer one, so this runs in two steps, in two
environments (`benchmarks/kvpress-env/`):

1. `cases` (kvpot's environment): the samples of `kvpot eval TASK --seed S --lengths ... --depths ...
   --samples N` as token ids (the same prompt prefix, context, question, answers and max new tokens).
2. `answer` (kvpress' environment: PYTHONPATH=/tmp/kvpress-site:$PWD/src): each press answers every
   case through kvpress' pipeline protocol on token ids (`kvpot.bench.kvpress_runner.answer`: the
   context pruned to `--kept` entries per layer and head before the question is seen, then the
   question, greedy decoding until EOS). Writes a folder per press that `tables.py` merges with
   kvpot eval's folders: config.json (methods, task, lengths, depths, samples) and results.jsonl
   (prediction, score by kvpot's metric, kept entries, seconds).

    python benchmarks/real-model-smollm2/kvpress_eval.py cases --model smollm2-135m --task passkey \\
        --lengths 4k,16k --depths 0.1,0.5,0.9 --samples 5 --seed 0 --out cases.jsonl
    PYTHONPATH=/tmp/kvpress-site:$PWD/src python benchmarks/real-model-smollm2/kvpress_eval.py answer \\
        --cases cases.jsonl --model-dir DIR --press snapkv --kept 2048 --device cuda --out runs/kvpress-snapkv

`--model-dir` is a plain transformers folder: for SmolLM2, the one kvpot de-quantized the GGUF into
(`kvpot.models.resolve_source(SMOLLM2_135M)`, printed by `cases`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PRESSES = {"snapkv": "SnapKVPress", "expected_attention": "ExpectedAttentionPress",
           "streaming_llm": "StreamingLLMPress", "tova": "TOVAPress", "knorm": "KnormPress"}


def cases(args) -> int:
    from kvpot.eval.common import special_prefix
    from kvpot.eval.config import EvalConfig
    from kvpot.eval.runner import task_cases

    config = EvalConfig(task=args.task, methods=["full"], model=args.model, lengths=args.lengths,
                        depths=args.depths, samples=args.samples, seed=args.seed, device="cpu", out=args.out.parent)
    from transformers import AutoTokenizer

    from kvpot.models import resolve_source

    path = resolve_source(config.model)  # a plain transformers folder (de-quantized GGUF) or a Hub id
    tokenizer = AutoTokenizer.from_pretrained(path)
    prefix = special_prefix(tokenizer)
    count, produced = task_cases(config, tokenizer, prefix)
    eos = tokenizer.eos_token_id
    with open(args.out, "w", encoding="utf-8") as out:
        for case in produced:
            out.write(json.dumps({"context_ids": case.context_ids, "question_ids": case.question_ids,
                                  "answers": case.answers, "row": case.row, "eos_ids": [] if eos is None else [eos],
                                  "max_new_tokens": case.max_new_tokens,
                                  "config": {"task": config.task, "lengths": config.lengths, "depths": config.depths,
                                             "samples": config.samples, "seed": config.seed}}) + "\n")
    print(f"{count} cases of {args.task} in {args.out}; model folder: {path}")
    return 0


def answer(args) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kvpress
    from kvpot.bench.kvpress_runner import answer as kvpress_answer
    from kvpot.bench.kvpress_runner import compression_ratio
    from kvpot.tasks.metrics import score

    transformers.utils.logging.disable_progress_bar()
    rows = [json.loads(line) for line in args.cases.read_text().splitlines() if line.strip()]
    if not rows:
        sys.exit(f"no cases in {args.cases}")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(args.device).eval()
    model.set_attn_implementation("sdpa")
    label = f"kvpress:{args.press}:kept={args.kept}"
    press_class = getattr(kvpress, PRESSES[args.press])
    args.out.mkdir(parents=True, exist_ok=True)
    config = rows[0]["config"]
    header = {"model": str(args.model_dir), "config": config, "kept": args.kept,
              "methods": {label: {"spec": label, "press": PRESSES[args.press]}},
              "versions": {"kvpress": getattr(kvpress, "__version__", None), "transformers": transformers.__version__,
                           "torch": torch.__version__}, "dtype": str(dtype).removeprefix("torch."),
              "protocol": "kvpress pipeline on token ids: context pruned under the press without the question, "
                          "question at positions after the uncompressed context, greedy until EOS"}
    (args.out / "config.json").write_text(json.dumps(header, indent=2))
    with open(args.out / "results.jsonl", "w", encoding="utf-8") as results, torch.no_grad():
        for case in rows:
            context = torch.tensor(case["context_ids"], device=args.device)
            question = torch.tensor(case["question_ids"], device=args.device)
            press = press_class(compression_ratio=compression_ratio(context.numel(), args.kept))
            started = time.perf_counter()
            tokens, kept = kvpress_answer(model, press, context, question, case["max_new_tokens"],
                                          eos_ids=set(case["eos_ids"]))
            seconds = time.perf_counter() - started
            prediction = tokenizer.decode(tokens, skip_special_tokens=True)
            value = score(config["task"], prediction, case["answers"])
            results.write(json.dumps({
                "method": label, "method_name": "kvpress", **case["row"], "answers": case["answers"],
                "prediction": prediction, "score": value, "correct": value == 1.0,
                "stats": {"max_kv_entries": max(kept), "kv_entries_per_layer": kept, "prefill_seconds": seconds,
                          "decode_seconds": None, "compression_ratio": press.compression_ratio},
            }) + "\n")
            results.flush()
    print(f"{label}: {len(rows)} cases -> {args.out}/results.jsonl")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    c = sub.add_parser("cases", help="kvpot's environment: the samples of `kvpot eval` as token ids")
    c.add_argument("--model", default="smollm2-135m")
    c.add_argument("--task", default="passkey", choices=["passkey", "niah"])
    c.add_argument("--lengths", required=True, help="e.g. 4k,16k")
    c.add_argument("--depths", default="0.1,0.5,0.9")
    c.add_argument("--samples", type=int, default=5)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", type=Path, required=True, help="cases.jsonl to write")
    a = sub.add_parser("answer", help="kvpress' environment: one press answers every case")
    a.add_argument("--cases", type=Path, required=True)
    a.add_argument("--model-dir", type=Path, required=True, help="a transformers model folder")
    a.add_argument("--press", required=True, choices=sorted(PRESSES))
    a.add_argument("--kept", type=int, required=True, help="context entries per layer and KV head the press keeps")
    a.add_argument("--device", default="cuda")
    a.add_argument("--out", type=Path, required=True, help="folder for config.json and results.jsonl")
    args = p.parse_args(argv)
    if args.step == "cases":
        from kvpot.eval.config import parse_depths, parse_lengths

        args.lengths, args.depths = parse_lengths(args.lengths), parse_depths(args.depths)
        return cases(args)
    if args.kept < 1:
        p.error("--kept must be at least 1")
    return answer(args)


if __name__ == "__main__":
    sys.exit(main())
