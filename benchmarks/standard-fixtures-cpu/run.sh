#!/usr/bin/env bash
# The plumbing check of the benchmark suites: the bundled reference model on the hand-written
# fixtures under tests/fixtures/ (no benchmark data), full vs InfiniPot, on CPU.
# Usage (from the repository root): bash benchmarks/standard-fixtures-cpu/run.sh [OUT]
set -euo pipefail
OUT=${1:-records/standard-fixtures-cpu}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
python3 -m kvpot eval longbench --data-dir tests/fixtures/longbench --method full --method infinipot:pot_size=256 \
    --device cpu --out "$OUT/longbench"
python3 -m kvpot eval infinitebench --data-dir tests/fixtures/infinitebench --method full \
    --method infinipot:pot_size=256 --device cpu --out "$OUT/infinitebench"
python3 -m kvpot eval ruler --data-dir tests/fixtures/ruler --lengths 2k,3k --samples 2 --method full \
    --method infinipot:pot_size=1024 --device cpu --out "$OUT/ruler"
