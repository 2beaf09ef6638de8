#!/usr/bin/env bash
# CItruS (l_s=256, k=768) against StreamingLLM, TOVA and H2O at the same peak memory (1,280 KV
# entries per layer and KV head) on the reference model, passkey, CPU.
# Run from the repository root:  bash benchmarks/citrus/run.sh [SAMPLES]
set -euo pipefail
samples=${1:-2}
kvpot eval passkey --device cpu --lengths 2k,8k,32k --depths 0.1,0.5,0.9 --samples "$samples" \
  --method citrus:cache=none --method citrus:cache=shared --method citrus:cache=individual \
  --method streaming:window=1020,chunk_size=256 --method tova:budget=1024,chunk_size=256 \
  --method h2o:heavy=512,recent=512,chunk_size=256 \
  --out records/citrus/passkey-cpu
