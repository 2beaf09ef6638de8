# call 15: D2O's launch shapes with the find's smaller tile; InfLLM's decoding step at 128K, part by part, beside StreamingLLM
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│\|rc=\|Error" | tail -n 30 | cut -c1-200; }
step micro 90 python benchmarks/kernel-tuning-h100/micro.py --only d2o --d2o-n 4097 --splits 8 16 32 --warps 4 8 16 --block-n 32 64 128 256
python - $r/micro.log <<'PY'
import json, sys
rows = sorted((json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"kernel": "d2o')), key=lambda r: r["us"])
for r in rows[:8]: print(r["splits"], r["warps"], r["block_n"], round(r["us"], 2), r["default"])
PY
step infllm-128k 300 python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b --lengths 128k --method streaming --method infllm --breakdown --out $r/infllm-128k
tar -czf $OUT/call15.tar.gz -C $OUT r && rm -rf $r
