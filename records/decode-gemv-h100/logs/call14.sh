# call 14: RoCo's and D2O's kernels with the newest entry outside the tile; their decoding beside StreamingLLM and InfiniPot (graphs 32K and 128K, compiled 32K)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error\|kernel" | tail -n 14 | cut -c1-230; }
step tests 150 python -m pytest -q tests/test_roco_kernel.py tests/test_replace_fold.py
step micro 60 python benchmarks/kernel-tuning-h100/micro.py --d2o-n 4097 --splits 8 16 --warps 8 16 --block-n 32 --roco-warps 4 8 16 --roco-bits 2 3
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b"
step graphs-32k 150 $B --lengths 32k --method infinipot --method streaming --method d2o --method roco --method cam --out $r/graphs-32k
step graphs-128k 120 $B --lengths 128k --method streaming --method roco --out $r/graphs-128k
left=$(( 570 - ($(date +%s) - t0) ))
step compiled-32k $left $B --lengths 32k --method infinipot --method streaming --method d2o --method roco --compile-step --out $r/compiled-32k
tar -czf $OUT/call14.tar.gz -C $OUT r && rm -rf $r
