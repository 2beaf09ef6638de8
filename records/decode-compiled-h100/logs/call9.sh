# call 9: the compiled batched step after the fix; Self-Extend at 1M on llama3.2-1b
set -u
rm -rf /tmp/k /tmp/base && mkdir -p /tmp/k /tmp/base && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:\|^  File\|^    " | tail -n 10 | cut -c1-180; }
step compiled-batches 100 python -m pytest -q -m gpu tests/test_compile_step.py tests/test_batch.py -k "compiled_graph_batches or (graph_batches and llama3)"
left=$(( 560 - ($(date +%s) - t0) ))
step selfextend-1m $left python -m kvpot bench decode --device cuda --shape llama3.2-1b --lengths 1m --budget 4096 --decode-steps 16 --warmup-steps 4 --no-floor --method streaming --method selfextend --out $r/selfextend-1m
tar -czf $OUT/call9.tar.gz -C $OUT r && rm -rf $r
