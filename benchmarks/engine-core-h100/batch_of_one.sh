#!/usr/bin/env bash
# Issue 43 on the GPU machine: the two decode runners on one graph manager (engine/graphs.py), their GPU tests,
# and a batch of one beside the one-sequence step:
#   - `kvpot bench throughput --users 1 --document`: one reader of a stored 128K document in the batched
#     scheduler (ITL p50) and through Engine.generate (the one-at-a-time row), same run;
#   - with BREAKDOWN=1, `kvpot bench decode --breakdown`: the one-sequence step's parts (ms and launches a
#     step, uncaptured);
#   - step_probe.py --readers 1: the batched step of one reader, with its CUDA graph and uncaptured under the
#     profiler (the operators' CUDA time).
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
mkdir -p "$OUT/one" "$OUT/decode" "$OUT/probe"
TESTS=${TESTS:-tests/test_graphs.py tests/test_append_kernel.py tests/test_batch.py tests/test_decoding.py tests/test_infinitehip_fixed.py tests/test_compile_step.py}
python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS > "$OUT/gpu-tests.txt" 2>&1
python3 -m pytest -q -p no:cacheprovider tests/test_append_kernel.py tests/test_shared_document_kernel.py >> "$OUT/gpu-tests.txt" 2>&1
tail -4 "$OUT/gpu-tests.txt"
python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 1 --document \
  --lengths 128k --new-tokens 256 --device cuda --out "$OUT/one" 2>&1 | tail -12
[ -n "${BREAKDOWN:-}" ] && python3 -m kvpot bench decode --shape llama3-8b --method infinipot:pot_size=4096 \
  --lengths 16k --breakdown --device cuda --out "$OUT/decode" 2>&1 | tail -25
python3 benchmarks/shared-document-h100/step_probe.py --out "$OUT/probe" --readers 1 --length 16k \
  --modes copied:graph,copied:static --steps 64 --profile-steps 3 2>&1 | grep "^copied"
rm -f "$OUT"/*/*.png  # (a call returns 8 files: the JSON and the tables)
