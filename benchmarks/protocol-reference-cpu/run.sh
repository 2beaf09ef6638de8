#!/usr/bin/env bash
# Issue 32's protocol on the bundled reference model (window 2,048, byte-level, no chat template: plain only),
# on CPU: passkey in its 3 templates x depths 0.1/0.5/0.9, inside the window (1,900 tokens) and at 2x and 4x it
# (4K, 8K), every compressed method held to 512 KV entries per layer and KV head (a quarter of the window, as
# SmolLM2's runs hold 2,048 of 8,192). 2 samples per template and depth at 1,900 and 4K (18 per cell), 1 at 8K (9).
# Run from the repository root (PYTHONPATH may point at a clean copy of src/):
#   bash benchmarks/protocol-reference-cpu/run.sh [OUT]
set -euo pipefail
out=${1:-records/protocol-reference-cpu}
methods=(--method full
  --method infinipot:catalyst=question,pot_size=512
  --method infinipot:catalyst=question,pot_size=512,share=model
  --method infinipot:catalyst=question,pot_size=512,nuc_ratio=1
  --method snapkv:budget=512
  --method streaming:window=380,chunk_size=128
  --method tova:budget=384,chunk_size=128)
common=(passkey --device cpu --seed 0 --depths 0.1,0.5,0.9 --templates all --chat both "${methods[@]}")
python -m kvpot eval "${common[@]}" --lengths 1900,4k --samples 2 --out "$out/passkey-1900-4k"
python -m kvpot eval "${common[@]}" --lengths 8k --samples 1 --out "$out/passkey-8k"
