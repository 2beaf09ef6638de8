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
