"""Does the needle survive eviction? Per method, layer and KV head, after the prompt is read.

For each passkey sample the prompt (context + question, as `kvpot eval` reads it) is prefilled with
each method; then every layer's cache is inspected through its entries' original positions
(`PotLayer.positions`): the share of the needle's tokens (the pass-key sentence) still held, per KV
head, and the share of its digits' tokens. The answer generated from that state is recorded too.
For methods that evict (H2O, TOVA, StreamingLLM, D2O, InfiniPot, CItruS, SnapKV) this separates
"the needle was evicted" from "the needle was kept but not used". With --trace, methods that
distill (InfiniPot) also record, after every distillation once the key has been read, the share of
the key's tokens held (mean over layers and KV heads) and the number of layers holding all of it in
every head: when the key is lost, not only whether. Writes retention.json and retention.md to --out.

    python benchmarks/real-model-smollm2/retention.py --model smollm2-135m --lengths 4k --depths 0.5 \
        --method h2o:heavy=768,recent=768,chunk_size=512 --method d2o:budget=2048 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kvpot.engine import Engine
from kvpot.eval.common import load_model, special_prefix
from kvpot.eval.config import parse_lengths, sample_seed
from kvpot.methods.spec import MethodSpec, build_methods
from kvpot.tasks import make_sample, score


def retention(cache, span: tuple[int, int], key_span: tuple[int, int] | None) -> list[dict]:
    """Per layer: share of the needle's (and the key's) positions held, per KV head."""
    rows = []
    for index, layer in enumerate(cache.layers):
        held = layer.positions[0, :, : layer.n]  # [kv, n] original positions
        per_head, key_head = [], []
        for head in held:
            present = set(head.tolist())
            per_head.append(sum(p in present for p in range(*span)) / (span[1] - span[0]))
            if key_span:
                key_head.append(sum(p in present for p in range(*key_span)) / max(1, key_span[1] - key_span[0]))
        rows.append({"layer": index, "entries": int(layer.n), "needle_kept_by_head": per_head,
                     "key_kept_by_head": key_head or None})
    return rows


def key_held(layers: list[dict]) -> tuple[float | None, int | None]:
    """(share of the key's tokens held, mean over layers and heads; layers holding all of it in every
    head) from `retention`'s rows; (None, None) when the key's tokens were not found."""
    keys = [x["key_kept_by_head"] for x in layers if x["key_kept_by_head"]]
    if not keys:
        return None, None
    return statistics.fmean(statistics.fmean(k) for k in keys), sum(all(v == 1.0 for v in k) for k in keys)


def trace_distillations(method, span, key_span, log: list) -> None:
    """Record into `log`, after each of `method.distill`'s calls, what the cache holds of the key.
    (An instance attribute over the method's own distill: this script's instrument, not kvpot's.)"""
    method.__dict__.pop("distill", None)
    if key_span is None or not hasattr(method, "distill"):
        return
    inner = method.distill

    def distill(cache, step):
        inner(cache, step)
        read = int(cache.layers[0].positions[0, :, : cache.layers[0].n].max()) + 1  # stream tokens read so far
        if read >= key_span[1]:
            kept, whole = key_held(retention(cache, span, key_span))
            log.append({"read": read, "key_kept": round(kept, 3), "layers_whole": whole})

    method.distill = distill


def key_tokens(tokenizer, ids: list[int], span: tuple[int, int], answer: str) -> tuple[int, int] | None:
    """The sub-span of the needle whose tokens spell the pass key (None if not found)."""
    start, end = span
    for a in range(start, end):
        for b in range(a + 1, end + 1):
            text = tokenizer.decode(ids[a:b])
            if answer in text:
                return (a, b)
            if len(text) > len(answer) + 8:
                break
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--gguf", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--method", action="append", required=True)
    p.add_argument("--lengths", default="4k")
    p.add_argument("--depths", default="0.5")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="base seed, as in `kvpot eval` (same samples)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--trace", action="store_true", help="after every distillation, record what is held of the key")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = build_methods([MethodSpec.parse(m) for m in args.method], None, {})
    model, tokenizer, label, device = load_model(args.model, args.device, args.dtype, gguf=args.gguf)
    prefix = special_prefix(tokenizer)
    results = {"command": sys.argv, "model": label, "rows": []}
    for length in parse_lengths(args.lengths):
        for depth in [float(d) for d in args.depths.split(",")]:
            for index in range(args.samples):
                seed = sample_seed(args.seed, index, length, depth)  # the samples `kvpot eval --seed` reads
                sample = make_sample("passkey", tokenizer, length, depth, seed)
                ids = prefix + sample.context_ids
                span = tuple(x + len(prefix) for x in sample.needle_spans[0])
                key_span = key_tokens(tokenizer, ids, span, sample.answers[0])
                for run in runs:
                    trace: list[dict] = []
                    if args.trace:
                        trace_distillations(run.method, span, key_span, trace)
                    engine = Engine(model, tokenizer, method=run.method)
                    with torch.no_grad():
                        state = engine.prefill_ids(ids, sample.question_ids)
                        layers = retention(state.cache, span, key_span)
                        out = engine.generate_ids(state=state, max_new_tokens=8).token_ids
                    answer = tokenizer.decode(out, skip_special_tokens=True)
                    row = {"method": run.spec.text(), "length": length, "depth": depth, "seed": seed,
                           "needle_span": span, "key_span": key_span, "answer": answer,
                           "correct": score(sample, answer) == 1.0, "layers": layers}
                    if args.trace:
                        row["trace"] = trace
                    results["rows"].append(row)
                    kept = statistics.fmean(statistics.fmean(r["needle_kept_by_head"]) for r in layers)
                    print(f"{run.spec.text()} {length} depth {depth} seed {seed}: answer {answer!r} "
                          f"(key {sample.answers[0]}), needle kept {kept:.2f} (mean over layers and heads)", flush=True)
                    (args.out / "retention.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "retention.md").write_text(markdown(results))
    return 0


def markdown(results: dict) -> str:
    lines = [f"model {results['model']}", "",
             "Share of the needle's tokens (pass-key sentence) and of the key's own tokens held after the prompt, "
             "mean over KV heads; per layer, then summarised.", "",
             "| method | length | depth | seed | answer | right | needle kept (mean over layers) | "
             "key tokens kept (mean) | layers holding the whole key in every head |",
             "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: |"]
    for r in results["rows"]:
        needle = statistics.fmean(statistics.fmean(x["needle_kept_by_head"]) for x in r["layers"])
        key_mean, whole = key_held(r["layers"])
        layers = len(r["layers"])
        lines.append(f"| `{r['method']}` | {r['length']:,} | {r['depth']:g} | {r['seed']} | {r['answer']!r} | "
                     f"{'yes' if r['correct'] else 'no'} | {needle:.3f} | "
                     f"{'-' if key_mean is None else f'{key_mean:.3f}'} | "
                     f"{'-' if whole is None else f'{whole}/{layers}'} |")
    traced = [r for r in results["rows"] if "trace" in r]
    if traced:
        lines += ["", "The key after each distillation (tokens read: share of its tokens held, mean over layers "
                  "and heads / layers holding all of it in every head); only where that changes:", ""]
        for r in traced:
            changes = [t for i, t in enumerate(r["trace"]) if i == 0 or
                       (t["key_kept"], t["layers_whole"]) != (r["trace"][i - 1]["key_kept"], r["trace"][i - 1]["layers_whole"])]
            steps = ", ".join(f"{t['read']:,}: {t['key_kept']:.2f} / {t['layers_whole']}" for t in changes[:12])
            lines.append(f"- `{r['method']}` {r['length']:,} depth {r['depth']:g} seed {r['seed']} "
                         f"({len(r['trace'])} distillations after the key): {steps or 'none'}"
                         f"{' ...' if len(changes) > 12 else ''}")
    lines += ["", "Per layer, needle kept (mean over heads), one column per method row above:", ""]
    if results["rows"]:
        header = "| layer | " + " | ".join(f"{r['method']} d{r['depth']:g} s{r['seed']}" for r in results["rows"]) + " |"
        lines += [header, "| ---: |" + " ---: |" * len(results["rows"])]
        for i in range(len(results["rows"][0]["layers"])):
            lines.append(f"| {i} | " + " | ".join(
                f"{statistics.fmean(r['layers'][i]['needle_kept_by_head']):.2f}" for r in results["rows"]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
