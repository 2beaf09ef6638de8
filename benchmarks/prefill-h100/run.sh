#!/usr/bin/env bash
# kvpot's prefill on one H100: the llama3-8b shape (random weights, bf16), a bound of 4,096 entries.
#
#   OUT=DIR bash benchmarks/prefill-h100/run.sh PART
# PART: probe (attention kernels, JSON lines on stdout), chunks (chunk sizes at 32K), profile (every method at 32K under torch.profiler,
# hf beside it), main (floor, hf, Full and the bounded methods at $LENGTHS), long (bounded methods at 1M).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out}
part=${1:-main}
export PYTHONUNBUFFERED=1
common=(--shape llama3-8b --budget 4096 --device cuda)
methods=(--method full --method streaming --method h2o --method tova --method infinipot --method citrus)
case "$part" in
  probe) python3 benchmarks/prefill-h100/probe_attention.py ;;
  profile)
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-32k}" "${methods[@]}" \
      --baseline hf --profile --out "$OUT/profile" ;;
  chunks)  # chunk sizes side by side at 32K, to choose the defaults
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-32k}" --method full --method full:chunk_size=8192 \
      --method streaming:chunk_size=512 --method streaming:chunk_size=1024 --method streaming:chunk_size=2048 \
      --method h2o:chunk_size=512 --method h2o:chunk_size=2048 --method tova:chunk_size=512 --method tova:chunk_size=2048 \
      --method infinipot --method citrus --method citrus:chunk_size=2048 --baseline hf --out "$OUT/chunks" ;;
  main)
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-32k,128k}" "${methods[@]}" \
      --baseline hf ${EXTRA:-} --out "$OUT/main" ;;
  long)
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-1m}" \
      --method streaming --method h2o --method tova --method infinipot --method citrus --out "$OUT/long" ;;
esac
