#!/usr/bin/env bash
# Issue 18 on one H100: SmolLM2-135M-Instruct (a real pretrained model), passkey with every method at the
# same bound of 2,048 KV entries per layer and KV head, 4K-128K; each method's defaults; niah; and
# InfiniteHiP's stage-by-stage needle recall. SmolLM2 is tiny (135M parameters, bf16), so one process is bound
# by Python's kernel launches and leaves the GPU mostly idle: the grid runs as one process per method and
# length group, all at once, each on one CPU thread, lower tiers under `nice` so that the main grid gets the
# CPUs first. Every `kvpot eval` uses --seed 0, so every method sees the same samples. A process stopped by
# the time limit keeps the rows it finished (results.jsonl is written row by row; tables.py counts them).
#
# Needs what setup_gpu.sh (sourced) checks: the GGUF file at $KVPOT_SMOLLM2_GGUF (default /tmp/smollm2.gguf)
# and `gguf` (installed from .whl/ when missing).
# Run from the repository root:  OUT=/tmp/out bash benchmarks/real-model-smollm2/run_gpu.sh [SECONDS]
# SECONDS (default 450) limits every eval process; the whole script takes about SECONDS + 60.
# Results: $OUT/smollm2-gpu.tar.gz (every eval folder, logs, merged summary and heatmaps), plus
# $OUT/summary.md and $OUT/recall.md (the merged tables, readable without unpacking).
set -uo pipefail
limit=${1:-450}
source benchmarks/real-model-smollm2/setup_gpu.sh

# The demo of issue 18 on 2 CPU cores of their own (0 and 1; everything else runs on the other cores):
# `kvpot demo --model smollm2-135m` reads 3x SmolLM2's window with InfiniPot and with StreamingLLM.
( time OMP_NUM_THREADS=2 MKL_NUM_THREADS=2 taskset -c 0,1 timeout "$limit" \
  python -m kvpot demo --model smollm2-135m --device cpu ) > "$out/demo-cpu-2-cores.txt" 2>&1 &

eval_() { eval_task "$1" "$2" "$3" --depths 0.1,0.5,0.9 "${@:4}"; }  # eval_ NICE NAME TASK ARGS...

# Tier 1: every method at the same bound of 2,048 entries (Full and InfiniteHiP keep everything; SnapKV and
# D2O are unbounded while reading the prompt, as in their papers), 10 samples x 3 depths per cell.
declare -A BOUND=(
  [full]=full
  [infinipot]=infinipot:catalyst=question
  [citrus]=citrus:keep=1024,chunk_size=512
  [infinitehip]=infinitehip
  [streaming]=streaming:window=1532,chunk_size=512
  [h2o]=h2o:heavy=768,recent=768,chunk_size=512
  [tova]=tova:budget=1536,chunk_size=512
  [snapkv]=snapkv:budget=2048
  [d2o]=d2o:budget=2048
)
for name in "${!BOUND[@]}"; do
  eval_ 0 "b2048-$name-4k16k" passkey --method "${BOUND[$name]}" --lengths 4k,16k --samples 10
  eval_ 0 "b2048-$name-32k" passkey --method "${BOUND[$name]}" --lengths 32k --samples 10
done
# Tier 2: 64K and 128K for the methods that retrieve at 32K, 3 samples x 3 depths.
for name in infinipot citrus infinitehip; do
  eval_ 2 "b2048-$name-64k" passkey --method "${BOUND[$name]}" --lengths 64k --samples 3
  eval_ 2 "b2048-$name-128k" passkey --method "${BOUND[$name]}" --lengths 128k --samples 3
done
# Tier 3: InfiniteHiP's needle, stage by stage and layer by layer (benchmarks/infinitehip/recall.py).
for lengths in 16k,32k 64k 128k; do
  taskset -c "$rest" nice -n 2 timeout "$limit" python benchmarks/infinitehip/recall.py --model smollm2-135m --device cuda \
    --lengths "$lengths" --samples 2 --out "$out/recall-${lengths/,/-}" > "$out/recall-${lengths/,/-}.log" 2>&1 &
done
# Tier 4: each method's own defaults (`kvpot methods`), 2 samples x 3 depths.
eval_ 8 defaults-1 passkey --method streaming --method h2o --method tova --lengths 4k,16k,32k --samples 2
eval_ 8 defaults-2 passkey --method snapkv --method infinipot --method citrus --method d2o --lengths 4k,16k,32k --samples 2
# Tier 5: niah (the task's default options), the bound-2,048 methods, 2 samples x 3 depths.
eval_ 8 niah-1 niah --method "${BOUND[full]}" --method "${BOUND[infinipot]}" --method "${BOUND[citrus]}" \
  --method "${BOUND[infinitehip]}" --lengths 4k,16k,32k --samples 2
eval_ 8 niah-2 niah --method "${BOUND[streaming]}" --method "${BOUND[h2o]}" --method "${BOUND[tova]}" \
  --method "${BOUND[snapkv]}" --method "${BOUND[d2o]}" --lengths 4k,16k,32k --samples 2

wait
cp "$out/demo-cpu-2-cores.txt" "$OUT/demo-cpu-2-cores.txt" 2>/dev/null
cat "$out"/recall-*/recall.md > "$OUT/recall.md" 2>/dev/null
pack_results
tail -n 16 "$OUT/demo-cpu-2-cores.txt" 2>/dev/null
head -c 8000 "$OUT/recall.md" 2>/dev/null
ls -la "$OUT"
