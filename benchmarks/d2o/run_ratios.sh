#!/usr/bin/env bash
# D2O at ratios 0.1 and 0.4 (the paper's other LongBench budgets) and its ablations against H2O, TOVA
# and StreamingLLM at the same average budget (ratio x ~1,940-token prompts), inside the reference
# model's window, CPU; the same layout as run.sh (ratio 0.2).
# Run from the repository root:  bash benchmarks/d2o/run_ratios.sh [SAMPLES]
set -euo pipefail
samples=${1:-4}
for ratio in 0.1 0.4; do
  budget=$(python -c "print(round($ratio * 1940))")
  half=$((budget / 2))
  for task in passkey niah; do
    kvpot eval $task --device cpu --lengths 1900 --depths 0.1,0.5,0.9 --samples "$samples" \
      --method full --method streaming:window=$((budget - 4)),chunk_size=2048 \
      --method h2o:heavy=$half,recent=$((budget - half)),chunk_size=2048 --method tova:budget=$budget,chunk_size=2048 \
      --method d2o:ratio=$ratio --method d2o:ratio=$ratio,merge=false --method d2o:ratio=$ratio,layer_budget=false \
      --method d2o:ratio=$ratio,merge=false,layer_budget=false \
      --out records/d2o/$task-window-ratio$ratio
  done
done
