#!/usr/bin/env bash
# The commands of this folder's calls, each former script verbatim under its former path (issue 44
# merged them). A record, not a script to run whole: copy out the section you want.
echo 'commands.sh is a record of several calls: run one section of it, not the file' >&2
exit 1

# ==== logs/call10.sh ====
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

# ==== logs/call11.sh ====
# call 11: the gemv sweep again (shuffled, cuBLAS before and after), then the 8B and 1B steps with --linear torch / gemv, graphs and compiled
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "ms/token\|median\|rc=\|Error\|error" | tail -n 6 | cut -c1-200; }
(while true; do nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,temperature.gpu,temperature.memory,power.draw,clocks_throttle_reasons.active --format=csv,noheader >> $r/clocks.csv; sleep 2; done) &
mon=$!
step sweep 120 python benchmarks/kernel-tuning-h100/gemv.py --block-n 1 2 4 8 --warps 2 4 8
cp $r/sweep.log $r/gemv-$KVPOT_GIT_COMMIT.jsonl
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --breakdown"
E="--shape llama3-8b --lengths 32k --method infinipot --method citrus"
step graph-torch-8b 100 $B $E --linear torch --out $r/graph-torch-8b
step graph-gemv-8b 100 $B $E --linear gemv --out $r/graph-gemv-8b
step compiled-gemv-8b 175 $B $E --linear gemv --compile-step --out $r/compiled-gemv-8b
step compiled-torch-8b 175 $B $E --linear torch --compile-step --out $r/compiled-torch-8b
left=$(( 560 - ($(date +%s) - t0) ))
step compiled-gemv-1b $left $B --shape llama3.2-1b --lengths 32k --method infinipot --method citrus --linear gemv --compile-step --out $r/compiled-gemv-1b
kill $mon
tar -czf $OUT/call11.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call12.sh ====
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

# ==== logs/call13.sh ====
# call 13: RoCo's and D2O's kernels alone; every method compiled at 32K (gemv); RoCo beside StreamingLLM at 128K (graphs)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error\|kernel" | tail -n 12 | cut -c1-220; }
step micro 90 python benchmarks/kernel-tuning-h100/micro.py --d2o-n 4097 --splits 16 --warps 16 --block-n 32 --roco-warps 16 --roco-bits 2 3 4
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b"
step roco-128k 200 $B --lengths 128k --method streaming --method roco --out $r/roco-128k
left=$(( 570 - ($(date +%s) - t0) ))
step compiled-8b $left $B --lengths 32k --method infinipot --method streaming --method tova --method h2o --method snapkv --method d2o --method roco --method cam --compile-step --out $r/compiled-8b
tar -czf $OUT/call13.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call14.sh ====
# call 14: RoCo's and D2O's kernels with the newest entry outside the tile; their decoding beside StreamingLLM and InfiniPot (graphs 32K and 128K, compiled 32K)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
python -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >> $r/machine.txt 2>&1
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error\|kernel" | tail -n 14 | cut -c1-230; }
step tests 150 python -m pytest -q tests/test_roco_kernel.py tests/test_replace_fold.py
step micro 60 python benchmarks/kernel-tuning-h100/micro.py --d2o-n 4097 --splits 8 16 --warps 8 16 --block-n 32 --roco-warps 4 8 16 --roco-bits 2 3
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b"
step graphs-32k 150 $B --lengths 32k --method infinipot --method streaming --method d2o --method roco --method cam --out $r/graphs-32k
step graphs-128k 120 $B --lengths 128k --method streaming --method roco --out $r/graphs-128k
left=$(( 570 - ($(date +%s) - t0) ))
step compiled-32k $left $B --lengths 32k --method infinipot --method streaming --method d2o --method roco --compile-step --out $r/compiled-32k
tar -czf $OUT/call14.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call15.sh ====
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

# ==== logs/call16.sh ====
# call 16: InfLLM at 128K with --linear torch against gemv (each beside StreamingLLM)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "│ [a-z]\|rc=\|Error" | tail -n 4 | cut -c1-200; }
B="python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b --lengths 128k --method streaming --method infllm"
step infllm-torch 200 $B --linear torch --out $r/infllm-torch
step infllm-gemv 200 $B --linear gemv --out $r/infllm-gemv
tar -czf $OUT/call16.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call17.sh ====
# call 17: per-layer replacements on side streams: GPU tests; every method at 32K (graphs) with 4 streams and with 1; RoCo at 128K; compiled 32K
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
t0=$(date +%s)
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-200; }
step tests 200 python -m pytest -q -x tests/test_replace_streams.py tests/test_decoding.py -m gpu
A="bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b"
M="--lengths 32k --method infinipot --method streaming --method tova --method h2o --method snapkv --method d2o --method roco --method cam"
step streams4-32k 150 python -m kvpot $A $M --out $r/streams4-32k
step streams1-32k 150 python -c "import sys, runpy, kvpot.methods.replace as r; r.streams = 1; sys.argv = ['kvpot'] + sys.argv[1:]; runpy.run_module('kvpot', run_name='__main__')" $A $M --out $r/streams1-32k
step streams4-128k 100 python -m kvpot $A --lengths 128k --method streaming --method roco --out $r/streams4-128k
left=$(( 570 - ($(date +%s) - t0) ))
step compiled-32k $left python -m kvpot $A --lengths 32k --method infinipot --method streaming --method d2o --method roco --compile-step --out $r/compiled-32k
tar -czf $OUT/call17.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call18.sh ====
# call 18: the final table: every method at 32K (graphs, gemv, side streams) beside plain transformers; the streams' GPU test
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-200; }
step tests 120 python -m pytest -q -x tests/test_replace_streams.py
step table-32k 240 python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b --lengths 32k --method infinipot --method citrus --method streaming --method tova --method h2o --method snapkv --method d2o --method roco --method cam --baseline hf --out $r/table-32k
tar -czf $OUT/call18.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call19.sh ====
# call 19: D2O's launch shape when the layers' launches overlap on side streams (bench decode at 32K, graphs)
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "│ [a-z]\|rc=\|Error" | tail -n 3 | cut -c1-200; }
for shape in "16 16 32" "16 4 128" "32 4 128" "16 8 32" "32 4 32" "64 4 32"; do
  set -- $shape
  step d2o-$1-$2-$3 90 python -c "
import functools, sys, runpy
import kvpot.kernels.replace as R
R.d2o_step = functools.partial(R.d2o_step, splits=$1, warps=$2, block_n=$3)
sys.argv = ['kvpot', 'bench', 'decode', '--device', 'cuda', '--budget', '4096', '--decode-steps', '128', '--warmup-steps', '16', '--no-floor', '--shape', 'llama3-8b', '--lengths', '32k', '--method', 'infinipot', '--method', 'd2o', '--out', '$r/d2o-$1-$2-$3']
runpy.run_module('kvpot', run_name='__main__')"
done
tar -czf $OUT/call19.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call20.sh ====
# call 20: InfLLM's decoding step at 128K under the profiler (its busiest operators), beside StreamingLLM
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
timeout -s ABRT 240 python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 32 --warmup-steps 8 --no-floor --shape llama3-8b --lengths 128k --method streaming --method infllm --profile --out $r/infllm-profile > $r/infllm-profile.log 2>&1; echo rc=$?
tail -5 $r/infllm-profile.log | cut -c1-200
tar -czf $OUT/call20.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call21.sh ====
# call 21: InfLLM's lookup without the rotation-matrix product: its GPU tests, and its decoding at 128K beside StreamingLLM
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 12 | cut -c1-200; }
step infllm-128k 150 python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b --lengths 128k --method streaming --method infllm --breakdown --out $r/infllm-128k
step tests 120 python -m pytest -q -x tests/test_infllm.py tests/test_infllm_kernel.py
tar -czf $OUT/call21.tar.gz -C $OUT r && rm -rf $r

# ==== logs/call22.sh ====
# call 22: the final code on the GPU: the kernel's and the routing's tests, the decoding GPU tests, InfiniPot and D2O at 32K
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
step() { local name=$1 limit=$2; shift 2; local t=$(date +%s); echo "=== $name"; timeout -s ABRT $limit "$@" > $r/$name.log 2>&1; echo "rc=$? $(( $(date +%s) - t )) s" | tee -a $r/$name.log; grep -v "^\s*$" $r/$name.log | grep "passed\|failed\|FAILED\|│ [a-z]\|rc=\|Error" | tail -n 8 | cut -c1-200; }
step tests 100 python -m pytest -q tests/test_gemv.py tests/test_linear.py tests/test_replace_streams.py
step compile-tests 120 python -m pytest -q -m gpu tests/test_compile_step.py
step bench 90 python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 128 --warmup-steps 16 --no-floor --shape llama3-8b --lengths 32k --method infinipot --method d2o --out $r/bench
tar -czf $OUT/call22.tar.gz -C $OUT r && rm -rf $r
