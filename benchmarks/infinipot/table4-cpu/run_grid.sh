#!/usr/bin/env bash
# InfiniPot's Table 4 ablation on the reference model, CPU, 2K/8K (LENGTHS=... for more) with 7 samples x 3 depths = 21
# per cell (the issue asks >= 20), Full included. Every compressed variant holds at most 2,048 KV entries.
# Run from the repository root:  bash benchmarks/infinipot/table4-cpu/run_grid.sh [SAMPLES]
set -euo pipefail
samples=${1:-7}
kvpot eval passkey --device cpu --lengths "${LENGTHS:-2k,8k}" --depths 0.1,0.5,0.9 --samples "$samples" \
  --method full \
  --method truncate:budget=2048 \
  --method streaming:window=1532,chunk_size=512 \
  --method infinipot:catalyst=none,nuc_ratio=0,positions=absolute \
  --method infinipot:catalyst=none,nuc_ratio=0 \
  --method infinipot:catalyst=generic,nuc_ratio=0 \
  --method infinipot:catalyst=question,nuc_ratio=0 \
  --method infinipot:catalyst=question,nuc_ratio=0.5 \
  --method infinipot:catalyst=generic,nuc_ratio=0.5 \
  --out records/infinipot/table4-cpu/passkey-21
