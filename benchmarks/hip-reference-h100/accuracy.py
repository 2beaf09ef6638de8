"""Issue 46, accuracy: passkey on SmolLM2-135M-Instruct with kvpot's InfiniteHiP, hip-attn 1.2.9's attention behind
kvpot's attention hook (`kvpot.bench.hip_method.HipAttn`, registered here as `hipattn`) and InfiniPot, on the same
samples, through `kvpot eval` (the protocol's templates and Wilson intervals).

Run:  PYTHONPATH=src:/tmp/hip-site python benchmarks/hip-reference-h100/accuracy.py OUT [kvpot eval options...]
e.g.  ... accuracy.py $OUT/accuracy --lengths 16k,32k --depths 0.5 --samples 1 --time-limit 150
"""

import sys

from kvpot.bench.hip_method import register
from kvpot.cli import main

METHODS = ["infinitehip", "infinitehip:scan=hip", "hipattn:case=paper", "infinipot:catalyst=question"]


def run(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    register()  # `hipattn` becomes a method name in this process
    methods = [item for name in METHODS for item in ("--method", name)]
    return main(["eval", "passkey", *methods, "--budget", "2048", "--model", "smollm2-135m", "--device", "cuda",
                 "--seed", "0", "--templates", "all", "--chat", "both", "--out", out, *rest])


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
