#!/usr/bin/env bash
# kvpot's methods beside kvpress 0.5.5's presses on the bundled reference model (window 2,048), CPU, under issue
# 32's protocol: passkey at 1,000 and 1,900 tokens (inside the window, where compression is all that differs),
# 3 templates x depths 0.1/0.5/0.9 x 2 samples = 18 per cell, compression ratios 0.25 / 0.5 / 0.75 (each case
# keeps int(n (1 - r)) of its n context tokens), the same cases for both (issue 31: PyramidKV beside
# PyramidKVPress). kvpress runs in a second process with transformers 5.2 (benchmarks/kvpress-env/; on this
# machine: KVPRESS_WHEEL_PYTHON=3.11 make_wheels.sh DIR, plus huggingface-hub 1.33.0, pip install --target SITE).
#   bash benchmarks/protocol-reference-cpu/run-kvpress.sh SITE [OUT]
set -euo pipefail
site=${1:?the folder kvpress and transformers 5.2 are installed in}
out=${2:-records/protocol-reference-cpu}
export OMP_NUM_THREADS=1 TQDM_DISABLE=1
python -m kvpot eval passkey --device cpu --seed 0 --templates all --depths 0.1,0.5,0.9 --samples 2 \
  --lengths 1000,1900 --compression-ratios 0.25,0.5,0.75 \
  --method snapkv --method pyramidkv --method tova --method streaming --method infinipot:catalyst=question \
  --baseline kvpress --press snapkv --press pyramidkv --press tova --press streaming_llm \
  --press expected_attention --press knorm --kvpress-path "$site" --out "$out/kvpress-1000-1900"
