#!/usr/bin/env bash
# Issue 18: where InfiniPot (CaP-Q, pot 2,048) misses on SmolLM2, probed on one H100 (bf16, --seed 0):
#   - inside the window (7K), every depth, with CR-RoPE (positions=reset, the default) and without it
#     (positions=absolute: kept entries keep their true positions, all < 8,192), Full beside them;
#   - at 16K, depths 0.7-0.98: how the miss depends on the tokens read after the needle;
# and CItruS' defaults at 32K, which run_gpu_rest.sh's time limit cut at 18 of 30 samples.
# `run_gpu_probe.sh SECONDS nuc`: NuC alone (nuc_ratio=1: every KV head keeps the same tokens, so CR-RoPE gives a
# token the same position in every head and layer) at 7K with and without CR-RoPE, and at 16K.
# `run_gpu_probe.sh SECONDS share`: InfiniPot with `share=layer` (a layer's KV heads keep the same tokens) and
# `share=model` (every head of every layer does), CaP-Q, at 7K (every depth) and 16K; share=model to 128K and with
# the generic catalyst; NuC alone at 32K and 64K beside it.
# `run_gpu_probe.sh SECONDS trace`: when InfiniPot loses the key (retention.py --trace) with share=model at 32K and
# 128K and per head at 128K; NuC alone at 128K.
# `run_gpu_probe.sh SECONDS ending`: does the haystack's last sentence matter? At 32,768 and 131,072 tokens the
# context ends mid-sentence ("... again. The grass") and at 16,384 with a full stop ("... The sky is blue."); these
# lengths move the end by a few tokens: 32,770 and 131,074 end with "The grass is green.", 16,376 with "The grass".
# `run_gpu_probe.sh SECONDS complete`: the bound-2,048 grid's 64K cells at 10 x 3 (InfiniPot, InfiniteHiP, CItruS)
# and every other method at 64K and 128K (2 x 3), so each method has a cell at every length.
# Run from the repository root:  OUT=/tmp/out bash benchmarks/real-model-smollm2/run_gpu_probe.sh [SECONDS]
set -uo pipefail
limit=${1:-500}
source benchmarks/real-model-smollm2/setup_gpu.sh
rest=0-$((cores - 1))

eval_() { eval_task 0 "$1" passkey "${@:2}"; }  # eval_ NAME ARGS...
all=0.1,0.3,0.5,0.7,0.8,0.9,0.95
if [ "${2:-}" = nuc ]; then
  eval_ probe-7k-nuc-reset --method infinipot:catalyst=question,nuc_ratio=1 --lengths 7k --depths $all --samples 5
  eval_ probe-7k-nuc-absolute --method infinipot:catalyst=question,nuc_ratio=1,positions=absolute --lengths 7k \
    --depths $all --samples 5
  eval_ probe-16k-nuc-reset --method infinipot:catalyst=question,nuc_ratio=1 --lengths 16k --depths 0.1,0.5,0.9 --samples 10
elif [ "${2:-}" = share ]; then
  q=infinipot:catalyst=question
  eval_ share-7k-layer --method $q,share=layer --lengths 7k --depths $all --samples 5
  eval_ share-7k-model --method $q,share=model --lengths 7k --depths $all --samples 5
  eval_ share-16k-layer --method $q,share=layer --lengths 16k --depths 0.1,0.5,0.9 --samples 10
  eval_ share-16k-model --method $q,share=model --lengths 16k --depths 0.1,0.5,0.9 --samples 10
  eval_ share-16k32k-model-generic --method infinipot:share=model --lengths 16k,32k --depths 0.1,0.5,0.9 --samples 10
  eval_ share-32k-model --method $q,share=model --lengths 32k --depths 0.1,0.5,0.9 --samples 10
  eval_ share-64k-model --method $q,share=model --lengths 64k --depths 0.1,0.5,0.9 --samples 5
  eval_ share-128k-model --method $q,share=model --lengths 128k --depths 0.1,0.5,0.9 --samples 5
  eval_ nuc-32k64k --method $q,nuc_ratio=1 --lengths 32k,64k --depths 0.1,0.5,0.9 --samples 5
elif [ "${2:-}" = trace ]; then
  q=infinipot:catalyst=question
  trace_() {  # trace_ NAME ARGS... : retention.py --trace in the background
    local name=$1; shift
    taskset -c "$rest" timeout "$limit" python benchmarks/real-model-smollm2/retention.py --model smollm2-135m \
      --device cuda --trace "$@" --out "$out/$name" > "$out/$name.log" 2>&1 &
  }
  trace_ trace-32k-model --method $q,share=model --lengths 32k --depths 0.1,0.5,0.9 --samples 2
  trace_ trace-128k-model --method $q,share=model --lengths 128k --depths 0.1,0.9 --samples 2
  trace_ trace-128k-head --method $q --lengths 128k --depths 0.1,0.9 --samples 2
  trace_ trace-64k-model --method $q,share=model --lengths 64k --depths 0.1 --samples 2
  eval_ nuc-128k --method $q,nuc_ratio=1 --lengths 128k --depths 0.1,0.5,0.9 --samples 5
  wait
  cat "$out"/trace-*/retention.md > "$OUT/summary.md" 2>/dev/null
elif [ "${2:-}" = ending ]; then
  q=infinipot:catalyst=question
  eval_ end-32770-model --method $q,share=model --lengths 32770 --depths 0.1,0.5,0.9 --samples 10
  eval_ end-32770-head --method $q --lengths 32770 --depths 0.1,0.5,0.9 --samples 10
  eval_ end-32770-generic --method infinipot --lengths 32770 --depths 0.1,0.5,0.9 --samples 10
  eval_ end-16376-model --method $q,share=model --lengths 16376 --depths 0.1,0.5,0.9 --samples 10
  eval_ end-131074-model --method $q,share=model --lengths 131074 --depths 0.1,0.5,0.9 --samples 5
  eval_ end-131074-head --method $q --lengths 131074 --depths 0.1,0.5,0.9 --samples 5
  eval_ end-131074-infinitehip --method infinitehip --lengths 131074 --depths 0.1,0.5,0.9 --samples 5
  eval_ end-131074-citrus --method citrus:keep=1024,chunk_size=512 --lengths 131074 --depths 0.1,0.5,0.9 --samples 3
elif [ "${2:-}" = complete ]; then
  d=0.1,0.5,0.9
  eval_ b2048-infinipot-64k --method infinipot:catalyst=question --lengths 64k --depths $d --samples 10
  eval_ b2048-infinitehip-64k --method infinitehip --lengths 64k --depths $d --samples 10
  eval_ b2048-citrus-64k --method citrus:keep=1024,chunk_size=512 --lengths 64k --depths $d --samples 10
  for m in full snapkv:budget=2048 streaming:window=1532,chunk_size=512 h2o:heavy=768,recent=768,chunk_size=512 \
           tova:budget=1536,chunk_size=512 d2o:budget=2048; do
    eval_ "b2048-${m%%:*}-64k128k" --method "$m" --lengths 64k,128k --depths $d --samples 2
  done
else
eval_ probe-7k-reset --method infinipot:catalyst=question --lengths 7k --depths $all --samples 5
eval_ probe-7k-absolute --method infinipot:catalyst=question,positions=absolute --lengths 7k --depths $all --samples 5
eval_ probe-7k-full --method full --lengths 7k --depths $all --samples 5
eval_ probe-16k-late --method infinipot:catalyst=question --lengths 16k --depths 0.7,0.8,0.85,0.9,0.95,0.98 --samples 5
eval_ probe-16k-late-generic --method infinipot --lengths 16k --depths 0.7,0.8,0.85,0.9,0.95,0.98 --samples 5
eval_ default-citrus-32k --method citrus --lengths 32k --depths 0.1,0.5,0.9 --samples 10
fi
wait
pack_results
