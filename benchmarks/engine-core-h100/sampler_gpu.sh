#!/usr/bin/env bash
# The sampler shared by one sequence and a batch (`kvpot.engine.sampling.pick_rows`, picking modes greedy /
# sample / nucleus) on the GPU machine: the GPU tests of the captured steps that sample (a captured sampling
# step's replays draw at each count; every batch size captured ahead in the three modes; the one-sequence
# paths' tokens on CUDA) and the sampler's own tests. One call of the device tool, ~3 minutes:
#   OUT=$OUT bash benchmarks/engine-core-h100/sampler_gpu.sh
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_graphs.py tests/test_batch.py tests/test_decoding.py \
  2>&1 | tee "$OUT/sampler-gpu-tests.log" | tail -15
python3 -m pytest -q -p no:cacheprovider tests/test_sampling.py 2>&1 | tee "$OUT/sampler-tests.log" | tail -3
