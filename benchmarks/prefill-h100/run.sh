#!/usr/bin/env bash
# kvpot's prefill on one H100: the llama3-8b shape (random weights, bf16), a bound of 4,096 entries.
#
#   OUT=DIR bash benchmarks/prefill-h100/run.sh PART
# PART: probe (attention kernels, JSON lines on stdout), chunks (chunk sizes at 32K), profile (every method at 32K under torch.profiler,
# hf beside it), main (floor, hf, Full and the bounded methods at $LENGTHS, 2 repeats), kvpress (its presses, hf, InfiniPot), long (bounded
# methods at 32K and 1M in one process: memory flat), full (Full at chunk 2048 and 8192 beside hf).
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
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-32k,128k}" "${methods[@]}" --repeats 2 \
      --baseline hf --out "$OUT/main" ;;
  kvpress)  # its wheels (benchmarks/kvpress-env/make_wheels.sh DIR) in $KVPRESS_WHEELS; hf again beside it
    site=/tmp/kvpress-site
    python3 -m pip install -q --no-index --no-deps --target "$site" "${KVPRESS_WHEELS:-.whl-kvpress}"/*.whl
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-32k,128k}" --no-floor --method infinipot \
      --baseline hf --baseline kvpress --kvpress-path "$site" --out "$OUT/kvpress" ;;
  long)
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-32k,1m}" \
      --method streaming --method h2o --method tova --method infinipot --method citrus --out "$OUT/long" ;;
  full)  # Full's chunk size against transformers' one-shot forward
    python3 -m kvpot bench prefill "${common[@]}" --lengths "${LENGTHS:-32k,128k}" --repeats 2 --no-floor \
      --method full:chunk_size=2048 --method full:chunk_size=8192 --baseline hf --out "$OUT/full" ;;
esac
