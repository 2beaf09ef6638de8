#!/usr/bin/env bash
# The captured mixed step through the compiled decoder layer (`kvpot.engine.packed.COMPILED`) on the GPU machine, in
# one call of the device tool (~9 minutes): its GPU tests; if they pass, the open loop (`open_loop.sh`, issue 43's
# workload) at $BUDGET (1,024) prompt tokens a step with `--compile-step` (packed steps compiled too), then
# `prefill_ops.py --compile-step` (a 16K read beside 32 decoding rows). If they fail, the open loop runs uncompiled
# with `--prompt-order shortest` instead. With ORDERS="shortest arrival" (no tests, no prefill_ops): the compiled open
# loop once per prompt order; an item ORDER@SECONDS sets its --prompt-patience (ORDERS="shortest@3 shortest@5": the
# patience that keeps shortest-first's median with less of its tail, ~4 minutes a run).
# Usage: OUT=DIR bash benchmarks/engine-core-h100/compiled_gpu.sh
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt" 2>&1
echo "commit ${KVPOT_GIT_COMMIT:-unknown}" >> "$OUT/machine.txt"
budget=${BUDGET:-1024}; mkdir -p /tmp/ol
if [ -n "${ORDERS:-}" ]; then
  for item in $ORDERS; do  # ORDER or ORDER@PATIENCE (seconds; --prompt-patience, default 10)
    order=${item%@*}; patience=${item#*@}; [ "$patience" = "$item" ] && patience=10; tag=${item/@/-p}
    OUT=/tmp/ol timeout "${LOOP_LIMIT:-255}" bash benchmarks/engine-core-h100/open_loop.sh \
      "compiled-$tag" --prefill-tokens "$budget" --compile-step --prompt-order "$order" --prompt-patience "$patience" \
      --sequential-users 1 > "$OUT/open-loop-$tag-log.txt" 2>&1
    cp "/tmp/ol/compiled-$tag/results.json" "$OUT/open-loop-compiled-$tag.json"
    tail -12 "$OUT/open-loop-$tag-log.txt" | cut -c1-300
  done
  exit 0
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_packed.py -k compiled > "$OUT/compiled-tests.log" 2>&1
tail -2 "$OUT/compiled-tests.log"
if grep -q "2 passed" "$OUT/compiled-tests.log"; then
  OUT=/tmp/ol timeout "${LOOP_LIMIT:-320}" bash benchmarks/engine-core-h100/open_loop.sh compiled \
    --prefill-tokens "$budget" --compile-step --sequential-users 1 > "$OUT/open-loop-log.txt" 2>&1
  cp /tmp/ol/compiled/results.json "$OUT/open-loop-compiled.json"
  timeout "${OPS_LIMIT:-110}" python3 benchmarks/engine-core-h100/prefill_ops.py --out /tmp/ops --scheduler "$budget" \
    --decoding 32 --repeats 3 --compile-step 2>&1 | tail -3 | cut -c1-1500
  cp /tmp/ops/prefill_ops.json "$OUT/prefill-ops-compiled.json"
else
  OUT=/tmp/ol timeout "${LOOP_LIMIT:-320}" bash benchmarks/engine-core-h100/open_loop.sh shortest \
    --prefill-tokens "$budget" --prompt-order shortest --sequential-users 1 > "$OUT/open-loop-log.txt" 2>&1
  cp /tmp/ol/shortest/results.json "$OUT/open-loop-shortest.json"
fi
tail -25 "$OUT/open-loop-log.txt" | cut -c1-300
