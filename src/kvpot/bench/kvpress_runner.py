"""One kvpress measurement, run in its own Python process: `python -m kvpot.bench.kvpress_runner ...`.

NVIDIA's kvpress (0.5.x) needs transformers < 5.3, older than kvpot's, so `kvpot bench` runs kvpress
rows in a second interpreter whose PYTHONPATH puts a folder holding transformers 5.2 + kvpress first
(`benchmarks/kvpress-env/make_wheels.sh`; `kvpot.bench.kvpress.run_kvpress` launches this module).
This module therefore imports only what works under transformers 5.2: torch, transformers, kvpress,
and kvpot's light modules (`kvpot.models.shapes` for the random-weight model, `kvpot.bench.common`
for the token ids, `kvpot.compat` for the name the cache is passed under), never the engine.

The protocol follows kvpress' own `KVPressTextGenerationPipeline`:

1. one-shot prefill of the L-token context through the decoder (`model.model`, no LM head) into a
   `DynamicCache`, under `with press(model):` with `compression_ratio = 1 - K/L`; the press's
   forward hooks prune every layer's cache to about K entries at the end of each layer's forward;
2. the Q question tokens without the press, at position ids L..L+Q-1 (positions continue from the
   uncompressed context, as the pipeline does), `logits_to_keep=1`; its argmax is the first token
   (a press that leaves layers of different lengths, PyramidKV, gets the question token by token:
   transformers sizes one forward's mask from layer 0);
3. greedy decoding, one token at a time with explicit position ids. Each step is synchronised and
   timed on the host (HF's `generate`, and the pipeline's `.item()` EOS test, sync every step too).
   Unlike the pipeline, decoding never stops at EOS: weights are random and steps must be counted.

On CUDA, SDPA runs without cuDNN's attention (`kvpot.bench.backends`; `--sdpa default`: torch's choice), which
would build an execution plan for every new key length, i.e. inside every timed decoding step. Token ids
and weights are kvpot's bench ones (same seeds), so kvpress rows read the same inputs as kvpot's rows.
Prints one JSON object on the last stdout line; out of memory is a row with
`"error": "out of memory"` (exit 0); kvpress that cannot be imported exits 3 with `"import_error"`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvpot.bench.backends import DEFAULT_SDPA, SDPA_CHOICES, attention_backends, set_sdpa_backends
from kvpot.compat import cache_kwargs

__all__ = ["attention_backends"]  # kept here for kvpress' worker and scripts; it lives in kvpot.bench.backends

PRESSES = {  # our name -> kvpress class name (defaults of each press are kvpress' own)
    "snapkv": "SnapKVPress",
    "expected_attention": "ExpectedAttentionPress",
    "streaming_llm": "StreamingLLMPress",
    "pyramidkv": "PyramidKVPress",  # per-layer budgets: `kept` is their average (layer 0 keeps the most)
}
MODES = ("decode", "prefill")
# untimed warm-up context (as kvpot's bench: kernels, allocator, lazy inits before timing)
WARMUP_TOKENS = 4096
IMPORT_ERROR_EXIT = 3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvpot.bench.kvpress_runner",
                                description="one kvpress press measured on a kvpot bench shape (random weights)")
    p.add_argument("--shape", required=True, help="kvpot bench shape (kvpot.models.shapes)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="torch dtype name, or auto (bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--length", type=int, required=True, help="context tokens L")
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--press", required=True, choices=sorted(PRESSES))
    p.add_argument("--kept", type=int, required=True, help="KV entries per layer and head to keep (K)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=MODES, default="decode")
    p.add_argument("--sdpa", choices=SDPA_CHOICES, default=DEFAULT_SDPA,
                   help="SDPA's backends on CUDA (kvpot.bench.backends; default: no-cudnn)")
    args = p.parse_args(argv)
    for name, value, low in (("--length", args.length, 1), ("--question-tokens", args.question_tokens, 1),
                             ("--decode-steps", args.decode_steps, 1), ("--warmup-steps", args.warmup_steps, 0),
                             ("--kept", args.kept, 1)):
        if value < low:
            p.error(f"{name} must be at least {low}, got {value}")
    return args


def compression_ratio(length: int, kept: int) -> float:
    """kvpress keeps `int(L * (1 - ratio))` entries; the ratio that keeps exactly `kept` of `length`
    (1 - K/L can land a hair above K/L's complement in floating point and keep K - 1)."""
    if kept >= length:
        return 0.0
    ratio = 1.0 - kept / length
    if int(length * (1.0 - ratio)) < kept:
        ratio = 1.0 - (kept + 0.5) / length
    return ratio


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _peak(device: str):
    import torch

    return torch.cuda.max_memory_allocated(torch.device(device)) if device.startswith("cuda") else None


def _reset_peak(device: str):
    import torch

    if not device.startswith("cuda"):
        return None
    torch.cuda.reset_peak_memory_stats(torch.device(device))
    return torch.cuda.memory_allocated(torch.device(device))


def prefill(model, press, context, question, length: int):
    """Steps 1-2 of the protocol; returns (cache, first token, context seconds, question seconds)."""
    import torch
    from transformers import DynamicCache

    device = str(context.device)
    cache = DynamicCache()
    _sync(device)
    started = time.perf_counter()
    with press(model):
        model.model(input_ids=context.view(1, -1), **cache_kwargs(model.model, cache))
    _sync(device)
    context_seconds = time.perf_counter() - started
    position_ids = torch.arange(length, length + question.numel(), device=context.device).unsqueeze(0)
    if len({cache.get_seq_length(i) for i in range(len(cache))}) == 1:
        out = model(input_ids=question.view(1, -1), position_ids=position_ids, logits_to_keep=1,
                    **cache_kwargs(model, cache))
    else:  # per-layer lengths (PyramidKV): a forward of several tokens gets one mask, sized from layer 0
        for index in range(question.numel()):  # (transformers#35168), so the question goes token by token
            out = model(input_ids=question[index].view(1, 1), position_ids=position_ids[:, index : index + 1],
                        logits_to_keep=1, **cache_kwargs(model, cache))
    token = out.logits[0, -1].argmax()
    _sync(device)
    return cache, token, context_seconds, time.perf_counter() - started - context_seconds


def answer(model, press, context, question, max_new_tokens: int, eos_ids=()) -> tuple[list[int], list[int], dict]:
    """kvpress' pipeline on token ids, for accuracy: the context pruned under `press`, the question after
    it (positions continuing from the uncompressed context), then greedy tokens until an EOS id or
    `max_new_tokens`. Returns (generated ids, the context entries each layer kept, seconds of prefill
    and of decoding).

    `context` and `question`: 1-D token ids on the model's device."""
    import torch

    length = context.numel()
    cache, token, context_seconds, question_seconds = prefill(model, press, context, question, length)
    started = time.perf_counter()
    kept = [cache.get_seq_length(i) - question.numel() for i in range(len(cache))]
    tokens, position = [], length + question.numel()
    for step in range(max_new_tokens):
        tokens.append(int(token))  # synchronises the device every step, as the pipeline's EOS test does
        if tokens[-1] in eos_ids or step == max_new_tokens - 1:
            break
        out = model(input_ids=token.view(1, 1), position_ids=torch.tensor([[position + step]], device=token.device),
                    **cache_kwargs(model, cache))
        token = out.logits[0, -1].argmax()
    return tokens, kept, {"prefill_seconds": context_seconds + question_seconds,
                          "decode_seconds": time.perf_counter() - started}


def decode(model, cache, token, position: int, steps: int) -> list[float]:
    """Step 3: `steps` greedy steps from `token` at `position`; the seconds of each step."""
    import torch

    device = str(token.device)
    times = []
    for i in range(steps):
        started = time.perf_counter()
        out = model(input_ids=token.view(1, 1), position_ids=torch.tensor([[position + i]], device=token.device),
                    **cache_kwargs(model, cache))
        token = out.logits[0, -1].argmax()
        _sync(device)
        times.append(time.perf_counter() - started)
    return times


def measure(args) -> dict:
    import dataclasses

    import torch

    try:  # transformers too: a version check failing at its import is the environment's fault as well
        import transformers

        import kvpress
    except Exception as err:  # noqa: BLE001 - any failure to import them is reported, not raised
        return {"error": f"cannot import kvpress: {type(err).__name__}: {err}".splitlines()[0][:300],
                "import_error": True}

    from kvpot.bench.common import random_tokens
    from kvpot.models import shapes

    ratio = compression_ratio(args.length, args.kept)
    press = getattr(kvpress, PRESSES[args.press])(compression_ratio=ratio)
    row = {
        "method": f"kvpress:{args.press}", "press": PRESSES[args.press], "mode": args.mode, "length": args.length,
        "kept_requested": args.kept, "compression_ratio": ratio,
        "press_settings": dataclasses.asdict(press) if dataclasses.is_dataclass(press) else {},
        "question_tokens": args.question_tokens, "shape": args.shape, "device": args.device, "seed": args.seed,
        "versions": {"kvpress": getattr(kvpress, "__version__", None) or _dist_version("kvpress"),
                     "transformers": transformers.__version__, "torch": torch.__version__},
        "timing": "kvpress pipeline protocol; per-step host time after a device synchronise",
    }
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        model = shapes.build(args.shape, args.device, dtype, seed=args.seed)
        model.set_attn_implementation("sdpa")  # kvpress' presses score from hidden states; no eager weights
        row["sdpa"], row["sdpa_backends"] = args.sdpa, set_sdpa_backends(args.sdpa, args.device)
        row["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
        vocab = model.config.vocab_size
        question = random_tokens(vocab, args.question_tokens, args.seed + 1, args.device)
        steps = args.warmup_steps + args.decode_steps

        warm = min(WARMUP_TOKENS, args.length)  # untimed: same press, same ratio, a shorter context
        warm_press = getattr(kvpress, PRESSES[args.press])(compression_ratio=ratio)
        cache, token, _, _ = prefill(model, warm_press, random_tokens(vocab, warm, args.seed + 2, args.device),
                                     question, warm)
        if args.mode == "decode":
            decode(model, cache, token, warm + question.numel(), min(steps, 8))
        del cache, token
        _free(args.device)

        context = random_tokens(vocab, args.length, args.seed + args.length, args.device)
        row["memory_before_bytes"] = _reset_peak(args.device)
        cache, token, context_seconds, question_seconds = prefill(model, press, context, question, args.length)
        row["prefill_peak_memory_bytes"] = _peak(args.device)
        kv_bytes = shapes.kv_bytes_per_token(model.config, next(model.parameters()).element_size())
        per_layer = [cache.get_seq_length(i) - question.numel() for i in range(len(cache))]
        row.update({
            "prefill_seconds": context_seconds + question_seconds, "context_seconds": context_seconds,
            "question_seconds": question_seconds,
            "prefill_tokens_per_second": (args.length + question.numel()) / (context_seconds + question_seconds),
            # a press with per-layer budgets (PyramidKV) keeps the most in layer 0; its bytes are the layers' mean
            "max_kv_entries": max(per_layer), "kv_cache_bytes": round(sum(per_layer) / len(per_layer) * kv_bytes),
            "kv_entries_per_layer": per_layer,
        })
        if args.mode == "prefill":
            row["peak_memory_bytes"] = row["prefill_peak_memory_bytes"]
            return row
        _reset_peak(args.device)
        times = decode(model, cache, token, args.length + question.numel(), steps)
        timed = sorted(times[args.warmup_steps:])
        median = statistics.median(timed)
        row.update({
            "ms_per_token": 1000 * median, "ms_per_token_mean": 1000 * statistics.fmean(timed),
            "ms_per_token_p90": 1000 * timed[min(len(timed) - 1, int(0.9 * len(timed)))],
            "tokens_per_second": 1 / median if median > 0 else None, "steps": len(timed),
            "samples_ms": [1000 * t for t in times[args.warmup_steps:]],
            "decode_peak_memory_bytes": _peak(args.device), "final_kv_entries": cache.get_seq_length(0),
        })
        prefill_peak, decode_peak = row["prefill_peak_memory_bytes"], row["decode_peak_memory_bytes"]
        row["peak_memory_bytes"] = None if prefill_peak is None else max(prefill_peak, decode_peak)
        return row


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _dist_version(name: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    try:
        row = measure(args)
    except (torch.cuda.OutOfMemoryError, MemoryError) as err:
        row = {"error": "out of memory", "oom": True, "detail": (str(err).splitlines() or [""])[0][:300]}
    except Exception as err:  # noqa: BLE001 - the parent reads one JSON line, whatever happened
        row = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300]}
        print(json.dumps({"method": f"kvpress:{args.press}", "length": args.length, **row}))
        return 1
    print(json.dumps({"method": f"kvpress:{args.press}", "length": args.length, **row}))
    return IMPORT_ERROR_EXIT if row.get("import_error") else 0


if __name__ == "__main__":
    sys.exit(main())
