#!/usr/bin/env bash
# Issue 48 on one H100: readers of one stored 128K document sharing its entries (Scheduler(share_documents=True),
# cascade attention) beside a copy per reader, on the llama3-8b shape in bf16, InfiniPot with a 4,096-entry pot,
# 256 new tokens each. Targets: 64 readers >= 6,000 output tok/s (copy per reader: 2,414); 256 readers fit at
# >= 10,000 tok/s. Each part fits one device call (under ~4 minutes); run them one per call:
#   OUT=DIR bash benchmarks/shared-document-h100/run.sh tests   # the GPU tests (kernel vs reference, graphs)
#   OUT=DIR bash benchmarks/shared-document-h100/run.sh 64      # 64 readers: copy per reader, then shared
#   OUT=DIR bash benchmarks/shared-document-h100/run.sh 256     # 256 readers: the same two rows
#       (with --reader-room 288 the shared row's readers hold tail slots: 256 of them fit on an H100)
#   OUT=DIR bash benchmarks/shared-document-h100/run.sh N ...  # any other number of readers likewise
#   OUT=DIR bash benchmarks/shared-document-h100/run.sh sweep [shared_sweep.py options]
#       # the GPU kernel tests, then the attention alone over launch shapes (shared_sweep.py; --segments: each
#       # launch alone; --baseline FILE times an earlier copy of the kernel on the same inputs)
# Extra arguments go to `kvpot bench throughput` (e.g. --slots 256, --question-tokens 16).
# Rows: `infinipot [batch]` (a copy per reader) and `infinipot [batch, shared document]`; each row's
# `scheduler` record holds the document loads, readers and copy-on-write events, `pool_bytes` the pool's memory.
set -euo pipefail
part=${1:?usage: run.sh tests|READERS|sweep [options...]}; shift
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu-$part.csv" || true
case "$part" in
  tests)
    # kernel vs reference over the named and the long shapes (fp32, bf16), and through the scheduler with graphs
    python3 -m pytest -q -p no:cacheprovider tests/test_shared_document_kernel.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
    # the CPU-side tests on this machine too (every method's tokens, refcounts, LRU, bytes)
    python3 -m pytest -q -p no:cacheprovider -k shared_document tests/test_shared_document.py 2>&1 \
        | tee "$OUT/shared-tests.log" | tail -5
    # a mixed step's heads and token scores at once (readers' questions read as chunks)
    python3 -m pytest -q -p no:cacheprovider tests/test_mixed_heads.py 2>&1 | tee "$OUT/mixed-tests.log" | tail -3
    # tail slots (reader_room): the arena, and every sharing method's tokens through them
    python3 -m pytest -q -p no:cacheprovider tests/test_shared_document_tails.py 2>&1 | tee "$OUT/tails-tests.log" | tail -3
    ;;
  [1-9]|[1-9][0-9]|[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9])
    # one user one at a time keeps the third row short
    python3 -m kvpot bench throughput --shape llama3-8b --device cuda --method infinipot:pot_size=4096 \
        --users "$part" --lengths 128k --document --share-documents --new-tokens 256 --sequential-users 1 \
        --seed 0 --out "$OUT/readers-$part" "$@"
    python3 - "$OUT/readers-$part/results.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for row in rows:
    record = row.get("scheduler", {})
    print(f"{row['method']:<40} tok/s {row.get('output_tokens_per_second', 0):>9.1f}  slots {row.get('slots')}"
          f"  pool {row.get('pool_bytes', 0) / 2**30:6.2f} GiB  peak {row.get('peak_memory_bytes', 0) / 2**30:6.2f} GiB"
          f"  loads {record.get('document_loads', '-')}  copies {record.get('copy_on_write', '-')}"
          f"  {row.get('error', '')}")
PY
    ;;
  sweep)
    python3 -m pytest -q -p no:cacheprovider tests/test_shared_document_kernel.py 2>&1 | tee "$OUT/gpu-tests.log" | tail -5
    python3 benchmarks/shared-document-h100/shared_sweep.py "$@" > "$OUT/sweep.jsonl"
    python3 - "$OUT/sweep.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
timed = [r for r in rows if "us" in r]
for r in timed:
    if r["kernel"] != "sweep":
        print(r["kernel"], r.get("when", ""), r.get("shapes", r.get("segment", "")), r.get("shape", ""), r.get("keys", ""),
              f"{r['us']:.1f} us", f"{r['step_ms']:.3f} ms a step")
for segment in ("document", "tail"):
    best = sorted((r for r in timed if r.get("segment") == segment), key=lambda r: r["us"])[:5]
    for r in best:
        print(segment, r["shape"], r.get("keys", ""), f"{r['us']:.1f} us", f"err {r.get('max_abs_error', float('nan')):.2e}")
print(sum("error" in r for r in rows), "configurations failed")
PY
    ;;
  *) echo "unknown part $part (tests, a number of readers, or sweep)" >&2; exit 2 ;;
esac
