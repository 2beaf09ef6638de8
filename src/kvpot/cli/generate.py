"""`kvpot generate`: read a long context with a method and answer a question about it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvpot.cli.args import (add_decode_argument, add_method_arguments, add_model_arguments, add_runner_argument,
                            add_tp_argument, check_batch_invariant)
from kvpot.errors import KvpotError

# Without --method: InfiniPot (bounded at every instant of prefill and decoding) with a pot of
# 4,096 entries per layer and KV head, or of --budget entries when one is given.
DEFAULT_METHOD = "infinipot"
DEFAULT_POT = 4096


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="read a long context with a method and answer a question about it",
        description=(
            "Read a context (from --context, --context-file, or '-' for stdin) with a KV-cache "
            "method, then stream the model's answer to --question. Memory stays within the "
            f"method's bound however long the context is. Without --method: {DEFAULT_METHOD} with a "
            f"{DEFAULT_POT:,}-entry pot (or --budget entries)."
        ),
        epilog=(
            "examples:\n"
            "  kvpot generate --method streaming --budget 1024 --context-file report.txt "
            "--question 'What was decided?'\n"
            "  kvpot generate --method infinipot:pot_size=1024 --context-file report.txt --question 'Who signed?'\n"
            "  cat log.txt | kvpot generate --model Qwen/Qwen2.5-7B-Instruct --device cuda "
            "--method snapkv --budget 4096 --question 'Which service failed first?' --json -"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(p)
    add_tp_argument(p)
    add_decode_argument(p)
    add_runner_argument(p)
    add_method_arguments(
        p, required=False,
        method_help="compression method, e.g. infinipot, streaming, snapkv, with optional own parameters "
                    f"(infinipot:pot_size=1024); default {DEFAULT_METHOD} with a {DEFAULT_POT}-entry pot. "
                    "`kvpot methods` lists all and their parameters",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--context", help="the context text itself")
    source.add_argument("--context-file", type=Path, help="read the context from this file (UTF-8)")
    source.add_argument("stdin", nargs="?", choices=["-"], help="'-': read the context from standard input")
    p.add_argument("--question", default=None, help="question or instruction asked after the context")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); >0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with --temperature)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument(
        "--chat-template", default="auto", choices=["auto", "on", "off"],
        help="wrap context and question in the tokenizer's chat template (auto: if it has one)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object: text, stats, method, model")
    p.set_defaults(func=run)


def read_context(args) -> str:
    if args.context is not None:
        text = args.context
    elif args.context_file is not None:
        try:
            text = args.context_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KvpotError(f"--context-file {args.context_file}: no such file.") from None
        except (OSError, UnicodeDecodeError) as err:
            raise KvpotError(f"--context-file {args.context_file}: cannot read it as UTF-8 text ({err}).") from None
    else:
        text = sys.stdin.read()
    if not text.strip():
        raise KvpotError("the context is empty; give some text to read.")
    return text


def build_method(args):
    """(method, label): the method of `--method` (a spec, as in every command), or the default."""
    from kvpot.methods.spec import build_method as build, parse_assignments

    settings = parse_assignments(args.set)
    if args.method is None:
        budget = DEFAULT_POT if args.budget is None else args.budget
        method = build(DEFAULT_METHOD, budget, settings)
        return method, f"{DEFAULT_METHOD}, pot_size={method.pot_size} (default method; choose with --method)"
    return build(args.method, args.budget, settings), args.method


def run(args) -> int:
    if args.max_new_tokens < 0:
        raise KvpotError("--max-new-tokens must be >= 0.")
    check_batch_invariant(args)
    from kvpot.engine.one_slot import check_runner

    check_runner(args.runner, args.decode)  # (before a model loads)
    method, label = build_method(args)  # validate cheap things before loading a model
    context = read_context(args)
    from kvpot.engine import Engine
    from kvpot.models import model_label, resolve_dtype, resolve_model
    from kvpot.models.support import resolve_placement

    template = {"auto": "auto", "on": True, "off": False}[args.chat_template]
    device, device_map, max_memory = resolve_placement(args.device, args.device_map, args.max_memory, args.tp)
    engine = Engine.from_pretrained(
        resolve_model(args.model, args.gguf), method=method, device=device, dtype=resolve_dtype(args.dtype),
        chat_template=template, device_map=device_map, max_memory=max_memory, gguf_file=args.gguf,
        decode=args.decode, compile_step=args.compile_step, linear=args.linear, tp_size=args.tp,
        batch_invariant=args.batch_invariant, runner=args.runner,
    )
    from kvpot.models.parallel import is_rank_zero

    quiet = not is_rank_zero()  # under torchrun every rank generates the same tokens; rank 0 prints them
    stream = None if args.json or quiet else (lambda piece: print(piece, end="", flush=True))
    result = engine.generate(
        context, question=args.question, max_new_tokens=args.max_new_tokens, on_text=stream,
        progress=sys.stderr.isatty(), temperature=args.temperature, top_p=args.top_p, seed=args.seed,
    )
    if quiet:
        return 0
    if args.json:
        payload = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats.to_dict(),
                   "method": method.config(), "method_spec": label, "model": model_label(args.model, args.gguf)}
        print(json.dumps(payload, indent=2))
    else:
        print()
        s = result.stats
        print(
            f"[{label}] context {s.context_tokens} tokens, max KV entries {s.max_kv_entries}, "
            f"{s.compressions} compressions, prefill {s.prefill_seconds:.2f}s, decode {s.decode_seconds:.2f}s",
            file=sys.stderr,
        )
    return 0
