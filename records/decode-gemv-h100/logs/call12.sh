# call 12: GPU tests touched by --linear; every method's decoding at 32K with the default (gemv) linear layers, beside plain transformers
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 16 | cut -c1-200; }
step tests 240 python -m pytest -q -m gpu tests/test_batch.py tests/test_decoding.py tests/test_compile_step.py tests/test_gemv.py tests/test_linear.py
step roco-tests 90 python -m pytest -q -x tests/test_roco_kernel.py
step roco-micro 60 python benchmarks/kernel-tuning-h100/micro.py --only roco --roco-warps 8 16 32 --roco-bits 2 3 4
left=$(( 570 - ($(date +%s) - t0) ))
step table-8b $left python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b --lengths 32k --method infinipot --method streaming --method tova --method h2o --method snapkv --method d2o --method roco --method cam --baseline hf --breakdown --out $r/table-8b
tar -czf $OUT/call12.tar.gz -C $OUT r && rm -rf $r
