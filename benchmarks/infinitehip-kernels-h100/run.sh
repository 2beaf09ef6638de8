#!/usr/bin/env bash
# Issue 9 on one H100: the Triton kernels' tests, then one layer's attention (llama3-8b shape) for InfiniteHiP
# vs dense SDPA at 128K/512K/1M (decode over a refresh period; prefill = one 2,048-query chunk), the PyTorch
# reference path at 128K for comparison, and end-to-end llama3.2-1b at 1M.
# Run from the repository root:  OUT=/tmp/out bash benchmarks/infinitehip-kernels-h100/run.sh [PARTS]
# PARTS (default "tests attention reference e2e"; also "offload", "sweep" (prefill scan/attention tiles) and
# "e2e8b" (llama3-8b at 512K, offloaded)) picks what runs.
set -uo pipefail
parts=${1:-tests attention reference e2e}
export PYTHONPATH=$PWD/src
out=${OUT:?set OUT}
has() { [[ " $parts " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if has tests; then
  timeout 300 python -m pytest -q -n 8 -p no:cacheprovider -rf tests/test_kernels.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -n 40 > "$out/tests.txt"
  tail -n 5 "$out/tests.txt"
fi
if has sweep; then
  timeout 200 python benchmarks/infinitehip-kernels-h100/prefill_sweep.py "$out/prefill-sweep.json" 2>&1 | tail -n 10
fi
if has attention; then
  timeout 300 python -m kvpot bench attention --shape llama3-8b --method infinitehip --lengths 128k,512k,1m \
    --block 2048 --device cuda --out "$out/attention" 2>&1 | grep -v "it/s\|run/s" | tail -n 20
fi
if has reference; then
  timeout 240 python -m kvpot bench attention --shape llama3-8b --method infinitehip:kernels=torch --lengths 128k \
    --block 2048 --device cuda --out "$out/attention-torch" 2>&1 | grep -v "it/s\|run/s" | tail -n 12
fi
if has e2e; then
  timeout 280 python -m kvpot bench decode --shape llama3.2-1b --method infinitehip --lengths 1m --decode-steps 32 \
    --device cuda --out "$out/e2e-1b" 2>&1 | grep -v "it/s\|run/s" | tail -n 12
fi
if has offload; then
  timeout 300 python -m kvpot bench attention --shape llama3-8b --method infinitehip:offload=true --lengths ${OFFLOAD_LENGTHS:-128k,1m} \
    --block 2048 --device cuda --out "$out/attention-offload" 2>&1 | grep -v "it/s\|run/s" | tail -n 12
fi
if has e2e8b; then  # weights are random (built from the config); the KV cache lives in pinned host memory
  timeout ${E2E8B_TIMEOUT:-560} python -m kvpot bench decode --shape llama3-8b --method infinitehip:offload=true \
    --lengths ${E2E8B_LENGTH:-512k} --decode-steps 32 --no-floor --device cuda --out "$out/e2e-8b" \
    > "$out/e2e-8b.log" 2>&1
  echo "exit $?"; grep -v "it/s\|run/s" "$out/e2e-8b.log" | tail -n 12; free -g | head -2
fi
rm -f "$out"/*/*.png
