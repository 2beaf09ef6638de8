#!/usr/bin/env bash
# The commands of this folder's calls, each former script verbatim under its former path (issue 44
# merged them). A record, not a script to run whole: copy out the section you want.
echo 'commands.sh is a record of several calls: run one section of it, not the file' >&2
exit 1

# ==== logs/call1.sh ====
# call 1: offloaded InfiniteHiP in the graph path: its GPU tests, then llama3.2-1b at 256K (InfiniPot, resident
# and offloaded InfiniteHiP in one run); InfLLM at an equal read against StreamingLLM on llama3-8b at 128K
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt; free -g >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-220; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor"
step tests 170 python -m pytest -q -m gpu tests/test_infinitehip_fixed.py tests/test_infinitehip.py
step kernel-tests 90 python -m pytest -q tests/test_kernels.py -k "store_entry or gpu_cache or offload or host_buffers"
step hip-1b-256k 220 $B --shape llama3.2-1b --lengths 256k --method infinipot --method infinitehip --method infinitehip:offload=true --out $r/hip-1b-256k
step infllm-8b-128k 200 $B --shape llama3-8b --lengths 128k --method streaming --method infllm:window=1792,topk=16 --method infllm --out $r/infllm-8b-128k
tar -czf $OUT/call1.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call2.sh ====
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

# ==== logs/call3.sh ====
# call 3: llama3-8b at 256K, InfiniPot and offloaded InfiniteHiP (graph path) in one run
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt; free -g >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-220; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor"
step hip-8b-256k 560 $B --shape llama3-8b --lengths 256k --method infinipot --method infinitehip:offload=true --out $r/hip-8b-256k
tar -czf $OUT/call3.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call4.sh ====
# call 4: the one-launch GPU-cache update (admit_newest): the GPU tests, then llama3.2-1b and llama3-8b at 256K
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt; free -g >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-220; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor"
step tests 100 python -m pytest -q -m gpu tests/test_infinitehip_fixed.py
step kernel-tests 60 python -m pytest -q tests/test_kernels.py -k "store_entry or gpu_cache or offload or host_buffers or admitting"
step hip-1b-256k 150 $B --shape llama3.2-1b --lengths 256k --method infinipot --method infinitehip --method infinitehip:offload=true --out $r/hip-1b-256k
step hip-8b-256k 330 $B --shape llama3-8b --lengths 256k --method infinipot --method infinitehip:offload=true --out $r/hip-8b-256k
tar -czf $OUT/call4.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call5.sh ====
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

# ==== logs/call6.sh ====
# call 6: llama3.2-1b at 1M: InfiniPot, then offloaded InfiniteHiP (its prefill alone takes about 6-7 minutes)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt; free -g >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-220; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor"
step hip-1b-1m 570 $B --shape llama3.2-1b --lengths 1m --method infinipot --method infinitehip:offload=true --out $r/hip-1b-1m
tar -czf $OUT/call6.tar.gz -C $OUT r && rm -rf $r
