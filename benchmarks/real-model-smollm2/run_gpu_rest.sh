#!/usr/bin/env bash
# Issue 18, what the first two GPU calls left (one H100, SmolLM2-135M-Instruct, bf16, --seed 0 throughout):
#   - 128K at the bound of 2,048 entries: InfiniPot (CaP-Q), InfiniteHiP, CItruS;
#   - each method's own defaults at 10 samples x depths 0.1/0.5/0.9 per cell (4K/16K; 16K/32K for the long ones);
#   - niah at 4K and 16K, every method at the bound, 4 samples x 3 depths;
#   - InfiniPot's misses at 16K, three probes on the focused run's samples: float32 instead of bf16, a pot of
#     4,096, and CaP alone (nuc_ratio=0);
#   - kvpress 0.5.5 on the same passkey samples (4K/16K/32K, 5 x 3), 2,048 entries kept, its pipeline's
#     protocol (kvpress_eval.py), in a second environment from .whl-kvpress/ (benchmarks/kvpress-env/).
# One process per method and length group, all at once, one CPU thread each (SmolLM2 is launch-bound).
#
# Run from the repository root:  OUT=/tmp/out bash benchmarks/real-model-smollm2/run_gpu_rest.sh [SECONDS]
# Needs what setup_gpu.sh (sourced) checks, and .whl-kvpress/ for the kvpress part (skipped without it).
# SECONDS (default 420) limits every process. Results: $OUT/smollm2-gpu.tar.gz and $OUT/summary.md.
set -uo pipefail
limit=${1:-420}
source benchmarks/real-model-smollm2/setup_gpu.sh
rest=0-$((cores - 1))  # no demo beside this grid: every core

eval_() { eval_task 0 "$1" "$2" --depths 0.1,0.5,0.9 "${@:3}"; }  # eval_ NAME TASK ARGS...
infinipot=infinipot:catalyst=question citrus=citrus:keep=1024,chunk_size=512
# 128K at the bound
eval_ b2048-infinipot-128k passkey --method $infinipot --lengths 128k --samples 5
eval_ b2048-infinitehip-128k passkey --method infinitehip --lengths 128k --samples 5
eval_ b2048-citrus-128k passkey --method $citrus --lengths 128k --samples 3
# each method's own defaults (Full's and InfiniteHiP's are the bound grid's specs already)
for m in streaming h2o tova snapkv d2o; do
  eval_ default-$m-4k16k passkey --method $m --lengths 4k,16k --samples 10
done
eval_ default-citrus-16k32k passkey --method citrus --lengths 16k,32k --samples 10
eval_ default-infinipot-16k passkey --method infinipot --lengths 16k --samples 10
eval_ default-infinipot-32k passkey --method infinipot --lengths 32k --samples 10
# niah at the bound
eval_ niah-b2048-a niah --method full --method snapkv:budget=2048 --method $infinipot --lengths 4k,16k --samples 4
eval_ niah-b2048-b niah --method $citrus --method infinitehip --method streaming:window=1532,chunk_size=512 \
  --lengths 4k,16k --samples 4
eval_ niah-b2048-c niah --method h2o:heavy=768,recent=768,chunk_size=512 --method tova:budget=1536,chunk_size=512 \
  --method d2o:budget=2048 --lengths 4k,16k --samples 4
# InfiniPot's misses at 16K: the same 30 samples as gpu-focused/b2048-infinipot-16k
eval_ probe-infinipot-16k-float32 passkey --method $infinipot --lengths 16k --samples 10 --dtype float32
eval_ probe-infinipot-16k-pot4096 passkey --method infinipot:catalyst=question,pot_size=4096 --lengths 16k --samples 10
eval_ probe-infinipot-16k-cap-only passkey --method infinipot:catalyst=question,nuc_ratio=0 --lengths 16k --samples 10

# kvpress, one press after another in one background chain (each run is a one-shot prefill: fast)
if ls .whl-kvpress/*.whl > /dev/null 2>&1; then
  (
    site=/tmp/kvpress-site
    python -m pip install -q --no-index --no-deps --target "$site" .whl-kvpress/*.whl &&
    python benchmarks/real-model-smollm2/kvpress_eval.py cases --task passkey --lengths 4k,16k,32k --samples 5 \
      --seed 0 --out "$out/kvpress-cases.jsonl" || exit 1
    model_dir=$(python -c "from kvpot.models import SMOLLM2_135M, resolve_source; print(resolve_source(SMOLLM2_135M))")
    for press in snapkv expected_attention streaming_llm tova; do
      PYTHONPATH=$site:$PYTHONPATH taskset -c "$rest" timeout "$limit" python benchmarks/real-model-smollm2/kvpress_eval.py \
        answer --cases "$out/kvpress-cases.jsonl" --model-dir "$model_dir" --press $press --kept 2048 --device cuda \
        --out "$out/kvpress-$press"
    done
    rm "$out/kvpress-cases.jsonl"  # token ids: large, and rebuilt from the seed by `cases`
  ) > "$out/kvpress.log" 2>&1 &
else
  echo "no .whl-kvpress/: kvpress not run" > "$out/kvpress.log"
fi
wait
pack_results
