#!/usr/bin/env bash
# Issue 45 part 2 on two H100s (device tool kind nvidia-h100-x2): `kvpot serve --replicas 2` against
# `--replicas 1` (both through Ray Serve) and a plain `kvpot serve`, with `kvpot bench serve --url` on
# stored-document readers: USERS (128) streaming users of one uploaded LENGTH (32k) document, NEW (256) new
# tokens each, ignore_eos; each replica has SLOTS (64) slots, so one replica serves the users in two waves and
# two replicas in one. The random-weight llama3-8b shape (bf16) with bench serve's word tokenizer is saved once
# to /tmp/llama3-8b-words (benchmarks/serve-batch-h100/transformers-serve-4k/make_model.py), InfiniPot pot 4,096.
# SLACK (0) is --affinity-slack: every user reads the same document, all arriving at once, so the default (4)
# would leave the replica holding it a few users over its slots (a short second wave); 0 spreads them evenly.
#
# Ray and its requirements are not on the machine. `make_wheels.sh` (beside this) downloads all of them here and cuts
# them into three parts, one a call; its header says how to carry them. Or, the older way, Ray's wheel alone:
# Ray's cp312 wheel (79 MB) is over one call's 64 MiB carry: split it here with
#   split -n 2 ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl ray-wheel.part   (-> ray-wheel.partaa, .partab)
# and put the halves in /tmp of the same warm machine, one per call:
#   call 1 (carry ray-wheel.partaa): cp ray-wheel.partaa /tmp/
#   call 2 (carry ray-wheel.partab): cp ray-wheel.partab /tmp/ && OUT=$OUT bash benchmarks/ray-serve-h100x2/run.sh
# (RAY_WHEEL_PARTS="A B" names other halves.) The script joins them into /tmp/wheels/, checks the SHA-256 and
# installs ray[serve] from the wheels there (its other requirements must be installed or in /tmp/wheels; it
# stops, naming the missing module, if `ray.serve` does not import). Estimate: checkpoint ~90 s, each server
# ~60 s to load, each bench ~30 s: ~6 minutes. Writes under $OUT: serve-R.log, replicas-R/ (results.json,
# summary.md) for R in 2, 1 and plain, and ratio.txt.
set -uo pipefail
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # absolute: Ray's workers import this checkout's kvpot too
out=${OUT:?set OUT}
users=${USERS:-128} slots=${SLOTS:-64} length=${LENGTH:-32k} new=${NEW:-256} slack=${SLACK:-0}
model=/tmp/llama3-8b-words
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-120

if ! python3 -c "import ray.serve" 2>/dev/null && ls /tmp/rayw.part* > /dev/null 2>&1; then
  # the wheels of make_wheels.sh, carried in parts: joined, checked, installed without an index
  cat /tmp/rayw.part* > /tmp/rayw.tar || exit 2
  if [[ -f /tmp/rayw.tar.sha256 ]]; then
    echo "$(cat /tmp/rayw.tar.sha256)  /tmp/rayw.tar" | sha256sum -c - || exit 2
  fi
  tar -xf /tmp/rayw.tar -C /tmp || exit 2
  pip install -q --no-index --find-links /tmp/wheels "ray[serve]==2.60.0" "fastapi>=0.110,<1" "uvicorn>=0.29,<1"
  python3 -c "import ray.serve" || { echo "ray.serve does not import (above: the missing module)"; exit 2; }
fi
if ! python3 -c "import ray.serve" 2>/dev/null; then
  wheel=/tmp/wheels/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
  mkdir -p /tmp/wheels
  # shellcheck disable=SC2086
  cat ${RAY_WHEEL_PARTS:-/tmp/ray-wheel.partaa /tmp/ray-wheel.partab} > "$wheel" || exit 2
  echo "b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a  $wheel" | sha256sum -c - || exit 2
  pip install -q --no-index --find-links /tmp/wheels "ray[serve]==2.60.0" || pip install -q --no-deps "$wheel"
  python3 -c "import ray.serve" || { echo "ray.serve does not import (above: the missing module)"; exit 2; }
fi
python3 -c "import ray; print('ray', ray.__version__)"
[[ -f $model/config.json ]] || python3 benchmarks/serve-batch-h100/transformers-serve-4k/make_model.py "$model" \
  2>&1 | grep -v "it/s\]"

serve_and_bench() {  # NAME PORT [kvpot serve flags...]
  local name=$1 port=$2; shift 2
  python3 -m kvpot serve --model "$model" --device cuda --method infinipot:pot_size=4096 --max-slots "$slots" \
    --max-queue 256 --state-dir "/tmp/kvpot-states-$name" --port "$port" --log-level warning "$@" \
    > "$out/serve-$name.log" 2>&1 &
  local pid=$! ready=0
  for _ in $(seq 300); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then ready=1; break; fi
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  echo "$name: server ready=$ready after ${SECONDS} s"
  if [[ $ready == 1 ]]; then
    timeout 240 python3 -m kvpot bench serve --url "http://127.0.0.1:$port" --users "$users" --lengths "$length" \
      --document --new-tokens "$new" --ignore-eos --out "$out/replicas-$name" 2>&1 | grep -v "it/s\]" | tail -n 12
  fi
  kill -TERM $pid 2>/dev/null
  for _ in $(seq 90); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL $pid 2>/dev/null
  tail -n 5 "$out/serve-$name.log"
}

serve_and_bench 2 8102 --replicas 2 --affinity-slack "$slack" --fronts "${FRONTS:-1}"
serve_and_bench 1 8101 --replicas 1 --affinity-slack "$slack"
serve_and_bench plain 8100
rm -f "$out"/*/*.png
python3 - "$out" <<'PY' | tee "$out/ratio.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rate = {}
for name in ("2", "1", "plain"):
    path = out / f"replicas-{name}" / "results.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    rate[name] = rows[0].get("output_tokens_per_second") if rows else None
    print(name, {k: rows[0].get(k) for k in ("output_tokens_per_second", "ttft_p50_seconds", "itl_p50_ms", "failed",
                                              "rejected")} if rows else "no rows")
if rate.get("2") and rate.get("1"):
    print(f"2 replicas / 1 replica: {rate['2'] / rate['1']:.2f}x (target >= 1.8x)")
if rate.get("1") and rate.get("plain"):
    print(f"1 replica through Ray Serve / plain kvpot serve: {rate['1'] / rate['plain']:.2f}")
PY
