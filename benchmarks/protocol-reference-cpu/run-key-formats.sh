#!/usr/bin/env bash
# Key formats as a protocol dimension (issue 32, `--key-formats`) on the bundled reference model, CPU: passkey
# at 1,900 tokens (inside its 2,048-token window) with the key as 5 digits, a UUID or an adjective-noun pair;
# wording 0 only (the model was trained on it alone: on wordings 1 and 2 it misses at any format), depths
# 0.1/0.5/0.9, 3 samples per depth and format (27 per method, 9 per format), every compressed method at 512
# entries per layer and KV head as in run.sh.
# Run from the repository root (PYTHONPATH may point at a clean copy of src/):
#   bash benchmarks/protocol-reference-cpu/run-key-formats.sh [OUT]
set -euo pipefail
out=${1:-records/protocol-reference-cpu/key-formats}
python -m kvpot eval passkey --device cpu --seed 0 --lengths 1900 --depths 0.1,0.5,0.9 --templates 0 --chat both \
  --key-formats digits,uuid,words --samples 3 \
  --method full \
  --method infinipot:catalyst=question,pot_size=512 \
  --method snapkv:budget=512 \
  --method streaming:window=380,chunk_size=128 \
  --method tova:budget=384,chunk_size=128 \
  --out "$out"
