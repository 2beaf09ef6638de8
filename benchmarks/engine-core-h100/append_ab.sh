#!/usr/bin/env bash
# Issue 43: the append kernel's GPU test, a second batch-of-one run, and 64 readers with the cache append in
# Triton and in PyTorch (A/B/A, each mode in a process of its own: two pools of 64 readers do not fit an H100).
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
mkdir -p $OUT/one $OUT/p64a $OUT/p64b $OUT/p64c
python3 -m pytest -q -p no:cacheprovider tests/test_append_kernel.py 2>&1 | tail -2
python3 -m kvpot bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 1 --document \
  --lengths 128k --new-tokens 256 --device cuda --out "$OUT/one" 2>&1 | grep -E "infinip|ot \[|batch|time\]" | head -8
for m in a:copied:graph b:copied:graph:reference c:copied:graph; do
  python3 benchmarks/shared-document-h100/step_probe.py --out "$OUT/p64${m%%:*}" --readers 64 --length 16k \
    --modes ${m#*:} --steps 200 --profile-steps 0 2>&1 | grep "^copied"
done
rm -f $OUT/*/*.png
