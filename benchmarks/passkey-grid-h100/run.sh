#!/usr/bin/env bash
# InfiniPot's Table 4 ablation (issue 4) and CItruS' Fig. 6 comparison (issue 5) on the reference model,
# passkey, on one H100. The reference model is tiny (6M parameters), so one process is bound by Python's
# kernel launches and leaves the GPU mostly idle: the grid runs as one process per method (and per
# length group), all at once, each on one CPU thread. Every process uses the same --seed, so every
# method sees the same samples. Results: $OUT/grid/<group>/ (each a `kvpot eval` folder), packed into
# $OUT/grid.tar.gz (the device tool returns few files).
# Run from the repository root:  OUT=/tmp/out bash benchmarks/passkey-grid-h100/run.sh [SECONDS]
set -uo pipefail
limit=${1:-520}
out=${OUT:?set OUT}/grid
mkdir -p "$out"
export PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
common=(--device cuda --depths 0.1,0.5,0.9)

launch() {  # launch NAME ARGS... : one `kvpot eval passkey` in the background, its log next to its results
  local name=$1; shift
  timeout "$limit" python -m kvpot eval passkey "${common[@]}" "$@" --out "$out/$name" > "$out/$name.log" 2>&1 &
}

# issue 4, Table 4: 32K and 128K at 7 samples x 3 depths = 21 per cell; every compressed variant <= 2,048 entries
i=0
for m in full truncate:budget=2048 streaming:window=1532,chunk_size=512 \
    infinipot:catalyst=none,nuc_ratio=0,positions=absolute infinipot:catalyst=none,nuc_ratio=0 \
    infinipot:catalyst=generic,nuc_ratio=0 infinipot:catalyst=question,nuc_ratio=0 \
    infinipot:catalyst=question,nuc_ratio=0.5 infinipot:catalyst=generic,nuc_ratio=0.5; do
  launch "t4-$i" --method "$m" --lengths 32k,128k --samples 7; i=$((i + 1))
done
# issue 4: 512K and 1M, the full method and StreamingLLM, 2 samples x 3 depths
launch t4-long-infinipot --method infinipot:catalyst=question,nuc_ratio=0.5 --lengths 512k,1m --samples 2
launch t4-long-streaming --method streaming:window=1532,chunk_size=512 --lengths 512k,1m --samples 1

# issue 5, Fig. 6: l_s=256, k=768 and the baselines at the same peak memory, 32K and 128K at 21 per cell
i=0
for m in citrus:cache=none citrus:cache=shared citrus:cache=individual streaming:window=1020,chunk_size=256 \
    tova:budget=1024,chunk_size=256 h2o:heavy=512,recent=512,chunk_size=256; do
  launch "f6-$i" --method "$m" --lengths 32k,128k --samples 7; i=$((i + 1))
done
# issue 5: 512K and 1M, the shared cache, 1 sample x 3 depths
launch f6-long-shared --method citrus:cache=shared --lengths 512k,1m --samples 1

wait
tar -czf "$OUT/grid.tar.gz" --exclude='*.png' -C "$OUT" grid
tail -n 3 "$out"/*.log; rm -rf "$out"
for f in "$OUT"/grid.tar.gz; do ls -la "$f"; done
