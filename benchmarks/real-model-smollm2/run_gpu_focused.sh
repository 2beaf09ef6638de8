#!/usr/bin/env bash
# Issue 18, the focused re-run (fits the GPU's memory; run_gpu.sh's 31 processes did not): SmolLM2-135M-Instruct,
# passkey at the same bound of 2,048 KV entries: InfiniPot at 16K/32K/64K (does its earlier 16K-128K retrieval
# reproduce?), CItruS and InfiniteHiP at 16K/32K, the other methods at 4K/16K; 12 processes. SmolLM2 is tiny (135M parameters, bf16), so one process is bound
# by Python's kernel launches and leaves the GPU mostly idle: the grid runs as one process per method and
# length group, all at once, each on one CPU thread, lower tiers under `nice` so that the main grid gets the
# CPUs first. Every `kvpot eval` uses --seed 0, so every method sees the same samples. A process stopped by
# the time limit keeps the rows it finished (results.jsonl is written row by row; tables.py counts them).
#
# Needs what setup_gpu.sh (sourced) checks: the GGUF file at $KVPOT_SMOLLM2_GGUF (default /tmp/smollm2.gguf)
# and `gguf` (installed from .whl/ when missing).
# Run from the repository root:  OUT=/tmp/out bash benchmarks/real-model-smollm2/run_gpu.sh [SECONDS]
# SECONDS (default 200) limits every eval process; the whole script takes about SECONDS + 60.
# Results: $OUT/smollm2-gpu.tar.gz (every eval folder, logs, merged summary and heatmaps), plus
# $OUT/summary.md and $OUT/recall.md (the merged tables, readable without unpacking).
set -uo pipefail
limit=${1:-200}
source benchmarks/real-model-smollm2/setup_gpu.sh

eval_() { eval_task 0 "$1" passkey --depths 0.1,0.5,0.9 "${@:2}"; }  # eval_ NAME ARGS...
infinipot=infinipot:catalyst=question
eval_ b2048-infinipot-16k --method $infinipot --lengths 16k --samples 10
eval_ b2048-infinipot-32k --method $infinipot --lengths 32k --samples 10
eval_ b2048-infinipot-64k --method $infinipot --lengths 64k --samples 3
eval_ default-infinipot-16k32k --method infinipot --lengths 16k,32k --samples 3
eval_ b2048-citrus-16k32k --method citrus:keep=1024,chunk_size=512 --lengths 16k,32k --samples 5
eval_ b2048-infinitehip-16k32k --method infinitehip --lengths 16k,32k --samples 5
eval_ b2048-streaming-4k16k --method streaming:window=1532,chunk_size=512 --lengths 4k,16k --samples 5
eval_ b2048-h2o-4k16k --method h2o:heavy=768,recent=768,chunk_size=512 --lengths 4k,16k --samples 5
eval_ b2048-tova-4k16k --method tova:budget=1536,chunk_size=512 --lengths 4k,16k --samples 5
eval_ b2048-snapkv-4k16k --method snapkv:budget=2048 --lengths 4k,16k --samples 5
eval_ b2048-d2o-4k16k --method d2o:budget=2048 --lengths 4k,16k --samples 5
eval_ b2048-full-4k16k --method full --lengths 4k,16k --samples 5
wait
pack_results 6000
