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
