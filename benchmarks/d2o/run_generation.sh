#!/usr/bin/env bash
# D2O's long-generation setting: a 256-token prompt, then a 2,048-token continuation scored token by
# token as teacher-forced generation, every method holding 256 entries per layer and KV head (on average
# for D2O) while it decodes. Reference model, varied filler, CPU.
# Run from the repository root:  bash benchmarks/d2o/run_generation.sh
set -euo pipefail
kvpot eval perplexity --device cpu --length 2304 --prompt-tokens 256 --window 256 \
  --method full --method streaming:window=252,chunk_size=2048 --method h2o:heavy=128,recent=128,chunk_size=2048 \
  --method tova:budget=256,chunk_size=2048 --method d2o:budget=256 --method d2o:budget=256,merge=false \
  --method d2o:budget=256,layer_budget=false --method d2o:budget=256,merge=false,layer_budget=false \
  --out records/d2o/generation-2k-cpu
