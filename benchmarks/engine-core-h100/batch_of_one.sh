#!/usr/bin/env bash
# Issue 43 on the GPU machine: the two decode runners on one graph manager (engine/graphs.py), their GPU tests,
# and a batch of one beside the one-sequence step:
#   - `kvpot bench throughput --users 1 --document`: one reader of a stored 128K document in the batched
#     scheduler (ITL p50) and through Engine.generate (the one-at-a-time row), same run;
#   - with BREAKDOWN=1, `kvpot bench decode --breakdown`: the one-sequence step's parts (ms and launches a
#     step, uncaptured);
#   - step_probe.py: the batched step of 1 and of 64 readers (CUDA graphs), its cache append in Triton
#     (kvpot.kernels.append) and in PyTorch (the reference), A/B/A.
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
mkdir -p "$OUT/one" "$OUT/decode" "$OUT/probe1" "$OUT/probe64"
TESTS=${TESTS:-tests/test_graphs.py tests/test_append_kernel.py tests/test_batch.py tests/test_decoding.py tests/test_infinitehip_fixed.py tests/test_compile_step.py}
python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS > "$OUT/gpu-tests.txt" 2>&1
python3 -m pytest -q -p no:cacheprovider tests/test_append_kernel.py tests/test_shared_document_kernel.py >> "$OUT/gpu-tests.txt" 2>&1
tail -4 "$OUT/gpu-tests.txt"
python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 1 --document \
  --lengths 128k --new-tokens 256 --device cuda --out "$OUT/one" 2>&1 | tail -12
[ -n "${BREAKDOWN:-}" ] && python3 -m kvpot bench decode --shape llama3-8b --method infinipot:pot_size=4096 \
  --lengths 16k --breakdown --device cuda --out "$OUT/decode" 2>&1 | tail -25
# the batched step with its cache append in Triton and in PyTorch (A/B/A), 1 and 64 readers
for readers in 1 64; do
  python3 benchmarks/shared-document-h100/step_probe.py --out "$OUT/probe$readers" --readers $readers --length 16k \
    --modes copied:graph,copied:graph:reference,copied:graph --steps 200 --profile-steps 0 2>&1 | grep "^copied"
done
rm -f "$OUT"/*/*.png  # (a call returns 8 files: the JSON and the tables)
