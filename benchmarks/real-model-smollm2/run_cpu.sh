#!/usr/bin/env bash
# The CPU runs of issue 18 on SmolLM2-135M-Instruct (`--model smollm2-135m`), as they were run for cpu/:
# passkey at 4K (inside the 8K window) and 16K (twice it), depth(s) as below, the bound of 2,048 KV entries
# per layer and KV head, --seed 0 (every method reads the same samples), plus the two diagnostics. Each is
# one background process with one thread (the machine is 2 shared cores); results go to cpu/<name>/.
# Run from the repository root:  bash benchmarks/real-model-smollm2/run_cpu.sh
set -uo pipefail
out=records/real-model-smollm2/cpu
mkdir -p "$out"
export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
bg() {  # bg NAME COMMAND... : run in the background, timed, log next to the results
  local name=$1; shift
  ( /usr/bin/time -v "$@" ) > "$out/$name.log" 2>&1 &
}
common=(--model smollm2-135m --device cpu --seed 0)
# Full, InfiniPot (CaP with the question) and StreamingLLM inside the window: 1 sample x 3 depths.
bg passkey-4k-a python -m kvpot eval passkey "${common[@]}" --lengths 4k --depths 0.1,0.5,0.9 --samples 1 \
  --method full --method infinipot:catalyst=question --method streaming:window=1532,chunk_size=512 --out "$out/passkey-4k-a"
# InfiniPot at twice the window: 1 sample at depth 0.5 (the sample tests/test_smollm2.py reads). This one ran
# with torch's default threads (2) and was timed with bash's `time` (cpu/passkey-16k-infinipot.log).
( time OMP_NUM_THREADS=2 python -m kvpot eval passkey "${common[@]}" --lengths 16k --depths 0.5 --samples 1 \
  --method infinipot:catalyst=question --budget 2048 --out "$out/passkey-16k-infinipot" ) > "$out/passkey-16k-infinipot.log" 2>&1 &
# H2O, D2O, TOVA inside the window: their answers and how much of the needle each layer still holds.
bg retention-4k python benchmarks/real-model-smollm2/retention.py --model smollm2-135m --device cpu --lengths 4k \
  --depths 0.1,0.5,0.9 --samples 1 --method h2o:heavy=768,recent=768,chunk_size=512 --method d2o:budget=2048 \
  --method tova:budget=1536,chunk_size=512 --out "$out/retention-4k"
# InfiniteHiP at 16K: does the needle survive each pruning stage, is it read, how much attention does it get.
bg infinitehip-recall-16k python benchmarks/infinitehip/recall.py --model smollm2-135m --device cpu --lengths 16k \
  --depths 0.5 --samples 1 --out "$out/infinitehip-recall-16k"
wait
python benchmarks/real-model-smollm2/tables.py "$out" --out "$out/merged"
