# call 2: offloaded InfiniteHiP in the graph path: its GPU tests, then llama3.2-1b at 256K (InfiniPot, resident
# and offloaded InfiniteHiP in one run), after the fix of the first call's failure;
# then llama3-8b at 256K offloaded (its prefill takes about 250 s)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt; free -g >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-220; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor"
step tests 120 python -m pytest -q -m gpu tests/test_infinitehip_fixed.py tests/test_infinitehip.py
step kernel-tests 90 python -m pytest -q tests/test_kernels.py -k "store_entry or gpu_cache or offload or host_buffers"
step hip-1b-256k 170 $B --shape llama3.2-1b --lengths 256k --method infinipot --method infinitehip --method infinitehip:offload=true --out $r/hip-1b-256k
step hip-8b-256k-offload 290 $B --shape llama3-8b --lengths 256k --method infinitehip:offload=true --out $r/hip-8b-256k-offload
tar -czf $OUT/call2.tar.gz -C $OUT r && rm -rf $r
