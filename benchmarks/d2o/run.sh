#!/usr/bin/env bash
# D2O (ratio 0.2) and its ablations against H2O, TOVA and StreamingLLM at the same average budget
# (0.2 x ~1,940-token prompts = 388 entries per layer), inside the reference model's window, CPU.
# The baselines read the whole prompt in one forward (chunk 2,048), then compress, as D2O does.
# Run from the repository root:  bash benchmarks/d2o/run.sh [SAMPLES]
set -euo pipefail
samples=${1:-4}
for task in passkey niah; do
  kvpot eval $task --device cpu --lengths 1900 --depths 0.1,0.5,0.9 --samples "$samples" \
    --method full --method streaming:window=384,chunk_size=2048 \
    --method h2o:heavy=194,recent=194,chunk_size=2048 --method tova:budget=388,chunk_size=2048 \
    --method d2o:ratio=0.2 --method d2o:ratio=0.2,merge=false --method d2o:ratio=0.2,layer_budget=false \
    --method d2o:ratio=0.2,merge=false,layer_budget=false \
    --out records/d2o/$task-window
done
