# call 4: compiled step after the launcher fix, D2O/RoCo at 32K, InfLLM prefill before/after, kvpress attention test
set -u
rm -rf /tmp/k /tmp/base && mkdir -p /tmp/k /tmp/base && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && tar -xzf devrun/base.tar.gz -C /tmp/base && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:\|^  File\|^    " | tail -n 10 | cut -c1-180; }
step gpu-tests 60 python -m pytest -q -m gpu tests/test_kvpress_attention.py tests/test_launch_sizes.py tests/test_replace_fold.py
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 64 --no-floor"
PYTHONFAULTHANDLER=1 step compile-tiny 60 $B --shape tiny --lengths 32k --method infinipot --compile-step --out $r/compile-tiny
step decode-32k 110 $B --shape llama3-8b --lengths 32k --method infinipot --method streaming --method h2o --method d2o --method roco --out $r/decode-32k
PYTHONFAULTHANDLER=1 step compile-1b 150 $B --shape llama3.2-1b --lengths 32k --method infinipot --compile-step --breakdown --out $r/compile-1b
P="python -m kvpot bench prefill --shape llama3-8b --device cuda --lengths 128k --budget 4096 --method streaming --method infllm --no-floor --repeats 2"
left=$(( 530 - ($(date +%s) - t0) )); half=$(( left / 2 ))
[ $half -gt 30 ] && PYTHONPATH=/tmp/base/src KVPOT_GIT_COMMIT=0fbf40b step infllm-base $half $P --out $r/infllm-base
left=$(( 540 - ($(date +%s) - t0) ))
[ $left -gt 30 ] && step infllm-after $left $P --out $r/infllm-after
tar -czf $OUT/call4.tar.gz -C $OUT r && rm -rf $r
