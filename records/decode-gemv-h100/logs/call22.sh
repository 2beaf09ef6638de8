# call 22: the final code on the GPU: the kernel's and the routing's tests, the decoding GPU tests, InfiniPot and D2O at 32K
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 8 | cut -c1-200; }
step tests 100 python -m pytest -q tests/test_gemv.py tests/test_linear.py tests/test_replace_streams.py
step compile-tests 120 python -m pytest -q -m gpu tests/test_compile_step.py
step bench 90 python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b --lengths 32k --method infinipot --method d2o --out $r/bench
tar -czf $OUT/call22.tar.gz -C $OUT r && rm -rf $r
