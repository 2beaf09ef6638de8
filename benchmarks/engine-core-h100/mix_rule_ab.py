"""The open-loop workload (`open_loop.sh`'s) twice in one process, with and without one of the scheduler's rules for
mixed steps. Each run's rows hold their step traces (`steps`).

- `--rule waits` (the default): a chunk that could mix waits for the next mixed forward (`Scheduler.mix_waits =
  True`, off in kvpot) against such chunks read in forwards of their own beside the mixed one. Writes DIR/waits/ and
  DIR/apart-after-mix/.
- `--rule rides`: a decoding row whose method reshapes its cache at this token rides in the mixed forward as a
  one-token chunk (`Scheduler.rides = True`, kvpot's default) against a forward of its own between steps. Writes
  DIR/rides/ and DIR/alone/.

    python benchmarks/engine-core-h100/mix_rule_ab.py --out DIR [--rule waits|rides] [kvpot bench throughput options...]

Options after the script's own are passed to `kvpot bench throughput` after the workload's, so they override it
(e.g. `--shape tiny --device cpu --users 8 ...` for a CPU run that counts forwards); a `--method` given replaces the
workload's (`--method` adds rows otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

WORKLOAD = ["--shape", "llama3-8b", "--device", "cuda", "--method", "infinipot:pot_size=4096", "--users", "48",
            "--length-mix", "2k-32k", "--new-tokens-mix", "64-256", "--arrival-rate", "1", "--seed", "0",
            "--slo-ttft", "1.5", "--slo-itl", "0.06", "--sequential-users", "1", "--mix", "on"]
RULES = {"waits": ("mix_waits", (("waits", True), ("apart-after-mix", False))),
         "rides": ("rides", (("rides", True), ("alone", False)))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--rule", choices=sorted(RULES), default="waits")
    args, extra = p.parse_known_args(argv)
    from kvpot.cli import main as kvpot
    from kvpot.engine.scheduler import Scheduler

    Path(args.out).mkdir(parents=True, exist_ok=True)
    attribute, runs = RULES[args.rule]
    at = WORKLOAD.index("--method")  # a `--method` given replaces the workload's `--method NAME`
    workload = WORKLOAD if "--method" not in extra else WORKLOAD[:at] + WORKLOAD[at + 2 :]
    code, default = 0, getattr(Scheduler, attribute)
    try:
        for name, value in runs:
            setattr(Scheduler, attribute, value)
            code |= kvpot(["bench", "throughput", *workload, *extra, "--out", f"{args.out}/{name}"])
    finally:
        setattr(Scheduler, attribute, default)
    return code


if __name__ == "__main__":
    sys.exit(main())
