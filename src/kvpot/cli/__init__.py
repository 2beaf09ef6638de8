"""The `kvpot` command line: a thin layer over the library (`kvpot.eval`, `kvpot.bench`, `kvpot.methods.spec`).

One module per command, each with `register(subparsers)` (adds its parser, `set_defaults(func=run)`)
and `run(args) -> int`; `COMMANDS` lists them in `kvpot --help` order. Arguments shared by several
commands live in `kvpot.cli.args`. Nothing heavy (torch, transformers) is imported until a
command runs.

Errors a user can fix (missing file, unknown method or parameter, bad budget, empty context,
unsupported model) print one line on stderr and exit with code 2, never a traceback.
"""

from __future__ import annotations

import sys

from kvpot.cli import bench, demo, eval, generate, methods, report, serve
from kvpot.cli.args import EXIT_USAGE, Parser
from kvpot.errors import KvpotError

COMMANDS = [generate, methods, eval, report, demo, bench, serve]


def build_parser() -> Parser:
    parser = Parser(
        prog="kvpot",
        description="Read contexts far beyond a model's window in KV memory that does not grow with them.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not sys.stderr.isatty():
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no carriage-return bars in logs and pipes
    try:
        return args.func(args)
    except KvpotError as err:
        print(f"kvpot {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvpot: interrupted", file=sys.stderr)
        return 130


__all__ = ["COMMANDS", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
