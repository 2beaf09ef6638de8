#!/usr/bin/env bash
# CItruS Table 3 analogue: (l_s, k) = (256, 768), (512, 512), (768, 256) at the same 1,024-entry cache,
# shared cache, passkey, CPU.  Run from the repository root:  bash benchmarks/citrus/run_table3.sh [SAMPLES]
set -euo pipefail
samples=${1:-2}
kvpot eval passkey --device cpu --lengths 8k,32k --depths 0.1,0.5,0.9 --samples "$samples" \
  --method citrus:chunk_size=256,keep=768 --method citrus:chunk_size=512,keep=512 \
  --method citrus:chunk_size=768,keep=256 \
  --out records/citrus/table3-passkey-cpu
