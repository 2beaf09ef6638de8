#!/usr/bin/env bash
# Issue 31's target on the bundled reference model (window 2,048): every method, the seeds' comparison methods
# included, past 4K under issue 32's protocol, on CPU (nice 19, one thread: run beside other work):
#   comparison-8k/   the comparison methods at 8K in the 8K cells of passkey-8k/ (3 templates x 3 depths = 9);
#   long-16k-32k/    every method at 16K and 32K, depth 0.5, 3 templates (3 per cell: fewer samples, not none).
# Budgets as run.sh and run-comparison.sh (512 entries). Run from the repository root:
#   bash benchmarks/protocol-reference-cpu/run-long.sh [OUT]
set -euo pipefail
out=${1:-records/protocol-reference-cpu}
export OMP_NUM_THREADS=1 TQDM_DISABLE=1
old=(--method full
  --method infinipot:catalyst=question,pot_size=512
  --method infinipot:catalyst=question,pot_size=512,share=model
  --method infinipot:catalyst=question,pot_size=512,nuc_ratio=1
  --method snapkv:budget=512
  --method streaming:window=380,chunk_size=128
  --method tova:budget=384,chunk_size=128)
new=(--method pyramidkv:budget=512
  --method scissorhands:budget=384,chunk_size=128
  --method roco:budget=384,chunk_size=128
  --method sirllm:pot_size=512
  --method cam:start=4,recent=380,chunk_size=128
  --method selfextend
  --method infllm)
common=(passkey --device cpu --seed 0 --templates all --chat both)
nice -n 19 python -m kvpot eval "${common[@]}" "${new[@]}" --lengths 8k --depths 0.1,0.5,0.9 --samples 1 \
  --out "$out/comparison-8k"
nice -n 19 python -m kvpot eval "${common[@]}" "${old[@]}" "${new[@]}" --lengths 16k,32k --depths 0.5 --samples 1 \
  --out "$out/long-16k-32k"
