#!/usr/bin/env bash
# kvpot serve on one H100: time to first token for a stored document vs reading it fresh,
# on the random-weight llama3-8b shape (bfloat16), InfiniPot with a 4,096-entry pot.
# Needs: pip install -e ".[serve]" openai httpx. Writes records/serve-h100/results/.
set -euo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee records/serve-h100/gpu.txt
python benchmarks/serve-h100/serve_ttft.py --shape llama3-8b --method infinipot:pot_size=4096 \
    --lengths 32k,128k --reps 3 --out records/serve-h100/results "$@" 2>&1 | tee records/serve-h100/run.log
