#!/usr/bin/env bash
# Issue 43's exactness target on the GPU machine: SmolLM2-135M in bf16, every main method's answers batched
# against alone (`agreement.py`), passkey at $LENGTHS (4K), $SAMPLES (2) samples x 3 depths x 3 templates x plain and
# chat prompts a length.
# Needs what benchmarks/real-model-smollm2/setup_gpu.sh checks: the GGUF file at /tmp/smollm2.gguf (carried in
# parts in back-to-back calls: `.g1`, `.g2`, `.g3`, each copied to /tmp, then `cat /tmp/gpart.0* >
# /tmp/smollm2.gguf`) and the gguf wheel in .whl/ where `gguf` is missing.
# Run from the repository root:  OUT=/tmp/out bash benchmarks/engine-core-h100/agreement_gpu.sh [--batch-invariant]
set -uo pipefail
# On an H100, 2 samples at 4K (36 a method, 7 methods) took about 320 s for both runs, after ~50 s converting the
# GGUF file. Whatever the time limit leaves, both runs' rows come back and are compared (`--compare-only`).
limit=${limit:-420}
source benchmarks/real-model-smollm2/setup_gpu.sh
timeout "$limit" python benchmarks/engine-core-h100/agreement.py --out "$out/agreement" --device cuda \
  --dtype bfloat16 --lengths "${LENGTHS:-4k}" --samples "${SAMPLES:-2}" --batch-size "${BATCH:-8}" "$@" \
  > "$OUT/agreement-log.txt" 2>&1
python benchmarks/engine-core-h100/agreement.py --out "$out/agreement" --compare-only 2>&1 | tail -12
for run in alone batched; do cp "$out/agreement/$run/results.jsonl" "$OUT/$run.jsonl" 2>/dev/null; done
cp "$out/agreement/agreement.json" "$OUT/" 2>/dev/null
