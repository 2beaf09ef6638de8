# call 7: GPU tests of this session's changes
set -u
rm -rf /tmp/k /tmp/base && mkdir -p /tmp/k /tmp/base && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:\|^  File\|^    " | tail -n 10 | cut -c1-180; }
step tests 250 python -m pytest -q -m gpu tests/test_bench_sdpa.py tests/test_infllm_prefill_ops.py tests/test_infllm_kernel.py tests/test_infllm.py tests/test_compile_step.py tests/test_batch.py tests/test_launch_sizes.py -k "not qwen3"
left=$(( 280 - ($(date +%s) - t0) ))
step kernel-tests $left python -m pytest -q tests/test_roco_kernel.py tests/test_cam_kernel.py tests/test_replace_kernel.py tests/test_replace_launches.py tests/test_step_launches.py
tar -czf $OUT/call7.tar.gz -C $OUT r && rm -rf $r
