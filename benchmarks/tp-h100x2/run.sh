#!/usr/bin/env bash
# Issue 45, part 1: tensor parallelism (transformers' TP plan, NCCL) on two GPUs (the device tool's nvidia-h100-x2;
# H200s serve too: say which). Each PART fits one call of the device tool (~4 min or less):
#
#   OUT=$OUT bash benchmarks/tp-h100x2/run.sh PART        (run tool: kind nvidia-h100-x2, timeout_s 600)
#
# PART:
#   tests     the GPU variant of tests/test_tensor_parallel.py (every method and the scheduler, TP=2 on NCCL, with
#             CUDA-graph decoding whose captured step holds the collectives) and the CPU/gloo ones (~2 min)
#   decode    llama3-8b shape (random weights, bf16), InfiniPot and CItruS at a 4,096 bound, batch-1 decode at
#             128K: TP=2 (torchrun) vs one GPU vs the device_map split, each its own bench folder. Target: TP=2
#             <= 0.7x the single-GPU ms/token.
#   document  64 readers of one stored 128K document (bench throughput --document), InfiniPot: TP=2 vs one GPU.
#             Target: TP=2 >= 1.5x the single-GPU output tok/s.
#   compiled  the decode part's InfiniPot row with --compile-step (regional torch.compile of the captured step) at TP=2
#             and on one GPU: whether fusing the step's small kernels lets TP=2 gain where launches, not weights,
#             bound the step.
#   batch1    the decode part's InfiniPot row at TP=2 and on one GPU, with graphs and with --compile-step, no
#             device_map row (~5 min): the 0.7x target's figures in one call.
#   readers   benchmarks/tp-h100x2/readers_profile.py: the steady step of 64 readers of a stored 128K document at
#             TP=2 and on one GPU (graphs), timed and profiled by kernel (~4 min).
#   70b       llama3-70b shape, TP=2, batch-1 decode after 16K (InfiniPot 4,096); on two H100s the 70B weights
#             (141 GB) do not fit: run it on nvidia-h200-x2 (or TP=4 on nvidia-h100-x4 with TP=4). Target:
#             <= 1.3x the weights-read limit (141 GB / 2 / per-GPU bandwidth: ~15 ms on two H200s).
# Output: $OUT/<part>/<run>/results.json and summary.md (rank 0; rank r's own timings in <run>/rank-r/), and a
# log per part.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:?set OUT}
part=${1:?give a PART: tests, decode, batch1, compiled, document, readers or 70b}
TP=${TP:-2}
mkdir -p "$out/$part"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-120
tp() { torchrun --standalone --nproc-per-node "$TP" -m kvpot "$@"; }
one() { python3 -m kvpot "$@"; }
quiet() { grep --line-buffered -v "it/s\]\|run/s\]\|tok/s\]\|MISSING\|^model\.\|Warning"; }
decode=(bench decode --shape llama3-8b --budget 4096 --lengths "${LENGTHS:-128k}" --decode-steps 64 --warmup-steps 8
        --method infinipot --method citrus --no-floor)
document=(bench throughput --shape llama3-8b --method infinipot:pot_size=4096 --users 64 --document
          --lengths "${LENGTHS:-128k}" --new-tokens 256)
case "$part" in
  tests)
    timeout 300 python3 -m pytest -v -p no:cacheprovider -rf -k tensor_parallel tests/test_tensor_parallel.py \
      > "$out/tests/tests.txt" 2>&1
    echo "tests exit $?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$out/tests/tests.txt" | tail -n 40 ;;
  decode)
    tp "${decode[@]}" --tp "$TP" --out "$out/decode/tp$TP" 2>&1 | quiet
    one "${decode[@]}" --device cuda --out "$out/decode/one-gpu" 2>&1 | quiet
    one "${decode[@]}" --device-map auto --out "$out/decode/device-map" 2>&1 | quiet ;;
  compiled)
    tp "${decode[@]:0:12}" --method infinipot --no-floor --compile-step --tp "$TP" --out "$out/compiled/tp$TP" 2>&1 | quiet
    one "${decode[@]:0:12}" --method infinipot --no-floor --compile-step --device cuda --out "$out/compiled/one-gpu" \
      2>&1 | quiet ;;
  document)
    tp "${document[@]}" --tp "$TP" --out "$out/document/tp$TP" 2>&1 | quiet
    one "${document[@]}" --device cuda --out "$out/document/one-gpu" 2>&1 | quiet ;;
  batch1)
    tp "${decode[@]:0:12}" --method infinipot --no-floor --tp "$TP" --out "$out/batch1/tp$TP" 2>&1 | quiet
    one "${decode[@]:0:12}" --method infinipot --no-floor --device cuda --out "$out/batch1/one-gpu" 2>&1 | quiet
    tp "${decode[@]:0:12}" --method infinipot --no-floor --compile-step --tp "$TP" --out "$out/batch1/tp$TP-compiled" \
      2>&1 | quiet
    one "${decode[@]:0:12}" --method infinipot --no-floor --compile-step --device cuda --out "$out/batch1/one-gpu-compiled" \
      2>&1 | quiet ;;
  readers)
    torchrun --standalone --nproc-per-node "$TP" benchmarks/tp-h100x2/readers_profile.py "$out/readers" 2>&1 | quiet
    python3 benchmarks/tp-h100x2/readers_profile.py "$out/readers" 2>&1 | quiet ;;
  70b)
    tp bench decode --shape llama3-70b --budget 4096 --lengths "${LENGTHS:-16k}" --decode-steps 64 --warmup-steps 8 \
      --method infinipot --no-floor --tp "$TP" --out "$out/70b/tp$TP" 2>&1 | quiet ;;
  *) echo "unknown PART $part (tests, decode, batch1, compiled, document, readers, 70b)"; exit 2 ;;
esac
rm -f "$out/$part"/*/*.png "$out/$part"/*/*/*.png
for f in "$out/$part"/*/summary.md; do [[ -f $f ]] && { echo "== $f"; cat "$f"; }; done
