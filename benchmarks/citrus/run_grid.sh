#!/usr/bin/env bash
# CItruS (l_s=256, k=768) vs StreamingLLM, TOVA and H2O at the same peak memory, passkey, CPU, with
# 7 samples x 3 depths = 21 per cell (the issue asks >= 20); LENGTHS=2k,8k by default.
# Run from the repository root:  bash benchmarks/citrus/run_grid.sh [SAMPLES]
set -euo pipefail
samples=${1:-7}
kvpot eval passkey --device cpu --lengths "${LENGTHS:-2k,8k}" --depths 0.1,0.5,0.9 --samples "$samples" \
  --method citrus:cache=none --method citrus:cache=shared --method citrus:cache=individual \
  --method streaming:window=1020,chunk_size=256 --method tova:budget=1024,chunk_size=256 \
  --method h2o:heavy=512,recent=512,chunk_size=256 \
  --out records/citrus/passkey-21-cpu
