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
`max_new_tokens`. Each answer is one JSON line of `--out` (token ids, the entries each layer kept,
seconds), flushed as it finishes; the parent decodes and scores it with the case's own metric. The
last stdout line is one JSON object: the press, its settings, versions and counts, or
`{"error": ..., "import_error": true}` (exit 3) when kvpress cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvpot.bench.kvpress_runner import IMPORT_ERROR_EXIT, _dist_version, answer

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
    p.add_argument("--out", required=True, help="answers.jsonl to write")
    args = p.parse_args(argv)
    try:
        args.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError:
        p.error(f"--ratios: {args.ratios!r} is not a list of numbers")
    if not args.ratios or any(not 0.0 <= r < 1.0 for r in args.ratios):
        p.error("--ratios must hold numbers in [0, 1)")
    return args


def answer_all(args) -> dict:
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
    done = 0
    with open(args.cases, encoding="utf-8") as cases, open(args.out, "w", encoding="utf-8") as out, torch.no_grad():
        for line in cases:
            if not line.strip():
                continue
            case = json.loads(line)
            context = torch.tensor(case["context_ids"], device=args.device)
            question = torch.tensor(case["question_ids"], device=args.device)
            for ratio in args.ratios:
                tokens, kept, timings = answer(model, press_class(compression_ratio=ratio), context, question,
                                               case["max_new_tokens"], set(case["eos_ids"]))
                out.write(json.dumps({"case": case["case"], "ratio": ratio, "tokens": tokens, "kept": kept,
                                      **timings}) + "\n")
                out.flush()
                done += 1
    press = press_class(compression_ratio=args.ratios[0])
    settings = {k: v for k, v in dataclasses.asdict(press).items() if isinstance(v, (int, float, str, bool))} \
        if dataclasses.is_dataclass(press) else {}
    return {"press": PRESSES[args.press], "press_settings": settings, "answers": done, "dtype": args.dtype,
            "versions": {"kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
                         "transformers": transformers.__version__, "torch": torch.__version__}}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = answer_all(args)
    except Exception as err:  # noqa: BLE001 - the parent reads one JSON line, whatever happened
        print(json.dumps({"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}))
        return 1
    print(json.dumps(result))
    return IMPORT_ERROR_EXIT if result.get("import_error") else 0


if __name__ == "__main__":
    sys.exit(main())
