# call 13: RoCo's and D2O's kernels alone; every method compiled at 32K (gemv); RoCo beside StreamingLLM at 128K (graphs)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error\|kernel" | tail -n 12 | cut -c1-220; }
step micro 90 python benchmarks/kernel-tuning-h100/micro.py --d2o-n 4097 --splits 16 --warps 16 --block-n 32 --roco-warps 16 --roco-bits 2 3 4
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b"
step roco-128k 200 $B --lengths 128k --method streaming --method roco --out $r/roco-128k
left=$(( 570 - ($(date +%s) - t0) ))
step compiled-8b $left $B --lengths 32k --method infinipot --method streaming --method tova --method h2o --method snapkv --method d2o --method roco --method cam --compile-step --out $r/compiled-8b
tar -czf $OUT/call13.tar.gz -C $OUT r && rm -rf $r
