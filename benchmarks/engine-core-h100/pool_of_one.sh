#!/usr/bin/env bash
# Issue 43: a pool of one slot without its scratch row (kvpot.engine.pool, `SlotPool(scratch=False)`) and one sequence
# through the core (`Engine(runner="core")`, kvpot.engine.one_slot), on one machine:
#   WHAT=tests: the GPU tests of the pool of one, of one sequence through the core (`Engine(runner="core")`), the step
#               trace's device time, the steady eviction inside the step and the packed mixed step;
#   WHAT=runner: `kvpot bench decode` of one sequence after a $LENGTH-token context with `--runner $RUNNERS` (default
#               "sequence core", one run each): InfiniPot, StreamingLLM, H2O (4,096 entries) and Full, CUDA graphs,
#               16 warm-up and 128 timed steps; METHODS (--method flags) measures others instead, BUDGET their budget.
# SRC (default src) is the kvpot source tree on PYTHONPATH; OUT the folder for results.
set -uo pipefail
export PYTHONPATH="$PWD/${SRC:-src}" PYTHONUNBUFFERED=1
case "${WHAT:-tests}" in
  tests)
    timeout "${LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/test_pool_of_one.py \
      tests/test_one_slot.py tests/test_trace.py tests/test_evict_inside.py tests/test_packed.py} > "$OUT/gpu-tests.txt" 2>&1
    tail -5 "$OUT/gpu-tests.txt" ;;
  runner)
    for runner in ${RUNNERS:-sequence core}; do
      mkdir -p "$OUT/$runner"
      methods="${METHODS:---method infinipot:pot_size=4096 --method streaming:sinks=4,window=4092 --method h2o:heavy=2048,recent=2048 --method full}"
      # shellcheck disable=SC2086  # (the methods are flags to split)
      timeout "${LIMIT:-150}" python3 -m kvpot bench decode --shape llama3-8b $methods ${BUDGET:+--budget $BUDGET} \
        --lengths "${LENGTH:-32k}" --decode-steps 128 --warmup-steps 16 --no-floor --runner "$runner" --device cuda \
        --out "$OUT/$runner" 2>&1 | grep -E "Error|error" | head -5
      python3 benchmarks/engine-core-h100/rows.py "$OUT/$runner/results.json" \
        --keys method,runner,ms_per_token,ms_per_token_p90,peak_memory_bytes,max_kv_entries,error --counts none
    done ;;
esac
rm -f "$OUT"/*/*.png
