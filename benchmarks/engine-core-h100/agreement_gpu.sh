#!/usr/bin/env bash
# Issue 43's exactness target on the GPU machine: SmolLM2-135M in bf16, every main method's answers batched
# against alone (`agreement.py`), passkey at 4K and 8K, 8 samples x 3 depths x plain and chat prompts a length.
# Needs what benchmarks/real-model-smollm2/setup_gpu.sh checks: the GGUF file at /tmp/smollm2.gguf (carried in
# parts in back-to-back calls: `.g1`, `.g2`, `.g3`, each copied to /tmp, then `cat /tmp/gpart.0* >
# /tmp/smollm2.gguf`) and the gguf wheel in .whl/ where `gguf` is missing.
# Run from the repository root:  OUT=/tmp/out bash benchmarks/engine-core-h100/agreement_gpu.sh
set -uo pipefail
limit=${limit:-540}
source benchmarks/real-model-smollm2/setup_gpu.sh
timeout "$limit" python benchmarks/engine-core-h100/agreement.py --out "$out/agreement" --device cuda \
  --dtype bfloat16 --lengths "${LENGTHS:-4k,8k}" --samples "${SAMPLES:-8}" --batch-size "${BATCH:-8}" 2>&1 \
  | grep -v "^\s*$" | tail -20
cp "$out/agreement/agreement.json" "$OUT/" 2>/dev/null
