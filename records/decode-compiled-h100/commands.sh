#!/usr/bin/env bash
# The commands of this folder's calls, each former script verbatim under its former path (issue 44
# merged them). A record, not a script to run whole: copy out the section you want.
echo 'commands.sh is a record of several calls: run one section of it, not the file' >&2
exit 1

# ==== logs/call1.sh ====
# session 2026-11-26 call 1: kernel launch-shape timing, compiled step (1B, 8B), offloaded InfiniteHiP on 8B
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
free -g >> $r/machine.txt
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:" | tail -n 14 | cut -c1-200; }
step micro 150 python benchmarks/kernel-tuning-h100/micro.py
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 64 --no-floor"
step eager-1b 60 $B --shape llama3.2-1b --lengths 32k --method infinipot --out $r/eager-1b
step compile-1b 100 $B --shape llama3.2-1b --lengths 32k --method infinipot --compile-step --breakdown --out $r/compile-1b
step compile-8b 150 $B --shape llama3-8b --lengths 32k --method infinipot --compile-step --breakdown --out $r/compile-8b
left=$(( 540 - ($(date +%s) - t0) ))
step offload-8b $left $B --shape llama3-8b --lengths 256k --method infinitehip:offload=true --decode-steps 32 --out $r/offload-8b
tar -czf $OUT/call1.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call2.sh ====
# call 2: the reworked D2O / RoCo kernels alone, compile-step diagnosis on a tiny shape, offloaded InfiniteHiP on 8B
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:" | tail -n 12 | cut -c1-200; }
step kernel-tests 90 python -m pytest -q -x tests/test_replace_fold.py tests/test_roco_kernel.py tests/test_replace_kernel.py
step micro 100 python benchmarks/kernel-tuning-h100/micro.py --splits 8 16 32 64 --warps 4 8 16 --block-n 32 64 128 --roco-warps 8 16 32
B="python -m kvpot bench decode --device cuda --decode-steps 64 --no-floor"
TORCH_LOGS=recompiles,graph_breaks step compile-tiny 120 $B --budget 4096 --shape tiny --lengths 32k --method infinipot --compile-step --out $r/compile-tiny
left=$(( 500 - ($(date +%s) - t0) ))
step offload-8b $left $B --shape llama3-8b --lengths 256k --method infinitehip:offload=true --decode-steps 32 --out $r/offload-8b
tar -czf $OUT/call2.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call3.sh ====
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

# ==== logs/call4.sh ====
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

# ==== logs/call5.sh ====
# call 5: the compiled step on llama3-8b (every evicting method) and llama3.2-1b (InfiniPot, CItruS)
set -u
rm -rf /tmp/k /tmp/base && mkdir -p /tmp/k /tmp/base && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:\|^  File\|^    " | tail -n 10 | cut -c1-180; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 64 --no-floor"
PYTHONFAULTHANDLER=1 step compile-8b 330 $B --shape llama3-8b --lengths 32k --method infinipot --method citrus --method streaming --method h2o --method tova --method d2o --method roco --method cam --compile-step --breakdown --out $r/compile-8b
left=$(( 540 - ($(date +%s) - t0) ))
PYTHONFAULTHANDLER=1 step compile-1b-citrus $left $B --shape llama3.2-1b --lengths 32k --method infinipot --method citrus --compile-step --out $r/compile-1b-citrus
tar -czf $OUT/call5.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call6.sh ====
# call 6: the compiled step on llama3-8b; plain transformers with and without cuDNN attention
set -u
rm -rf /tmp/k /tmp/base && mkdir -p /tmp/k /tmp/base && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:\|^  File\|^    " | tail -n 10 | cut -c1-180; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 64 --no-floor"
PYTHONFAULTHANDLER=1 step compile-8b 300 $B --shape llama3-8b --lengths 32k --method infinipot --method citrus --method streaming --method h2o --method d2o --method roco --compile-step --breakdown --out $r/compile-8b
left=$(( 520 - ($(date +%s) - t0) )); half=$(( left / 2 ))
step hf-sdpa-default $half $B --shape llama3-8b --lengths 32k --method infinipot --baseline hf --sdpa default --out $r/hf-sdpa-default
left=$(( 530 - ($(date +%s) - t0) ))
step hf-sdpa-no-cudnn $left $B --shape llama3-8b --lengths 32k --method infinipot --baseline hf --sdpa no-cudnn --out $r/hf-sdpa-no-cudnn
tar -czf $OUT/call6.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call7.sh ====
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

# ==== logs/call8.sh ====
# call 8: the compiled batched step diagnosis (recompiles, graph breaks), merge kernel tests
set -u
rm -rf /tmp/k /tmp/base && mkdir -p /tmp/k /tmp/base && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:\|^  File\|^    " | tail -n 10 | cut -c1-180; }
TORCH_LOGS=recompiles,graph_breaks step compiled-batches 150 python -m pytest -q -x -m gpu tests/test_compile_step.py -k compiled_graph_batches
step merge-tests 60 python -m pytest -q tests/test_replace_kernel.py -k merge
tar -czf $OUT/call8.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call9.sh ====
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
