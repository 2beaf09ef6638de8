#!/usr/bin/env bash
# Issue 43: 64 readers of a stored 128K document (InfiniPot 4,096, 256 new tokens each), the batched step with
# CUDA graphs and with its decoder layers compiled (`--compile-step`), each beside one reader through
# Engine.generate (`--sequential-users 1`), in one call (MODES="graphs" or "compiled": one of them).
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
for mode in ${MODES:-graphs compiled}; do
  mkdir -p "$OUT/$mode"
  flag=""; [ "$mode" = compiled ] && flag="--compile-step"
  python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 64 --document \
    --lengths 128k --new-tokens 256 --sequential-users 1 $flag --device cuda --out "$OUT/$mode" 2>&1 \
    | grep -E "^│ infinip|^│ ot|^│ \[|^│ at|^│ time|Error|error" | head -20
done
rm -f "$OUT"/*/*.png
