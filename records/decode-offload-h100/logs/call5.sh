# call 5: the final code: the GPU-cache tests, then offloaded InfiniteHiP beside InfiniPot on llama3-8b at 128K and
# llama3.2-1b at 1M (flatness in the context, with call 4's 256K)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt; free -g >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-220; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor"
step kernel-tests 60 python -m pytest -q tests/test_kernels.py -k "store_entry or gpu_cache or offload or host_buffers or admitting"
step hip-8b-128k 200 $B --shape llama3-8b --lengths 128k --method infinipot --method infinitehip:offload=true --out $r/hip-8b-128k
step hip-1b-1m 300 $B --shape llama3.2-1b --lengths 1m --method infinipot --method infinitehip:offload=true --out $r/hip-1b-1m
tar -czf $OUT/call5.tar.gz -C $OUT r && rm -rf $r
