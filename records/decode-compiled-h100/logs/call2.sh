# call 2: the reworked D2O / RoCo kernels alone, compile-step diagnosis on a tiny shape, offloaded InfiniteHiP on 8B
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:" | tail -n 12 | cut -c1-200; }
step kernel-tests 90 python -m pytest -q -x tests/test_replace_fold.py tests/test_roco_kernel.py tests/test_replace_kernel.py
step micro 100 python benchmarks/kernel-tuning-h100/micro.py --splits 8 16 32 64 --warps 4 8 16 --block-n 32 64 128 --roco-warps 8 16 32
B="python -m kvpot bench decode --device cuda --decode-steps 64 --no-floor"
TORCH_LOGS=recompiles,graph_breaks step compile-tiny 120 $B --budget 4096 --shape tiny --lengths 32k --method infinipot --compile-step --out $r/compile-tiny
left=$(( 500 - ($(date +%s) - t0) ))
step offload-8b $left $B --shape llama3-8b --lengths 256k --method infinitehip:offload=true --decode-steps 32 --out $r/offload-8b
tar -czf $OUT/call2.tar.gz -C $OUT r && rm -rf $r
