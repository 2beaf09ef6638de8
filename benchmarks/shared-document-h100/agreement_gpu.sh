#!/usr/bin/env bash
# Issue 48's exactness target on the GPU machine: SmolLM2-135M in bf16, readers of a shared document against readers
# with a copy each (`agreement.py` beside this), 4 passkey documents of $LENGTH (4k) tokens x $READERS (8) questions,
# 6 methods. Needs what benchmarks/real-model-smollm2/setup_gpu.sh checks: the GGUF file at /tmp/smollm2.gguf
# (carried in parts in back-to-back calls: `.g1`, `.g2`, `.g3`, each copied to /tmp, then `cat /tmp/gpart.0* >
# /tmp/smollm2.gguf`) and the gguf wheel in .whl/ where `gguf` is missing.
# Run from the repository root:  OUT=/tmp/out bash benchmarks/shared-document-h100/agreement_gpu.sh
set -uo pipefail
limit=${limit:-420}
source benchmarks/real-model-smollm2/setup_gpu.sh
timeout "$limit" python benchmarks/shared-document-h100/agreement.py --out "$out/shared-agreement" --device cuda \
  --dtype bfloat16 --length "${LENGTH:-4k}" --readers "${READERS:-8}" "$@" > "$OUT/shared-agreement-log.txt" 2>&1
tail -12 "$OUT/shared-agreement-log.txt"
cp "$out/shared-agreement/agreement.json" "$OUT/" 2>/dev/null
cp "$out/machine.txt" "$OUT/" 2>/dev/null
