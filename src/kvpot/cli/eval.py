"""`kvpot eval`: compare methods on synthetic long-context tasks (or perplexity); the work is `kvpot.eval`'s."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpot.cli.args import METHOD_METAVAR, add_model_arguments
from kvpot.defaults import MIX, MIXES
from kvpot.eval.config import (
    DEFAULT_DEPTHS,
    DEFAULT_LENGTHS,
    DEFAULT_PERPLEXITY_LENGTH,
    DEFAULT_TEMPLATES,
    PERPLEXITY,
    EvalConfig,
    literal,
    parse_depths,
    parse_key_formats,
    parse_lengths,
    parse_templates,
)


def register(sub) -> None:
    """`kvpot eval TASK ...` (argparse only here: nothing heavy is imported)."""
    tasks = "passkey, niah, kv, vt, recall"
    benchmarks = "longbench, ruler, infinitebench"
    p = sub.add_parser(
        "eval",
        help="compare methods on synthetic long-context tasks (or perplexity) and write tables and figures",
        description=(
            f"Evaluate one or more methods on a synthetic task ({tasks}) at several context lengths "
            "and needle depths, every method on the same samples; or, with TASK 'perplexity', score "
            "one long text; or run a published benchmark (" + benchmarks + ") from local data files "
            "(--data-dir, --tasks). Writes results.jsonl (incrementally), summary.json, summary.md and "
            "figures (heatmap_<method>.png and accuracy.png; scores.png for benchmarks) to --out."
        ),
        epilog=(
            "examples:\n"
            "  kvpot eval passkey --method streaming --method tova --budget 1024 --lengths 4k,16k,64k "
            "--samples 5 --out runs/passkey\n"
            "  kvpot eval niah --task-set num_keys=4 --method streaming:window=1020,chunk_size=256 "
            "--method streaming:window=2044 --out runs/niah\n"
            "  kvpot eval passkey --key-formats digits,uuid,words --method full --method snapkv:budget=512 "
            "--lengths 1900 --out runs/formats\n"
            "  kvpot eval perplexity --method full --method streaming --budget 2048 --length 128k "
            "--window 4096 --out runs/ppl\n"
            "  kvpot eval longbench --data-dir data/longbench/data --tasks narrativeqa,hotpotqa "
            "--method infinipot:pot_size=4096 --out runs/longbench\n"
            "  kvpot eval ruler --lengths 4k,16k --samples 20 --data-dir data/ruler --method snapkv "
            "--budget 1024 --out runs/ruler\n"
            "  kvpot eval ruler --lengths 4k --samples 5 --method full --method snapkv --compression-ratios "
            "0.25,0.5,0.75 --baseline kvpress --press snapkv --press tova --kvpress-path /tmp/kvpress-site --out runs/rk"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("task", metavar="TASK", help=f"{tasks}, perplexity, or a benchmark: {benchmarks}")
    p.add_argument(
        "--method", action="append", default=[], metavar=METHOD_METAVAR,
        help="a method to evaluate, with optional own parameters (streaming:window=1020,chunk_size=256; "
             "budget=N sets its budget); repeat to compare several (`kvpot methods` lists them); required "
             "unless --baseline kvpress gives the columns",
    )
    p.add_argument(
        "--budget", type=int,
        help="KV entries per layer and KV head for every method; when several methods are compared, "
             "methods that take no budget (full) ignore it",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a parameter for every method (repeatable); when several are compared, it goes to the "
             "methods that have KEY",
    )
    p.add_argument("--task-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option, e.g. --task-set num_keys=4 (repeatable)")
    p.add_argument("--lengths", "--length", dest="lengths", default=None, metavar="LIST",
                   help=f"context lengths in tokens, e.g. 2k,8k,32k or 128K or 1m "
                        f"(default {DEFAULT_LENGTHS}; perplexity: one length, default {DEFAULT_PERPLEXITY_LENGTH})")
    p.add_argument("--depths", default=DEFAULT_DEPTHS, metavar="LIST",
                   help=f"needle depths as fractions of the context (default {DEFAULT_DEPTHS})")
    p.add_argument("--templates", default=DEFAULT_TEMPLATES, metavar="LIST",
                   help="prompt wordings of passkey, niah, vt and ruler's tasks to spread samples over: 'all' or "
                        "numbers such as 0,2 (default all: a score on one wording measures the wording too; "
                        "--samples is per template); other tasks have template 0 only")
    p.add_argument("--key-formats", default=None, metavar="LIST",
                   help="passkey and niah: formats of the hidden key to spread samples over, of digits, words, "
                        "uuid (passkey's key, niah's value), e.g. digits,uuid,words; --samples is per format "
                        "(default 'task': the task's own format, --task-set key_format / value_format or its "
                        "default; that format keeps its samples' seeds, so its rows are those of a run without "
                        "the option)")
    p.add_argument("--chat", choices=["both", "plain", "chat"], default=None,
                   help="synthetic tasks and ruler: read each sample as plain text, inside the model's chat "
                        "template, or both ways (default both; plain only where the tokenizer has no chat "
                        "template); --samples is per chat flag too")
    p.add_argument("--samples", type=int, default=None,
                   help="samples per length and depth (default 5); benchmarks: items per task (per length for "
                        "ruler; default: all, ruler 5)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="benchmarks: the folder of the data files (longbench: <task>.jsonl; infinitebench: "
                        "<task>.jsonl; ruler: squad.json and hotpotqa.json for qa_1/qa_2)")
    p.add_argument("--tasks", default=None, metavar="LIST",
                   help="benchmarks: tasks to run, e.g. narrativeqa,hotpotqa (default: every task whose data is "
                        "there; ruler: its synthetic tasks, plus qa_1/qa_2 when --data-dir has their files)")
    p.add_argument("--haystack", choices=["repeat", "varied"], default=None,
                   help="filler text (default: repeat for tasks, varied for perplexity)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the samples (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate per answer (default: the answer's length + 8; benchmarks: the "
                        "benchmark's own length per task)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="samples each method answers together (continuous batching over bounded caches; same "
                        "greedy answers as one at a time; default 1)")
    p.add_argument("--mix", choices=MIXES, default=MIX,
                   help="with --batch-size: read prompt chunks in the decoding rows' forward (on), in forwards of "
                        "their own (off), or auto: on a CUDA GPU (default auto; the same greedy answers in float32); "
                        "eager: on, never in the captured fixed-shape step")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant decoding (Engine(batch_invariant=True)): each sample's numbers do not depend "
                        "on the samples decoded beside it, so --batch-size N answers as --batch-size 1 in bf16 too "
                        "(fixed-tile products and attention splits, prompts read as alone; slower)")
    p.add_argument("--window", type=int, default=4096,
                   help="perplexity: report mean NLL per window of this many tokens (default 4096)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="perplexity: read only this many tokens as a prompt and feed the rest one token at a "
                        "time as decoding steps (teacher-forced generation: methods compress as they do while "
                        "generating); default: the whole text is a prompt")
    p.add_argument("--compression-ratios", default=None, metavar="LIST",
                   help="run every method that takes a budget once per ratio r (labelled NAME@r), each case with "
                        "--budget int(n * (1 - r)) of its n context tokens, as kvpress compresses (e.g. 0.25,0.5,0.75; "
                        "excludes --budget); adds ratios.png and a score-by-ratio table")
    p.add_argument("--baseline", action="append", default=[], metavar="kvpress",
                   help="kvpress: run kvpress presses (--press) at the --compression-ratios on the same cases, in "
                        "kvpress' own Python environment (--kvpress-path), scored and tabled with kvpot's methods")
    p.add_argument("--press", action="append", default=None, metavar="NAME",
                   help="a kvpress press for --baseline kvpress (repeatable; snapkv, expected_attention, "
                        "streaming_llm, tova, knorm, pyramidkv, random; default the first five)")
    p.add_argument("--kvpress-path", default=None, metavar="DIR",
                   help="the folder holding kvpress and the transformers it needs, first on the PYTHONPATH of the "
                        "process running the presses (default: $KVPOT_KVPRESS_PATH; benchmarks/kvpress-env/)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no sample (or kvpress answer) that would not finish within SECONDS of the start, "
                        "keeping ~10 s to write the summary: rows written so far are reported, and summary.json "
                        "says how many planned rows were not run (a SIGTERM ends the run the same way)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out (same options, else refused): skip samples whose rows are in "
                        "its results.jsonl and kvpress answers already given; append the rest (a folder without "
                        "a run starts fresh)")
    add_model_arguments(p)
    p.add_argument("--out", type=Path, required=True, help="folder for results (created; its parent must exist)")
    p.set_defaults(func=run)


def config_from_args(args) -> EvalConfig:
    """An EvalConfig from parsed arguments: parsing errors become one-line KvpotErrors."""
    import os

    from kvpot.errors import KvpotError
    from kvpot.eval.ratios import parse_ratios
    from kvpot.methods.spec import parse_assignments, parse_pairs
    from kvpot.tasks.suites import is_suite

    perplexity = args.task == PERPLEXITY
    suite = is_suite(args.task)
    if not args.method and not args.baseline:
        raise KvpotError("give at least one --method (or --baseline kvpress with its presses).")
    subtasks = None if args.tasks is None else [t.strip() for t in args.tasks.split(",") if t.strip()]
    lengths = args.lengths or (DEFAULT_PERPLEXITY_LENGTH if perplexity else DEFAULT_LENGTHS)
    task_options = {k: literal(v) for k, v in parse_pairs(args.task_set, "--task-set").items()}
    return EvalConfig(
        task=args.task, methods=list(args.method), out=args.out, lengths=parse_lengths(lengths),
        depths=parse_depths(args.depths), samples=args.samples if args.samples is not None or suite else 5,
        budget=args.budget, data_dir=args.data_dir, subtasks=subtasks,
        settings=parse_assignments(args.set), task_options=task_options,
        haystack=args.haystack or ("varied" if perplexity else "repeat"), seed=args.seed,
        max_new_tokens=args.max_new_tokens, window=args.window, prompt_tokens=args.prompt_tokens,
        model=args.model, device=args.device, dtype=args.dtype, device_map=args.device_map,
        max_memory=args.max_memory, gguf=args.gguf, batch_size=args.batch_size, mix=args.mix,
        batch_invariant=args.batch_invariant,
        templates=parse_templates(args.templates), key_formats=parse_key_formats(args.key_formats), chat=args.chat,
        compression_ratios=None if args.compression_ratios is None else parse_ratios(args.compression_ratios),
        baselines=[b.strip() for item in args.baseline for b in item.split(",") if b.strip()], presses=args.press,
        kvpress_path=args.kvpress_path or (os.environ.get("KVPOT_KVPRESS_PATH") if args.baseline else None) or None,
        time_limit=args.time_limit, resume=args.resume,
    )


def run(args) -> int:
    from kvpot.eval import run as run_eval
    from kvpot.eval.runner import make_runs

    config = config_from_args(args)
    if config.task != PERPLEXITY:
        make_runs(config)  # build the methods before loading a model: a typo costs nothing
    else:
        from kvpot.methods.spec import MethodSpec, build_methods

        build_methods([MethodSpec.parse(m) for m in config.methods], config.budget, config.settings)
    summary = run_eval(config, progress=True)
    stopped = (summary.get("completion") or {}).get("stopped_by")
    return 128 + 15 if stopped == "SIGTERM" else 0  # as if SIGTERM had ended it, but with its results written
