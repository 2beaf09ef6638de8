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
