# call 11: the gemv sweep again (shuffled, cuBLAS before and after), then the 8B and 1B steps with --linear torch / gemv, graphs and compiled
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "ms/token\|median\|rc=\|Error\|error" | tail -n 6 | cut -c1-200; }
(while true; do nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,temperature.memory,power.draw,clocks_throttle_reasons.active --format=csv,noheader >> $r/clocks.csv; sleep 2; done) &
mon=$!
step sweep 120 python benchmarks/kernel-tuning-h100/gemv.py --block-n 1 2 4 8 --warps 2 4 8
cp $r/sweep.log $r/gemv-$KVPOT_GIT_COMMIT.jsonl
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --breakdown"
E="--shape llama3-8b --lengths 32k --method infinipot --method citrus"
step graph-torch-8b 100 $B $E --linear torch --out $r/graph-torch-8b
step graph-gemv-8b 100 $B $E --linear gemv --out $r/graph-gemv-8b
step compiled-gemv-8b 175 $B $E --linear gemv --compile-step --out $r/compiled-gemv-8b
step compiled-torch-8b 175 $B $E --linear torch --compile-step --out $r/compiled-torch-8b
left=$(( 560 - ($(date +%s) - t0) ))
step compiled-gemv-1b $left $B --shape llama3.2-1b --lengths 32k --method infinipot --method citrus --linear gemv --compile-step --out $r/compiled-gemv-1b
kill $mon
tar -czf $OUT/call11.tar.gz -C $OUT r && rm -rf $r
