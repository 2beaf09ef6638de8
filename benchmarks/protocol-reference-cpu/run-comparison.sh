#!/usr/bin/env bash
# Issue 31's comparison methods on the bundled reference model under issue 32's protocol, on CPU: the same
# passkey cells as run.sh (3 templates x depths 0.1/0.5/0.9, 2 samples each: 18 per cell) at 1,900 tokens and
# 4K, every compressed method held to 512 KV entries per layer and KV head; Self-Extend and InfLLM keep every
# entry (their defaults on a 2,048-token window). 8K and beyond: run-long.sh.
# Run from the repository root (PYTHONPATH may point at a clean copy of src/):
#   bash benchmarks/protocol-reference-cpu/run-comparison.sh [OUT]
set -euo pipefail
out=${1:-records/protocol-reference-cpu}
methods=(--method pyramidkv:budget=512
  --method scissorhands:budget=384,chunk_size=128
  --method roco:budget=384,chunk_size=128
  --method sirllm:pot_size=512
  --method cam:start=4,recent=380,chunk_size=128
  --method selfextend
  --method infllm)
python -m kvpot eval passkey --device cpu --seed 0 --depths 0.1,0.5,0.9 --templates all --chat both "${methods[@]}" \
  --lengths 1900,4k --samples 2 --out "$out/comparison-1900-4k"
