# call 17: per-layer replacements on side streams: GPU tests; every method at 32K (graphs) with 4 streams and with 1; RoCo at 128K; compiled 32K
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-200; }
step tests 200 python -m pytest -q -x tests/test_replace_streams.py tests/test_decoding.py -m gpu
A="bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b"
M="--lengths 32k --method infinipot --method streaming --method tova --method h2o --method snapkv --method d2o --method roco --method cam"
step streams4-32k 150 python -m kvpot $A $M --out $r/streams4-32k
step streams1-32k 150 python -c "import sys, runpy, kvpot.methods.replace as r; r.streams = 1; sys.argv = ['kvpot'] + sys.argv[1:]; runpy.run_module('kvpot', run_name='__main__')" $A $M --out $r/streams1-32k
step streams4-128k 100 python -m kvpot $A --lengths 128k --method streaming --method roco --out $r/streams4-128k
left=$(( 570 - ($(date +%s) - t0) ))
step compiled-32k $left python -m kvpot $A --lengths 32k --method infinipot --method streaming --method d2o --method roco --compile-step --out $r/compiled-32k
tar -czf $OUT/call17.tar.gz -C $OUT r && rm -rf $r
