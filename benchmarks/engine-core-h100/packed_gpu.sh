#!/usr/bin/env bash
# The captured mixed step (`kvpot.engine.packed`) on the GPU machine, in one call of the device tool (~6 minutes;
# with OPEN_LOOP=1 past the device tool's 10-minute call: give the open loop a call of its own then):
# 1. its GPU tests (captured replays give every request its tokens alone; the observation kernel against its
#    reference over the varlen shapes, bf16 and the 8B mixed shape included);
# 2. `prefill_ops.py` through the scheduler at 1,024 prompt tokens a step beside 32 decoding rows: the captured
#    mixed step, the eager one (`--eager-mix`), the captured one with keys rotated on load (`--rotate-on-load`), and the
#    first again, for torch calls, host, wall and device time a read;
#    With COMPILED=1 the forms are the captured step and the captured step through the compiled layer
#    (`--compile-step`, `kvpot.engine.packed.COMPILED`), twice each.
# 3. with OPEN_LOOP=1 (SKIP_TESTS=1 SKIP_OPS=1 leave out 1 and 2): the open loop (`open_loop.sh`) at $BUDGET (2,048)
#    prompt tokens a step, the batch row with `--mix eager` beside `--mixed` (captured), one user one at a time.
# Usage: OUT=DIR bash benchmarks/engine-core-h100/packed_gpu.sh
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt" 2>&1
echo "commit ${KVPOT_GIT_COMMIT:-unknown}" >> "$OUT/machine.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TESTS_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_packed.py 2>&1 \
    | tee "$OUT/packed-gpu-tests.log" | tail -6
  timeout "${TESTS_LIMIT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_varlen_kernel.py 2>&1 \
    | tee -a "$OUT/packed-gpu-tests.log" | grep -E "passed|failed|FAILED|Error" | tail -8
fi
forms="packed eager on-load packed"  # A, B, C, A again: the first form twice, to see the calls' spread
[ "${COMPILED:-0}" = 1 ] && forms="packed compiled packed compiled"  # the packed step through the compiled layer
forms=${FORMS:-$forms}  # e.g. FORMS="packed compiled": one run of each
[ "${SKIP_OPS:-0}" = 1 ] || for form in $forms; do
  extra=(); [ "$form" = eager ] && extra=(--eager-mix); [ "$form" = on-load ] && extra=(--rotate-on-load)
  [ "$form" = compiled ] && extra=(--compile-step)
  timeout 150 python3 benchmarks/engine-core-h100/prefill_ops.py --out "$OUT/ops-$form" --scheduler 1024 \
    --decoding 32 --repeats 3 "${extra[@]}" 2>&1 | tail -3 | cut -c1-1500
  n=$(ls "$OUT"/prefill-ops-$form*.json 2>/dev/null | wc -l)
  cp "$OUT/ops-$form/prefill_ops.json" "$OUT/prefill-ops-$form-$n.json" 2>/dev/null; rm -rf "$OUT/ops-$form"
done
if [ "${OPEN_LOOP:-0}" = 1 ]; then
  timeout "${LOOP_LIMIT:-330}" bash benchmarks/engine-core-h100/open_loop.sh loop --prefill-tokens "${BUDGET:-2048}" \
    --mix eager --mixed --sequential-users 1 > "$OUT/open-loop-log.txt" 2>&1
  tail -25 "$OUT/open-loop-log.txt"
  cp "$OUT/loop/results.json" "$OUT/open-loop.json" 2>/dev/null; rm -rf "$OUT/loop"
fi
