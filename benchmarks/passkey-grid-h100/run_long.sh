#!/usr/bin/env bash
# More 512K and 1M samples for issues 4 and 5 (InfiniPot full method, StreamingLLM, CItruS shared cache), passkey,
# on one H100: one process per seed (each 1 sample x depths 0.1/0.5/0.9), all at once, one CPU thread each; seeds
# 100+ so the samples differ from run.sh's seed-0 samples. Results: $OUT/long/<name>/ packed into $OUT/long.tar.gz.
# Run from the repository root:  OUT=/tmp/out bash benchmarks/passkey-grid-h100/run_long.sh [SECONDS]
set -uo pipefail
limit=${1:-520}
out=${OUT:?set OUT}/long
mkdir -p "$out"
export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
launch() {  # launch NAME ARGS...
  local name=$1; shift
  timeout "$limit" python -m kvpot eval passkey --device cuda --depths 0.1,0.5,0.9 --samples 1 "$@" \
    --out "$out/$name" > "$out/$name.log" 2>&1 &
}
for seed in 100 101 102 103 104 105 106 107; do
  launch "infinipot-s$seed" --method infinipot:catalyst=question,nuc_ratio=0.5 --lengths 512k,1m --seed "$seed"
done
for seed in 100 101; do
  launch "streaming-s$seed" --method streaming:window=1532,chunk_size=512 --lengths 512k,1m --seed "$seed"
done
for seed in 100 101 102; do
  launch "citrus512k-s$seed" --method citrus:cache=shared --lengths 512k --seed "$seed"
  launch "citrus1m-s$seed" --method citrus:cache=shared --lengths 1m --seed "$seed"
done
wait
tar -czf "$OUT/long.tar.gz" --exclude='*.png' -C "$OUT" long
rm -rf "$out"
ls -la "$OUT"/long.tar.gz
