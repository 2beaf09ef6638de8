#!/usr/bin/env bash
# Issue 46 on one H100: kvpot's InfiniteHiP beside hip-attn 1.2.9 (the authors' Triton kernels), in device calls of at
# most 10 minutes (run tool, timeout_s 600, carry [".whl-hip"]; the timeouts below add up to 860 s: split the parts
# over two calls, e.g. `test speed` then `agree`, as records/hip-reference-h200/kernel-scan/ did):
#
#   OUT=$OUT bash benchmarks/hip-reference-h100/run.sh [PART...]       PART: test agree model accuracy speed
#
#   test      (<= 210 s) tests/test_hip_reference.py (its GPU test: kvpot keeps >= 95% of hip-attn's blocks, with
#                        kvpot's scan='hip'; hip-attn's decode through its paged cache), and the scan='hip' kernel's tests
#   agree     (<= 330 s) kvpot bench hip-reference on random q/k/v, llama3-8b shape, 16K and 128K, the paper's
#                        settings with kvpot's two searches (paper, paper-hipscan) and both hip-attn defaults
#                        (hip-args, hip-config), later and first layers, prefill + decode with/without refresh
#   model     (<= 100 s) paper, paper-hipscan and hip-config on SmolLM2-135M's own q/k/v (layer 0 = early,
#                        layer 3 = late) at 16K and 64K
#   accuracy  (<= 100 s) passkey on SmolLM2 at 16K: infinitehip vs hipattn (hip-attn behind kvpot's hook) vs infinipot
#   speed     (<= 120 s) us per layer call: llama3-8b at 128K, llama3.2-1b at 1M (attention alone, prefill + decode),
#                        kvpot's two searches (paper, paper-hipscan) beside hip-attn's defaults (hip-config)
#
# Every bench row is written as it ends (results.json, "complete": false until the last): a part cut by its timeout
# keeps its rows; a row that raises is recorded with its "error" and the part goes on (exit status 1).
#
# hip-attn comes from its wheel with --no-deps into /tmp/hip-site (.whl-hip/hip_attn-1.2.9-*.whl); kvpot's loader
# (kvpot.bench.hip_shim) needs nothing else of it (no nvtx, tilelang, flash_attn, numba, cupy: placeholders that
# raise if called; the installed Triton compiles its kernels). SmolLM2 parts need the GGUF at $KVPOT_SMOLLM2_GGUF
# (default /tmp/smollm2.gguf) and gguf (.whl/gguf-*.whl), as benchmarks/real-model-smollm2/setup_gpu.sh.
set -u
: "${OUT:?set OUT}"
parts=${*:-test agree model accuracy speed}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export KVPOT_SMOLLM2_GGUF=${KVPOT_SMOLLM2_GGUF:-/tmp/smollm2.gguf} KVPOT_CACHE=${KVPOT_CACHE:-/tmp/kvpot-cache}
python -m pip install -q --no-index --no-deps --target /tmp/hip-site .whl-hip/hip_attn-1.2.9-*.whl || exit 1
gguf_wheel=$(ls .whl/gguf-*.whl .whl-hip/gguf-*.whl 2>/dev/null | head -n 1)
if ! python -c "import gguf" 2>/dev/null && [ -n "$gguf_wheel" ]; then
  python -m pip install -q --no-index --no-deps --target /tmp/hip-site "$gguf_wheel"
fi
# HIP_PYTHONPATH: paths put first, e.g. /tmp/tri34 (Triton 3.4.0, the version hip-attn 1.2.9 pins)
export PYTHONPATH=${HIP_PYTHONPATH:+$HIP_PYTHONPATH:}$PWD/src:/tmp/hip-site
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "commit ${KVPOT_GIT_COMMIT:-$(git log -1 --format='%H %cI' 2>/dev/null)}"
  python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
  'transformers', transformers.__version__)"; } > "$OUT/machine.txt" 2>&1
smol=1; [ -f "$KVPOT_SMOLLM2_GGUF" ] || { smol=0; echo "no SmolLM2 GGUF at $KVPOT_SMOLLM2_GGUF: model/accuracy skipped" | tee -a "$OUT/machine.txt"; }
bench=(python -m kvpot bench hip-reference --device cuda)  # an array: `timeout` runs programs, not shell functions
for part in $parts; do
  start=$(date +%s)
  case $part in
    test) timeout 90 python -m pytest -q -rs tests/test_hip_reference.py > "$OUT/test.log" 2>&1
          timeout 120 python -m pytest -q -rs tests/test_kernels.py -k "hip_stage_scan or each_scan or offloaded" \
            >> "$OUT/test.log" 2>&1 ;;
    agree) timeout 330 "${bench[@]}" --shape llama3-8b --lengths 16k,128k --hip-case paper --hip-case paper-hipscan \
             --hip-case hip-args --hip-case hip-config --hip-layers late,early --queries 1024 --decode-steps 16 \
             --repeats 3 --out "$OUT/agree" > "$OUT/agree.log" 2>&1 ;;
    model) [ $smol = 1 ] && timeout 100 "${bench[@]}" --source model --model smollm2-135m --lengths 16k,64k \
             --hip-case paper --hip-case paper-hipscan --hip-case hip-config --hip-layers late,early --queries 1024 \
             --decode-steps 16 --out "$OUT/model" > "$OUT/model.log" 2>&1 ;;
    accuracy) [ $smol = 1 ] && timeout 100 python benchmarks/hip-reference-h100/accuracy.py "$OUT/accuracy" \
             --lengths 16k --depths 0.5 --samples 1 --time-limit 80 > "$OUT/accuracy.log" 2>&1 ;;
    speed) timeout 60 "${bench[@]}" --shape llama3-8b --lengths 128k --hip-case paper --hip-case paper-hipscan \
             --hip-case hip-config --refresh on --decode-steps 32 --out "$OUT/speed-8b" > "$OUT/speed-8b.log" 2>&1
           timeout 60 "${bench[@]}" --shape llama3.2-1b --lengths 1m --hip-case paper --hip-case paper-hipscan \
             --hip-case hip-config --refresh on --decode-steps 32 --out "$OUT/speed-1b" > "$OUT/speed-1b.log" 2>&1 ;;
    *) echo "unknown part $part" >&2 ;;
  esac
  echo "$part: rc $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/machine.txt"
  tail -n 25 "$OUT/$part"*.log 2>/dev/null
done
