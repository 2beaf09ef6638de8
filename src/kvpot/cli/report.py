"""`kvpot report`: the documentation's result tables, rankings and figures regenerated from recorded results."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "report",
        help="regenerate the result tables and figures of README.md and docs/ from recorded results (or check them)",
        description=(
            "Render every table of a manifest (default benchmarks/readme.json) from the run folders it names "
            "(config.json + results.jsonl of kvpot eval): correct/total with 95% Wilson intervals, template, "
            "key-format and chat spreads, and ranking statements only where intervals separate. --write replaces "
            "each table's block between <!-- kvpot-readme:NAME --> and <!-- /kvpot-readme:NAME --> in the files "
            "that hold it (default: README.md and docs/*.md) and redraws the figures; --check exits 1 when a "
            "block differs from what the records give. Every table of the manifest must live in one of the "
            "files; a figure is linked relative to the file that holds its block. "
            "--plots RUN redraws a recorded run's figures (not committed) from its results.json (kvpot bench) or "
            "summary.json (kvpot eval), into the run's folder or --out; RUN may be a folder of runs."
        ),
        epilog=("examples:\n  kvpot report --write\n  kvpot report --check\n"
                "  kvpot report --check README.md docs/*.md\n"
                "  kvpot report --plots records/decode-h100/main --out /tmp/plots\n"
                "  kvpot report --plots records/d2o --out /tmp/plots"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--manifest", type=Path, default=Path("benchmarks/readme.json"),
                   help="the tables to render (default benchmarks/readme.json)")
    p.add_argument("--base", type=Path, default=None,
                   help="the folder the manifest's paths are relative to (default: the manifest's parent's parent)")
    action = p.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", type=Path, nargs="*", metavar="FILE",
                        help="rewrite the blocks of these files (default README.md and docs/*.md), and the figures")
    action.add_argument("--check", type=Path, nargs="*", metavar="FILE",
                        help="exit 1 if a block of these files (default README.md and docs/*.md) is stale")
    action.add_argument("--print", dest="show", action="store_true", help="print the rendered blocks")
    action.add_argument("--plots", type=Path, metavar="RUN",
                        help="redraw the figures of a recorded run (or of every run below a folder)")
    p.add_argument("--out", type=Path, default=None,
                   help="with --plots: write the figures here (the runs' relative folders) instead of into the runs")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvpot.errors import KvpotError
    from kvpot.eval.readme import blocks, doc_files, figures, placed, replace_blocks, stale

    if args.plots is not None:
        from kvpot.eval.plots import plot_runs

        written, runs = plot_runs(args.plots, args.out)
        print(f"drew {len(written)} figures of {len(runs)} run{'s' if len(runs) != 1 else ''} under "
              f"{args.out or args.plots}")
        return 0
    if args.out is not None:
        raise KvpotError("--out is for --plots.")
    if not args.manifest.is_file():
        raise KvpotError(f"--manifest {args.manifest} is not a file.")
    base = args.base or args.manifest.resolve().parent.parent
    if args.show:
        for name, text in blocks(args.manifest, base).items():
            print(f"<!-- {name} -->\n{text}\n")
        return 0
    files = args.write if args.write is not None else args.check
    files = files or doc_files(base)
    for target in files:
        if not target.is_file():
            raise KvpotError(f"{target} is not a file.")
    rendered = placed(args.manifest, base, files)
    if args.check is not None:
        bad = 0
        for target, mine in rendered.items():
            if not mine:
                continue
            names = stale(target.read_text(encoding="utf-8"), mine)
            if names:
                bad += 1
                print(f"{target}: stale blocks: {', '.join(names)} (run kvpot report --write {target})")
            else:
                print(f"{target}: {len(mine)} blocks match the records")
        return 1 if bad else 0
    for target, mine in rendered.items():
        if mine:
            target.write_text(replace_blocks(target.read_text(encoding="utf-8"), mine), encoding="utf-8")
            print(f"wrote {len(mine)} blocks to {target}")
    drawn = figures(args.manifest, base)
    if drawn:
        print(f"drew {len(drawn)} figures")
    return 0
