#!/usr/bin/env bash
# InfiniPot's Table 3 (NuC ratio) on the reference model: single-needle niah in the varied
# haystack at 32K, CaP-Q, |M| = 2048. Run from the repository root:
#   bash benchmarks/infinipot/table3-nuc-ratio-cpu/run.sh [SAMPLES]
set -euo pipefail
samples=${1:-2}
kvpot eval niah --haystack varied --device cpu --lengths 32k --depths 0.1,0.5,0.9 --samples "$samples" \
  --method infinipot:catalyst=question,nuc_ratio=0 --method infinipot:catalyst=question,nuc_ratio=0.25 \
  --method infinipot:catalyst=question,nuc_ratio=0.5 --method infinipot:catalyst=question,nuc_ratio=0.75 \
  --method infinipot:catalyst=question,nuc_ratio=1.0 \
  --out records/infinipot/table3-nuc-ratio-cpu/niah-varied-32k
