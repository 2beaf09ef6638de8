# call 10: gemv kernel tests, its launch-shape sweep against cuBLAS, and the 8B step with --linear torch / gemv
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep -v "prefill:\|decode:\|^  File\|^    " | tail -n 8 | cut -c1-200; }
step tests 150 python -m pytest -q -x tests/test_gemv.py tests/test_linear.py
step sweep 200 python benchmarks/kernel-tuning-h100/gemv.py
cp $r/sweep.log $r/gemv-$KVPOT_GIT_COMMIT.jsonl
python - <<'PY' $r/sweep.log
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for shape in dict.fromkeys(r["shape"] for r in rows):
    rs = [r for r in rows if r["shape"] == shape]
    ref = [r for r in rs if r["impl"] == "F.linear"][0]
    best = min((r for r in rs if r["impl"] == "gemv"), key=lambda r: r["us"])
    top = sorted((r for r in rs if r["impl"] == "gemv"), key=lambda r: r["us"])[:4]
    print(shape, "cublas", ref["us"], ref["tb_per_s"], "| best", best["launch"], best["us"], best["tb_per_s"], "| top4", [(t["launch"], t["us"]) for t in top])
PY
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 64 --no-floor --shape llama3-8b --lengths 32k"
step graph-torch 120 $B --method infinipot --linear torch --breakdown --out $r/graph-torch
step graph-gemv 120 $B --method infinipot --linear gemv --breakdown --out $r/graph-gemv
left=$(( 560 - ($(date +%s) - t0) ))
PYTHONFAULTHANDLER=1 step compiled-gemv $left $B --method infinipot --linear gemv --compile-step --breakdown --out $r/compiled-gemv
tar -czf $OUT/call10.tar.gz -C $OUT r && rm -rf $r
