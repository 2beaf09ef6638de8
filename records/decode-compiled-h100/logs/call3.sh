# call 3: GPU kernel tests, compile-step diagnosis (stack dump), decode at 32K on llama3-8b for every evicting method
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:" | tail -n 12 | cut -c1-200; }
step kernel-tests 70 python -m pytest -q tests/test_replace_fold.py tests/test_roco_kernel.py tests/test_replace_kernel.py tests/test_cam_kernel.py
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 64 --no-floor"
PYTHONFAULTHANDLER=1 TORCH_LOGS=dynamo,inductor step compile-tiny 60 $B --shape tiny --lengths 32k --method infinipot --compile-step --out $r/compile-tiny
PYTHONFAULTHANDLER=1 TORCHINDUCTOR_COMPILE_THREADS=1 step compile-tiny-1thread 60 $B --shape tiny --lengths 32k --method infinipot --compile-step --out $r/compile-tiny-1thread
step decode-32k 160 $B --shape llama3-8b --lengths 32k --method infinipot --method streaming --method tova --method h2o --method snapkv --method d2o --method roco --method cam --breakdown --out $r/decode-32k
left=$(( 510 - ($(date +%s) - t0) ))
[ $left -gt 20 ] && step tests $left python -m pytest -q -m gpu tests/test_replace.py tests/test_infinitehip_fixed.py tests/test_decoding.py tests/test_batch.py tests/test_replace_launches.py tests/test_step_launches.py
tar -czf $OUT/call3.tar.gz -C $OUT r && rm -rf $r
