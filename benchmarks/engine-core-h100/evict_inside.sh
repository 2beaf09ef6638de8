#!/usr/bin/env bash
# Issue 43: steady rows evicting inside the captured batched step (kvpot.engine.evict.evict_in_step), and copied
# readers' questions read as chunks of the mixed step (`--feed-questions auto`) instead of a token a step, each beside
# the code or the mode before it, on one machine:
#   WHAT=tests:   the GPU tests of the steady eviction, launching ahead and the batched engine;
#   WHAT=steady:  64 readers of a stored document of $LENGTH tokens (default 128k) with methods that evict a token a step at their budget
#                 (StreamingLLM, H2O, TOVA at 4,096 entries) beside InfiniPot, CUDA graphs, 128 new tokens each; run it
#                 with SRC=<a source tree of the commit before> for the eviction after the step (FLAGS: more options,
#                 `--feed-questions always` for the questions as the commit before reads them);
#   WHAT=readers: 64 readers of it with InfiniPot, a copy each, compiled, 256 new tokens, `--feed-questions $FEED`
#                 (default "always auto": fed a token a step, then read as mixed chunks).
# SRC (default src) is the kvpot source tree on PYTHONPATH; OUT the folder for results.
set -uo pipefail
export PYTHONPATH="$PWD/${SRC:-src}" PYTHONUNBUFFERED=1
summary() {
  python3 benchmarks/engine-core-h100/rows.py "$1/results.json" \
    --keys method,output_tokens_per_second,ttft_p50_seconds,itl_p50_ms,itl_p99_ms,feed_questions,error \
    --counts steps,fed_tokens,mixed_forwards,steady_rows
}
case "${WHAT:-tests}" in
  tests)
    timeout "${LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_evict_inside.py \
      tests/test_launch_ahead.py tests/test_batch.py > "$OUT/gpu-tests.txt" 2>&1
    tail -5 "$OUT/gpu-tests.txt" ;;
  steady)
    mkdir -p "$OUT/steady"
    timeout "${LIMIT:-500}" python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 \
      --method streaming:sinks=4,window=4092 --method h2o:heavy=2048,recent=2048 --method tova:budget=4096 \
      --users 64 --document --lengths "${LENGTH:-128k}" --new-tokens 128 --sequential-users 1 --device cuda ${FLAGS:-} \
      --out "$OUT/steady" 2>&1 | grep -E "Error|error" | head -5
    summary "$OUT/steady" ;;
  readers)
    for feed in ${FEED:-always auto}; do
      mkdir -p "$OUT/$feed"
      timeout "${LIMIT:-280}" python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 \
        --users 64 --document --lengths 128k --new-tokens 256 --compile-step --sequential-users 1 \
        --feed-questions "$feed" --device cuda --out "$OUT/$feed" 2>&1 | grep -E "Error|error" | head -5
      summary "$OUT/$feed"
    done ;;
esac
rm -f "$OUT"/*/*.png
