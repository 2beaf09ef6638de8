#!/usr/bin/env bash
# Issue 43 on the GPU machine, for the varlen kernel (`kernels/varlen.py`; built on a CPU, not yet run on a GPU):
# its tests against the reference (bf16 and the 8B shape's mixed step included) and in the engine's mixed step,
# the batched engine's GPU tests, then the mixed step with the varlen kernel beside the former per-chunk attention
# and beside prompts read apart (`mixed_probe.py`, 32 users decoding while 4 prompts of 16K are read).
# Run from the repository root:  OUT=/tmp/out bash benchmarks/engine-core-h100/varlen_gpu.sh
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/test_varlen_kernel.py tests/test_decode_kernel.py 2>&1 | tail -3
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_batch.py 2>&1 | tail -3
python3 benchmarks/engine-core-h100/mixed_probe.py --out "$OUT/varlen-probe" \
  --modes "${MODES:-apart,mix,mix-sdpa,apart,mix,mix-sdpa}" 2>&1 | grep -E "^(apart|mix)" | cut -c1-220
