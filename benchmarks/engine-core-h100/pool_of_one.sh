#!/usr/bin/env bash
# Issue 43: a pool of one slot without its scratch row (kvpot.engine.pool, `SlotPool(scratch=False)`), beside the
# source before it (a scratch row in every pool), on one machine:
#   WHAT=tests: the GPU tests of the pool of one, the step trace's device time, the steady eviction inside the step
#               and the packed mixed step;
#   WHAT=one:   one reader of a stored document of $LENGTH tokens (default 32k) in a scheduler of one slot and through
#               Engine.generate (the one-at-a-time row), same run: Full (a cache that grows with the input: the pool's
#               bytes and peak memory) and InfiniPot (pot 4,096), `llama3-8b` shape, 128 new tokens; run it again with
#               SRC=<a source tree of the commit before> for the pool with its scratch row.
# SRC (default src) is the kvpot source tree on PYTHONPATH; OUT the folder for results.
set -uo pipefail
export PYTHONPATH="$PWD/${SRC:-src}" PYTHONUNBUFFERED=1
case "${WHAT:-tests}" in
  tests)
    timeout "${LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_pool_of_one.py \
      tests/test_trace.py tests/test_evict_inside.py tests/test_packed.py > "$OUT/gpu-tests.txt" 2>&1
    tail -5 "$OUT/gpu-tests.txt" ;;
  one)
    mkdir -p "$OUT/one"
    timeout "${LIMIT:-300}" python3 -m kvpot bench throughput --shape llama3-8b --method full \
      --method infinipot:pot_size=4096 --users 1 --document --lengths "${LENGTH:-32k}" --new-tokens 128 \
      --device cuda --out "$OUT/one" 2>&1 | grep -E "Error|error" | head -5
    python3 benchmarks/engine-core-h100/rows.py "$OUT/one/results.json" \
      --keys method,kind,output_tokens_per_second,itl_p50_ms,peak_memory_bytes,pool_bytes,slot_bytes,error ;;
esac
rm -f "$OUT"/*/*.png
