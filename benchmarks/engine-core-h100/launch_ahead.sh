#!/usr/bin/env bash
# Issue 43: a decode-only step launched before the previous step's tokens are handed over (`--launch-ahead`,
# kvpot.engine.ahead), off and on in one call, the same machine and commit:
#   WHAT=readers: 64 readers of a stored 128K document (InfiniPot 4,096, 256 new tokens each), a copy each, the
#                 compiled step (`--compile-step`), beside one reader through Engine.generate;
#   WHAT=one:     one reader of it (the batch of one against Engine.generate's step), CUDA graphs;
#   WHAT=tests:   the GPU tests of the batched engine, where launching ahead is the default;
#   WHAT=steady:  64 readers with methods that evict a token a step at their budget (StreamingLLM, H2O, TOVA at 4,096
#                 entries; their eviction runs after the captured step), beside InfiniPot, CUDA graphs, default modes.
# ORDER (default "off on") sets the modes and their order.
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
case "${WHAT:-readers}" in
  readers) users=64; flags="--compile-step --sequential-users 1" ;;
  one) users=1; flags="" ;;
  tests)
    timeout "${LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_batch.py tests/test_packed.py \
      tests/test_shared_document.py tests/test_compile_step.py > "$OUT/gpu-tests.txt" 2>&1
    tail -5 "$OUT/gpu-tests.txt"; exit 0 ;;
  steady)
    mkdir -p "$OUT/steady"
    timeout "${LIMIT:-500}" python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 \
      --method streaming:sinks=4,window=4092 --method h2o:heavy=2048,recent=2048 --method tova:budget=4096 \
      --users 64 --document --lengths 128k --new-tokens 128 --sequential-users 1 --device cuda --out "$OUT/steady" 2>&1 | tail -30
    rm -f "$OUT"/*/*.png; exit 0 ;;
esac
for mode in ${ORDER:-off on}; do
  mkdir -p "$OUT/$mode"
  timeout "${LIMIT:-280}" python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 \
    --users $users --document --lengths 128k --new-tokens 256 $flags --launch-ahead $mode --device cuda \
    --out "$OUT/$mode" 2>&1 | grep -E "^│ infinip|^│ ot|^│ \[|^│ at|^│ time|Error|error" | head -20
  python3 benchmarks/engine-core-h100/rows.py "$OUT/$mode/results.json" \
    --keys method,output_tokens_per_second,itl_p50_ms,itl_p99_ms,launch_ahead,error --counts steps,ahead_steps
done
rm -f "$OUT"/*/*.png
