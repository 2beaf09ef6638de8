#!/usr/bin/env bash
# Issue 21 on two H200s (the device tool's nvidia-h200-x2), in ONE call of at most ~9 minutes:
#
#   OUT=$OUT bash benchmarks/multi-gpu-h200x2/run.sh            (run tool: kind nvidia-h200-x2, timeout_s 600)
#
# 1. tests (<= 120 s): tests/test_devices.py's gpu tests: every method on a tiny model split over both GPUs gives
#    the tokens of the same model on one GPU, each layer's cache on its layer's GPU (InfiniteHiP's Triton
#    kernels launched on each layer's GPU).
# 2. run.py (until BUDGET s after the start, default 540): llama3-70b (random weights, bf16, 141 GB) built
#    directly split over both GPUs, then, most important first, each writing its JSON as soon as it has it:
#    InfiniPot (4,096) prefill at 128K -> decode ms/token after 16K -> Full prefill at 128K -> InfiniPot
#    reading 1M tokens with marks at 32K/128K/256K/512K/768K/1M (time and each GPU's peak memory).
#
# Estimate (from records/bench-h100: llama3-8b InfiniPot 128K 7.2 s, 1M 57.7 s on one H100; 70B is ~9x the
# FLOPs and 2.5x the layers): build ~30 s, InfiniPot 128K ~45-65 s, decode ~40 s, Full 128K ~80-110 s, 1M
# ~300-520 s. The 1M run will likely be cut; its last mark then gives the measured rate up to that point.
# Everything under $OUT comes back: placement.json, stream-1m.json, tests.txt, run.log, and per bench step a
# folder (results.json, summary.md).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
out=${OUT:?set OUT}
budget=${BUDGET:-540}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-120
if [[ -z "${SKIP_TESTS:-}" ]]; then
  # -v: one line per test as it ends, so a run cut by the timeout still says which passed
  timeout 120 python3 -m pytest -v -p no:cacheprovider -rf -m gpu tests/test_devices.py > "$out/tests.txt" 2>&1
  echo "tests exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/tests.txt" | tail -n 16
fi
left=$((budget - SECONDS))
echo "run.py gets ${left} s"
timeout --signal=INT --kill-after=10 "$left" python3 benchmarks/multi-gpu-h200x2/run.py "$out" ${STEPS:-} 2>&1 \
  | grep --line-buffered -v "it/s\]\|run/s\]" | tee "$out/run.log"
echo "run.py exit ${PIPESTATUS[0]} after ${SECONDS} s"
rm -f "$out"/*/*.png
python3 - "$out" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
gib = lambda b: "-" if b is None else f"{b / 2**30:.1f}"
for name in ("prefill-128k", "decode-16k", "full-128k"):
    path = out / name / "results.json"
    if path.exists():
        for row in json.loads(path.read_text())["rows"]:
            cells = {k: row.get(k) for k in ("method", "length", "prefill_seconds", "ms_per_token", "oom")}
            print(name, cells, "peak GiB", {d: gib(b) for d, b in (row.get("peak_memory_by_device") or {}).items()})
path = out / "stream-1m.json"
if path.exists():
    data = json.loads(path.read_text())
    print("stream-1m complete:", data["complete"])
    for mark in data["marks"] + ([data["last"]] if "last" in data else []):
        print(f"  {mark['tokens']:>9,} tokens {mark['seconds']:8.1f} s  peak GiB",
              {d: gib(b) for d, b in mark["peak_memory_by_device"].items()})
EOF
