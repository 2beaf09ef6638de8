"""`kvpot bench MODE`: speed and memory of methods at real model shapes; the work is `kvpot.bench`'s."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvpot.bench.backends import DEFAULT_SDPA, SDPA_CHOICES
from kvpot.bench.config import DEFAULT_LENGTHS, MODES, BenchConfig
from kvpot.bench.load import parse_rate
from kvpot.bench.serve_config import MODE as SERVE_MODE, ServeBenchConfig
from kvpot.cli.args import (METHOD_METAVAR, QUESTIONS_HELP, add_device_arguments, add_runner_argument, add_tp_argument,
                            parse_length, parse_lengths)
from kvpot.defaults import (FEED_QUESTIONS, FEED_QUESTIONS_CHOICES, LAUNCH_AHEAD, LAUNCH_AHEADS, MIX, MIXES, PREFILL_TOKENS,
                            PROMPT_ORDER, PROMPT_ORDERS, PROMPT_PATIENCE)
from kvpot.errors import KvpotError

HIP_MODE = "hip-reference"


def register(sub) -> None:
    """`kvpot bench MODE ...` (argparse only here: nothing heavy is imported)."""
    p = sub.add_parser(
        "bench",
        help="measure speed and memory of methods at real model shapes (random weights)",
        description=(
            "Measure what methods cost at the dimensions of real models, with random weights (no download).\n"
            "  prefill    time to first token, the method's compression share, peak GPU memory, KV entries;\n"
            "             'floor' is the chunked forward without any KV cache (zero attention overhead)\n"
            "  decode     ms per generated token (median of per-step times) after a context of each length\n"
            "  attention  us per call of one layer's attention (dense SDPA vs kvpot) over a cache of each length\n"
            "  throughput many users at once: output tokens/s, TTFT and inter-token latency of kvpot's batched\n"
            "             scheduler, the same users one at a time, and (--baseline hf) transformers' continuous batching;\n"
            "             all at once or arriving over time with mixed lengths and SLOs (see open-loop load below)\n"
            "  serve      the same figures through an OpenAI-compatible HTTP server: --url drives a running one\n"
            "             (kvpot's, vLLM's, transformers serve); without --url kvpot's server is launched here for\n"
            "             each --method on --shape (or --model) and the same tokens also run through the engine directly\n"
            "  hip-reference  kvpot's InfiniteHiP beside hip-attn 1.2.9 (the authors' Triton kernels, installed apart) on\n"
            "             the same q/k/v: blocks kept per stage, output errors vs dense and vs each other, us per call\n"
            "  shapes     list the shapes (also: --list-shapes)\n"
            "A run that runs out of memory is recorded as OOM and that method's longer lengths are skipped.\n"
            "Writes results.json (raw samples, machine, versions, commit, command), summary.md and PNG plots "
            "to --out."
        ),
        epilog=(
            "examples:\n"
            "  kvpot bench prefill --shape llama3-8b --method full --method streaming --method infinipot "
            "--budget 4096 --lengths 32k,128k --device cuda --out runs/prefill\n"
            "  kvpot bench decode --shape llama3-8b --method citrus:chunk_size=256,keep=768 --lengths 32k "
            "--decode-steps 64 --out runs/decode\n"
            "  kvpot bench attention --shape llama3-8b --lengths 32k,128k,1m --out runs/attention\n"
            "  kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 64 --lengths 4k "
            "--new-tokens 128 --baseline hf --device cuda --out runs/throughput\n"
            "  kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 64 --document "
            "--lengths 128k --new-tokens 256 --device cuda --out runs/document  (one stored document, 64 readers)\n"
            "  kvpot bench serve --shape llama3-8b --device cuda --method infinipot:pot_size=4096 --users 64 "
            "--lengths 128k --document --new-tokens 256 --upload-during 32k --out runs/serve\n"
            "  kvpot bench serve --url http://127.0.0.1:8000 --users 32 --lengths 4k --new-tokens 128 --out runs/vllm  "
            "(any OpenAI-compatible server; --served-model defaults to the first of /v1/models)\n"
            "  kvpot bench prefill --shape llama3-70b --device-map auto --no-floor --method infinipot:pot_size=4096 "
            "--lengths 128k --out runs/70b  (split over every visible GPU)\n"
            "  kvpot bench prefill --shape tiny --method full --method streaming --budget 512 --lengths 1k,4k "
            "--device cpu --out runs/smoke"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("mode", nargs="?", choices=[*MODES, SERVE_MODE, HIP_MODE, "shapes"], metavar="MODE",
                   help="prefill, decode, attention, throughput, serve, hip-reference, or shapes (list the shapes)")
    p.add_argument("--list-shapes", action="store_true", help="list the shapes and exit")
    p.add_argument("--shape", default="tiny", help="model shape (default tiny; `kvpot bench shapes` lists them)")
    p.add_argument("--method", action="append", default=[], metavar=METHOD_METAVAR,
                   help="a method to measure, parsed as in `kvpot eval` (infinipot:pot_size=4096; budget=N sets its "
                        "budget); repeat to compare several. attention: optional, adds kvpot attention over each "
                        "method's cache")
    p.add_argument("--budget", type=int,
                   help="KV entries per layer and KV head for every method (methods without a budget ignore it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter for every method that has KEY (repeatable)")
    p.add_argument("--lengths", "--length", dest="lengths", default=None, metavar="LIST",
                   help=f"context lengths in tokens, e.g. 32k,128k,512k,1m, one run each (default {DEFAULT_LENGTHS}; "
                        "throughput and serve: see --length-mix for lengths mixed within one run)")
    add_device_arguments(p, dtype_help="weights, KV and q/k/v dtype (auto: bfloat16 on GPU, float32 on CPU)")
    add_tp_argument(p)
    p.add_argument("--repeats", type=int, default=1, help="prefill: timed runs per method and length (default 1)")
    p.add_argument("--decode-steps", type=int, default=64, help="decode: timed steps per length (default 64)")
    p.add_argument("--warmup-steps", type=int, default=8, help="decode: untimed steps first (default 8)")
    p.add_argument("--question-tokens", type=int, default=32,
                   help="random question tokens after the context (default 32; methods such as citrus need one)")
    p.add_argument("--no-floor", dest="floor", action="store_false", help="skip the no-cache floor")
    p.add_argument("--floor-chunk", type=int, default=2048, help="floor: tokens per chunk (default 2048)")
    p.add_argument("--block", type=int, default=128, help="attention: query rows of the prefill block (default 128)")
    p.add_argument("--min-time", type=float, default=0.2,
                   help="attention: seconds of timing per measurement (torch.utils.benchmark; default 0.2)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads (default: torch's choice); 1 gives steadier timings on a busy machine")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens (default 0)")
    p.add_argument("--breakdown", action="store_true",
                   help="decode: where a step's time goes, by part (the weights' matrix products, attention, the "
                        "other kernels around them, the logits, the method's append or eviction, sampling): 8 "
                        "uncaptured steps under torch.profiler per method and length; in summary.md and results.json")
    p.add_argument("--profile", action="store_true",
                   help="prefill and decode: one extra untimed run (decode: 8 steps) per method and length under "
                        "torch.profiler; the busiest operators (device and host time) go to results.json and "
                        "profile.md")
    p.add_argument("--baseline", action="append", default=[], metavar="NAME[,NAME]",
                   help="prefill and decode: also measure `hf` (plain transformers: one-shot prefill, DynamicCache, "
                        "greedy) and/or `kvpress` (SnapKV, ExpectedAttention, StreamingLLM and PyramidKV presses at "
                        "--budget kept entries, default 4096), on the same tokens in the same run")
    p.add_argument("--kvpress-path", type=Path, default=None, metavar="DIR",
                   help="a folder with kvpress and the transformers it needs (< 5.3), put first on the PYTHONPATH "
                        "of the process that runs the kvpress rows (default: $KVPOT_KVPRESS_PATH); without it the "
                        "kvpress rows are recorded as skipped")
    p.add_argument("--decode", default="auto", choices=["auto", "graph", "static", "eager"],
                   help="decode: kvpot's decoding path (auto: CUDA graphs on a GPU, eager on a CPU)")
    add_runner_argument(p, "each generation of `decode` (run it once with each for the two side by side)")
    p.add_argument("--compile-step", action="store_true",
                   help="decode and throughput: torch.compile the fixed-shape decoding step, one decoder layer "
                        "compiled once for every layer (norms, activations, residual adds and cache writes fused "
                        "around the weights) before it is captured, the mixed steps of `throughput` included; the "
                        "first step then takes the compilation, outside the timed steps")
    p.add_argument("--linear", default="auto", choices=["auto", "gemv", "torch"],
                   help="decode and throughput: kvpot's single-token linear layers (Engine(linear=...)): auto "
                        "(default) kvpot's Triton matrix-vector kernel on a GPU, torch elsewhere; gemv / torch "
                        "force one")
    p.add_argument("--batch-invariant", action="store_true",
                   help="decode and throughput: batch-invariant decoding (Engine(batch_invariant=True): fixed-tile "
                        "products, fixed attention splits, prompts read as alone), to measure what it costs")
    p.add_argument("--sdpa", choices=SDPA_CHOICES, default=DEFAULT_SDPA,
                   help="prefill, decode, attention, throughput: SDPA's backends on CUDA for every row of the run "
                        "(the hf and kvpress baselines, and kvpot's rows where they call SDPA). no-cudnn (default): "
                        "cuDNN's attention off, flash, memory-efficient "
                        "and math on; torch >= 2.11 on an H100 prefers cuDNN, which builds an execution plan for "
                        "every new key length, i.e. one in every decoding step of plain transformers. default: "
                        "torch's own choice, to measure what an out-of-the-box user pays. Recorded in results.json "
                        "and summary.md")
    t = p.add_argument_group("throughput")
    t.add_argument("--users", type=int, default=16, help="requests arriving together (default 16)")
    t.add_argument("--new-tokens", type=int, default=128, help="tokens each request generates, EOS off (default 128)")
    t.add_argument("--document", action="store_true",
                   help="every user asks about one stored document of --lengths tokens (read once, timed apart)")
    t.add_argument("--slots", type=int, default=None,
                   help="sequences decoding at once (default: every user, within free GPU memory)")
    t.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                   help=f"prompt tokens the scheduler reads per step between decoding steps (default {PREFILL_TOKENS})")
    t.add_argument("--sequential-users", type=int, default=None,
                   help="users the one-at-a-time row serves (default: all; fewer keeps long runs short)")
    t.add_argument("--prompt-order", choices=PROMPT_ORDERS, default=PROMPT_ORDER,
                   help="METHOD [batch] (and serve's server): which prompts a step reads first, arrival (the oldest) "
                        f"or shortest (the fewest prompt tokens left; default {PROMPT_ORDER}); recorded in each row")
    t.add_argument("--prompt-patience", type=float, default=PROMPT_PATIENCE, metavar="SECONDS",
                   help="with --prompt-order shortest: seconds after which a prompt is read before shorter ones (0: "
                        f"arrival order; inf: never; default {PROMPT_PATIENCE:g}); recorded in each row")
    t.add_argument("--launch-ahead", choices=LAUNCH_AHEADS, default=LAUNCH_AHEAD,
                   help="METHOD [batch] (and serve's server): launch a decode-only step before the previous step's "
                        "tokens are handed over, so the GPU never waits for the host between steps (on), or after (off); "
                        f"auto: on a CUDA GPU (default {LAUNCH_AHEAD}); recorded in each row")
    t.add_argument("--feed-questions", choices=FEED_QUESTIONS_CHOICES, default=FEED_QUESTIONS,
                   help="METHOD [batch] (and serve's server), with --document: " + QUESTIONS_HELP + "; recorded in each row")
    t.add_argument("--mix", choices=MIXES, default=MIX,
                   help="METHOD [batch] (and serve's server): read prompt chunks in the decoding rows' forward (on), "
                        "in forwards of their own between decoding steps (off), or auto: on a CUDA GPU, where the "
                        f"varlen kernel attends them (default {MIX}); eager: on, but never the captured fixed-shape "
                        "mixed step (to compare it with --mixed); recorded as each row's `mix`")
    t.add_argument("--mixed", action="store_true",
                   help="add a row METHOD [batch, mixed] with --mix on, to compare (the same tokens, fewer forwards)")
    t.add_argument("--prompts-apart", action="store_true",
                   help="add a row METHOD [batch, prompts apart] with --mix off, to compare")
    t.add_argument("--share-documents", action="store_true",
                   help="with --document, add a row whose readers share the stored document's entries (Scheduler "
                        "share_documents=True: one copy, cascade attention) beside METHOD [batch], a copy per reader")
    t.add_argument("--reader-room", type=int, default=None, metavar="N",
                   help="with --share-documents, tail slots in that row: a reader that never copies the document holds "
                        "N KV entries of its own (question + new tokens) instead of a whole slot, so more readers fit "
                        "(Scheduler reader_room; e.g. 288 for 256 new tokens and a 32-token question)")
    t.add_argument("--hf-timeout", type=float, default=200.0,
                   help="seconds before transformers' continuous batching is stopped and recorded unfinished "
                        "(default 200)")
    _load_arguments(p)
    _serve_arguments(p)
    _hip_arguments(p)
    p.add_argument("--out", type=Path, default=None, help="folder for results (created; its parent must exist)")
    p.set_defaults(func=run)


def _hip_arguments(p) -> None:
    h = p.add_argument_group(
        "hip-reference",
        "One layer's attention, kvpot's InfiniteHiP and hip-attn's dual_stage_quadratic_hip_attention on the same "
        "un-rotated q/k/v (hip-attn applies RoPE itself). hip-attn is loaded from its files without its package "
        "__init__s, with placeholders for what its Triton path does not use and, under a Triton other than 3.4.0, "
        "the installed triton.jit (kvpot.bench.hip_shim says how). Configurations: paper (the paper's settings, "
        "kvpot's defaults, on both sides), paper-hipscan (the same with kvpot's scan='hip'), hip-args "
        "(HiPAttentionArgs' defaults), hip-config (HiPAttentionConfig's, sglang's). The parameter mapping is in "
        "docs/methods.md. Example:\n"
        "  PYTHONPATH=/tmp/hip-site kvpot bench hip-reference --shape llama3-8b --lengths 16k,128k --hip-case paper "
        "--hip-case hip-config --device cuda --out runs/hip")
    h.add_argument("--hip-case", action="append", default=[], metavar="NAME",
                   help="a configuration run on both sides: paper, paper-hipscan, hip-args, hip-config (repeatable; "
                        "default paper). A row that raises is recorded with its error and the run goes on (exit "
                        "status 1 if any did)")
    h.add_argument("--source", default="random", choices=["random", "model"],
                   help="q/k/v: random at --shape, or one layer's captured from --model reading filler text")
    h.add_argument("--hip-layers", default="late", metavar="LIST",
                   help="early (a first layer: chunk-indexed RoPE, early_keep) and/or late (default late)")
    h.add_argument("--model-layer", type=int, default=None, help="--source model: the layer captured")
    h.add_argument("--queries", type=int, default=2048,
                   help="prefill: the last QUERIES positions as one extend call (default 2048, a kvpot chunk)")
    h.add_argument("--refresh", default="on,off", metavar="LIST",
                   help="decode: with each side's mask refresh (on) and recomputing every stage each step (off)")
    h.add_argument("--phases", default="prefill,decode", metavar="LIST", help="prefill and/or decode")


def _hip_config(args):
    from kvpot.bench.hip_run import HipReferenceConfig

    if args.out is None:
        raise KvpotError("bench hip-reference needs --out DIR, the folder for results.")

    def items(text: str) -> list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = "bfloat16" if args.dtype == "auto" and device.startswith("cuda") else (
        "float32" if args.dtype == "auto" else args.dtype)
    return HipReferenceConfig(
        out=args.out, lengths=_lengths(args), cases=args.hip_case or ["paper"], source=args.source, shape=args.shape
        if args.shape != "tiny" else "llama3-8b", model=args.model, layers=items(args.hip_layers),
        model_layer=args.model_layer, queries=args.queries, decode_steps=args.decode_steps,
        refresh=items(args.refresh), phases=items(args.phases), repeats=max(3, args.repeats), device=device,
        dtype=dtype, seed=args.seed)


def _load_arguments(p) -> None:
    """Open-loop load, for throughput and serve (kvpot.bench.load)."""
    g = p.add_argument_group(
        "open-loop load (throughput and serve)",
        "Requests arrive over time instead of all at once, ask for mixed prompt lengths and new tokens, and are "
        "judged against latency SLOs. Every latency (TTFT, ITL, end to end; p50/p95/p99) is measured from the "
        "request's own arrival. The headline workload of issue 43:\n"
        "  kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 48 --length-mix 2k-32k "
        "--new-tokens-mix 64-256 --arrival-rate 1 --slo-ttft 2 --slo-itl 0.1 --baseline hf --device cuda "
        "--out runs/open-loop")
    g.add_argument("--arrival-rate", default="inf", metavar="R",
                   help="requests per second, Poisson: the first request arrives at 0 s, each next one an "
                        "exponential gap of mean 1/R s later, drawn with --seed (default inf: all at once). "
                        "kvpot's batch submits each request between steps once it has arrived; one at a time serves "
                        "them in arrival order, each from max(its arrival, the previous end); hf adds each at its "
                        "arrival")
    g.add_argument("--length-mix", default=None, metavar="MIX",
                   help="each request's context length drawn with --seed (replaces --lengths: one run): a list "
                        "2k,8k,32k draws uniformly from the listed values, a range 2k-32k a uniform whole number "
                        "between the ends (included). The row's length is the mix's longest")
    g.add_argument("--new-tokens-mix", default=None, metavar="MIX",
                   help="each request's new tokens drawn with --seed, as --length-mix: 64,256 (listed values) or "
                        "64-256 (uniform range, ends included); replaces --new-tokens")
    g.add_argument("--slo-ttft", type=float, default=None, metavar="SECONDS",
                   help="SLO on time to first token from arrival; with --slo-itl (either alone also works): "
                        "slo_met_share = requests that finished within both, goodput = their output tokens / the "
                        "workload's wall time")
    g.add_argument("--slo-itl", type=float, default=None, metavar="SECONDS",
                   help="SLO on inter-token latency: a request meets it when the p99 of its own gaps between "
                        "tokens is within SECONDS (a request with one token meets it)")


def _serve_arguments(p) -> None:
    """`bench serve`: which server, and what its users do beyond the throughput workload's options."""
    s = p.add_argument_group("serve (also: --users, --lengths, --new-tokens, --question-tokens, --document, "
                             "--slots, --prefill-tokens and the open-loop load options)")
    s.add_argument("--url", default=None, help="a running OpenAI-compatible server, e.g. http://127.0.0.1:8000 "
                                               "(default: launch kvpot's server in this process)")
    s.add_argument("--api-key", default=None, help="--url: the server's key (default: $OPENAI_API_KEY)")
    s.add_argument("--served-model", default=None, help="--url: the model id to request (default: the first one "
                                                        "GET /v1/models lists)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="--url: send ignore_eos=true (vLLM and kvpot honour it; a launched kvpot server is sent it "
                        "whenever it accepts it)")
    s.add_argument("--model", default=None,
                   help="launched server: a checkpoint (path or Hugging Face id) instead of --shape; prompts are "
                        "then words, lengths approximate")
    s.add_argument("--upload-during", default=None, metavar="TOKENS",
                   help="upload another document of TOKENS tokens (e.g. 32k) once every user decodes, and report "
                        "the inter-token latency while it is read")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")


def serve_config_from_args(args) -> ServeBenchConfig:
    from kvpot.methods.spec import parse_assignments

    if args.out is None:
        raise KvpotError("bench serve needs --out DIR, the folder for results.")
    if args.device_map or args.max_memory or args.tp != 1:
        raise KvpotError("bench serve launches its server on one device (--device); --device-map and --tp are not "
                         "supported (measure a `kvpot serve --tp N` started with torchrun through --url).")
    return ServeBenchConfig(
        out=args.out, url=args.url, api_key=args.api_key, served_model=args.served_model, ignore_eos=args.ignore_eos,
        shape=args.shape, model=args.model, methods=list(args.method), budget=args.budget,
        settings=parse_assignments(args.set), device=args.device, dtype=args.dtype, decode=args.decode,
        slots=args.slots, prefill_tokens=args.prefill_tokens, mix=args.mix, prompt_order=args.prompt_order,
        prompt_patience=args.prompt_patience, launch_ahead=args.launch_ahead, feed_questions=args.feed_questions,
        threads=args.threads, seed=args.seed,
        lengths=_lengths(args), users=args.users, new_tokens=args.new_tokens,
        question_tokens=args.question_tokens, document=args.document,
        upload_during=None if args.upload_during is None else parse_length(args.upload_during), timeout=args.timeout,
        **_load_options(args),
    )


def config_from_args(args) -> BenchConfig:
    from kvpot.methods.spec import parse_assignments
    from kvpot.models.support import resolve_placement

    if args.out is None:
        raise KvpotError(f"bench {args.mode} needs --out DIR, the folder for results.")
    from kvpot.engine.one_slot import check_runner

    check_runner(args.runner, args.decode)  # (before a model loads)
    device, device_map, max_memory = resolve_placement(args.device, args.device_map, args.max_memory, args.tp)
    return BenchConfig(
        mode=args.mode, shape=args.shape, out=args.out, methods=list(args.method), lengths=_lengths(args),
        budget=args.budget, settings=parse_assignments(args.set), device=device, device_map=device_map,
        max_memory=max_memory, dtype=args.dtype, repeats=args.repeats, decode_steps=args.decode_steps,
        warmup_steps=args.warmup_steps,
        question_tokens=args.question_tokens, floor=args.floor, floor_chunk=args.floor_chunk, block=args.block,
        min_time=args.min_time, threads=args.threads, seed=args.seed, profile=args.profile,
        breakdown=args.breakdown, decode=args.decode, runner=args.runner,
        compile_step=args.compile_step, linear=args.linear, batch_invariant=args.batch_invariant,
        baselines=[b.strip() for item in args.baseline for b in item.split(",") if b.strip()],
        kvpress_path=args.kvpress_path or os.environ.get("KVPOT_KVPRESS_PATH") or None,
        users=args.users, new_tokens=args.new_tokens, document=args.document, slots=args.slots,
        prefill_tokens=args.prefill_tokens, sequential_users=args.sequential_users, hf_timeout=args.hf_timeout,
        mix=args.mix, mixed=args.mixed, prompts_apart=args.prompts_apart, share_documents=args.share_documents, tp=args.tp,
        reader_room=args.reader_room,
        prompt_order=args.prompt_order, prompt_patience=args.prompt_patience, launch_ahead=args.launch_ahead,
        feed_questions=args.feed_questions, sdpa=args.sdpa, **_load_options(args),
    )


def _lengths(args) -> list[int]:
    if args.lengths is not None and args.length_mix is not None:
        raise KvpotError("give --lengths (one run per length) or --length-mix (lengths drawn per request), not both.")
    return parse_lengths(args.lengths or DEFAULT_LENGTHS)


def _load_options(args) -> dict:
    if args.mode not in ("throughput", SERVE_MODE) and (
            args.arrival_rate != "inf" or args.length_mix or args.new_tokens_mix or args.slo_ttft or args.slo_itl):
        raise KvpotError("--arrival-rate, --length-mix, --new-tokens-mix, --slo-ttft and --slo-itl apply to bench "
                         "throughput and bench serve.")
    return {"arrival_rate": parse_rate(args.arrival_rate), "length_mix": args.length_mix,
            "new_tokens_mix": args.new_tokens_mix,
            "slo_ttft": args.slo_ttft, "slo_itl": args.slo_itl}


def run(args) -> int:
    if args.list_shapes or args.mode == "shapes":
        from kvpot.bench.shapes import list_shapes

        list_shapes()
        return 0
    if args.mode is None:
        raise KvpotError("give a mode: prefill, decode, attention, throughput, serve or shapes (kvpot bench --help).")
    if args.mode == SERVE_MODE:
        return _run_serve(args)
    if args.mode == HIP_MODE:
        from kvpot.bench.hip_run import run_hip_reference

        results = run_hip_reference(_hip_config(args))
        if results["errors"]:
            print(f"hip-reference: {results['errors']} of {len(results['rows'])} rows raised (recorded in their rows)",
                  file=sys.stderr)
        return 1 if results["errors"] else 0
    config = config_from_args(args)
    from kvpot.bench import run_bench

    if config.methods:  # a typo costs nothing: build the methods before the model
        from kvpot.methods.spec import MethodSpec, build_methods

        build_methods([MethodSpec.parse(m) for m in config.methods], config.budget, config.settings)
    run_bench(config, progress=True)
    return 0


def _run_serve(args) -> int:
    config = serve_config_from_args(args)
    from kvpot.bench.serve_client import require_openai

    require_openai()  # before a model is built
    if config.methods:  # a typo costs nothing: build the methods before the model
        from kvpot.methods.spec import MethodSpec, build_methods

        build_methods([MethodSpec.parse(m) for m in config.methods], config.budget, config.settings)
    from kvpot.bench.serve import run_serve_bench

    run_serve_bench(config, progress=True)
    return 0
