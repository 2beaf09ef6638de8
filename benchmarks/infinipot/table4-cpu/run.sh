#!/usr/bin/env bash
# InfiniPot's Table 4 ablation on the reference model, CPU part (2K, 8K, 32K), every variant
# holding at most 2,048 KV entries per layer and KV head (the model's window).
# Run from the repository root:  bash benchmarks/infinipot/table4-cpu/run.sh [SAMPLES]
set -euo pipefail
samples=${1:-4}
kvpot eval passkey --device cpu --lengths 2k,8k,32k --depths 0.1,0.5,0.9 --samples "$samples" \
  --method truncate:budget=2048 \
  --method streaming:window=1532,chunk_size=512 \
  --method infinipot:catalyst=none,nuc_ratio=0,positions=absolute \
  --method infinipot:catalyst=none,nuc_ratio=0 \
  --method infinipot:catalyst=generic,nuc_ratio=0 \
  --method infinipot:catalyst=question,nuc_ratio=0 \
  --method infinipot:catalyst=question,nuc_ratio=0.5 \
  --method infinipot:catalyst=generic,nuc_ratio=0.5 \
  --out records/infinipot/table4-cpu/passkey
