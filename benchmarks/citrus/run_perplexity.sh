#!/usr/bin/env bash
# CItruS Fig. 7 analogue: loss per 4K window over 128K tokens of varied filler, Standard CSE and the
# shared cache (l_s=256, k=768; instruction = the model's generic prompt, since language modelling has no
# question) vs StreamingLLM at the same peak memory. (Full is left out: its
# attention over 128K tokens is quadratic, ~25 min on 2 CPU cores, and it collapses past 2K anyway.)
# Run from the repository root:  bash benchmarks/citrus/run_perplexity.sh
set -euo pipefail
kvpot eval perplexity --device cpu --length 128k --window 4096 \
  --method citrus:cache=none --method citrus:cache=shared,instruction=generic \
  --method streaming:window=1020,chunk_size=256 \
  --out records/citrus/perplexity-128k-cpu
