"""The open-loop workload (`open_loop.sh`'s) twice in one process: mixed steps with the rule that a chunk that
could mix waits for the next mixed forward (`Scheduler.mix_waits = True`), and with the rule kvpot runs (such
chunks read in forwards of their own beside the mixed one). Each run's rows hold their step traces (`steps`).

    python benchmarks/engine-core-h100/mix_rule_ab.py --out DIR [kvpot bench throughput options...]

Writes DIR/waits/ and DIR/apart-after-mix/, each a `kvpot bench throughput` result folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WORKLOAD = ["--shape", "llama3-8b", "--device", "cuda", "--method", "infinipot:pot_size=4096", "--users", "48",
            "--length-mix", "2k-32k", "--new-tokens-mix", "64-256", "--arrival-rate", "1", "--seed", "0",
            "--slo-ttft", "1.5", "--slo-itl", "0.06", "--sequential-users", "1", "--mix", "on"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args, extra = p.parse_known_args(argv)
    from kvpot.cli import main as kvpot
    from kvpot.engine.scheduler import Scheduler

    Path(args.out).mkdir(parents=True, exist_ok=True)
    code, default = 0, Scheduler.mix_waits
    for name, waits in (("waits", True), ("apart-after-mix", False)):
        Scheduler.mix_waits = waits
        code |= kvpot(["bench", "throughput", *WORKLOAD, *extra, "--out", f"{args.out}/{name}"])
    Scheduler.mix_waits = default
    return code


if __name__ == "__main__":
    sys.exit(main())
