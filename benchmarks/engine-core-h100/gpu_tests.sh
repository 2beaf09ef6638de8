#!/usr/bin/env bash
# Issue 43/47 on the GPU machine: the batched engine's GPU tests (CUDA graphs beside mixed forwards) and the
# server's abuse probes with the server on CUDA. Needs the serve and test wheels in .whl-serve/ (carried).
set -uo pipefail
python3 -m pip install -q --no-deps --target /tmp/serve-site .whl-serve/*.whl 2>&1 | tail -2
export PYTHONPATH="$PWD/src:/tmp/serve-site" PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_batch.py tests/test_decoding.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
KVPOT_SERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_serve_abuse.py 2>&1 | tee "$OUT/serve-abuse-cuda.log" | tail -15
