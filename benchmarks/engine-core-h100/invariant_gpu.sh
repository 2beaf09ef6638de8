#!/usr/bin/env bash
# Batch-invariant decoding on the GPU machine (Engine(batch_invariant=True)): the kernels' invariance tests in bf16
# and at the 8B / SmolLM2 shapes, the engine's bf16 batched-against-alone test, the decode kernels' tests (the
# merge's order changed with it), then what the mode costs at the llama3-8b shape: `kvpot bench decode` (one
# sequence) and `kvpot bench throughput` (16 users, all at once), each without and with --batch-invariant.
# Usage: OUT=DIR bash benchmarks/engine-core-h100/invariant_gpu.sh
# Everything lands in $OUT/invariant.tar.gz (a call returns at most 8 files).
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
final=$OUT; OUT=$(mktemp -d)/invariant; mkdir -p "$OUT"
python3 -m pytest -q -p no:cacheprovider tests/test_invariant_kernels.py tests/test_decode_kernel.py \
    tests/test_shared_document_kernel.py 2>&1 | tee "$OUT/kernel-tests.log" | tail -4
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_batch_invariant.py 2>&1 | tee "$OUT/engine-tests.log" | tail -4
for flag in "" "--batch-invariant"; do
  name=decode${flag:+-invariant}
  timeout 110 python3 -m kvpot bench decode --shape llama3-8b --device cuda --method streaming --lengths 4096 \
      --decode-steps 64 $flag --out "$OUT/$name" > "$OUT/$name.log" 2>&1; tail -3 "$OUT/$name.log"
  name=throughput${flag:+-invariant}
  timeout 130 python3 -m kvpot bench throughput --shape llama3-8b --device cuda --method infinipot:pot_size=4096 \
      --users 16 --lengths 2048 --new-tokens 64 --sequential-users 1 $flag --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  tail -3 "$OUT/$name.log"
done
tar -czf "$final/invariant.tar.gz" -C "$(dirname "$OUT")" invariant
