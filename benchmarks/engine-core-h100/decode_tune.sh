#!/usr/bin/env bash
# Issue 43's 64-reader step (<= 17 ms): the batched decode attention's launch shapes swept alone
# (`decode_sweep.py`, stage `sweep`), then the whole step of 64 readers A/B/A with the library's launch shape and
# the sweep's fastest (`step_probe.py --launch-shape`, each in a process of its own; stage `ab`, which reads the
# sweep from $SWEEP, default /tmp/decode-sweep.jsonl, so the two stages may run in two calls on one warm machine).
# Run from the repository root:  OUT=/tmp/out bash benchmarks/engine-core-h100/decode_tune.sh sweep ab
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1
SWEEP=${SWEEP:-/tmp/decode-sweep.jsonl}
for stage in "$@"; do
  case $stage in
    sweep)
      python3 benchmarks/engine-core-h100/decode_sweep.py --batch 64 ${SWEEP_ARGS:---block-n 32 64 128 --warps 4 8 --stages 1 2 3 --splits 1 2} > "$SWEEP"
      cp "$SWEEP" "$OUT/decode-sweep.jsonl"
      python3 - "$SWEEP" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for batch in sorted({r["batch"] for r in rows}, reverse=True):
    ok = sorted((r for r in rows if r["batch"] == batch and "us" in r), key=lambda r: r["us"])
    default = next(r for r in ok if r["default"])
    print(f"batch {batch}: default {default['us']} us ({default['tb_per_s']} TB/s, {default['step_ms']} ms a step); "
          f"fastest: " + "; ".join(f"{r['block_n']},{r['warps']},{r['stages']},{r['splits']} {r['us']} us "
                                   f"({r['tb_per_s']} TB/s, err {r['max_abs_error']:.3g})" for r in ok[:5]))
PY
      ;;
    ab)
      best=$(python3 -c "
import json
rows = [json.loads(l) for l in open('$SWEEP')]
ok = [r for r in rows if r['batch'] == 64 and 'us' in r and r['max_abs_error'] < 0.05]
r = min(ok, key=lambda r: r['us']); print(f\"{r['block_n']},{r['warps']},{r['stages']},{r['splits']}\")")
      echo "fastest launch shape at 64 rows: $best"
      for m in a: b:$best c:; do
        name=${m%%:*} shape=${m#*:}
        mkdir -p "$OUT/step-$name"
        python3 benchmarks/shared-document-h100/step_probe.py --out "$OUT/step-$name" --readers 64 --length 16k \
          --modes copied:graph --steps 200 --profile-steps ${PROFILE:-0} ${shape:+--launch-shape $shape} 2>&1 \
          | grep "^copied" | cut -c1-200
      done
      ;;
  esac
done
