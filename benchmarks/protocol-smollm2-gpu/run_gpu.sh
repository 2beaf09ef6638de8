#!/usr/bin/env bash
# Issue 32 on one H100: SmolLM2-135M-Instruct under the prompt-robust protocol (every sample in 3 wordings,
# the filler cut at sentence ends, each count with its 95% Wilson interval), each mode in calls of 5-6 minutes.
#
#   grid     passkey, every method at the bound of 2,048 KV entries per layer and KV head, 4K to 128K:
#            3 templates x plain/chat template x depths 0.1/0.5/0.9 x 1 sample = 18 per cell at 4K-32K, and
#            depth 0.5 only at 64K and 128K (3 x 2 = 6 per cell: fewer samples at the longest lengths, not none);
#            22 processes, one per method and length group, one CPU thread each (SmolLM2 is launch-bound).
#   new      issue 31's comparison methods in the same passkey cells at 4K-64K (PyramidKV, Scissorhands, RoCo,
#            SirLLM, CaM at 2,048 entries; Self-Extend and InfLLM keep every entry), one process per method,
#            and niah (one needle) under the protocol for every method at 4K-64K, depth 0.5 (3 templates x
#            plain/chat = 6 per cell), two methods per process: 23 processes.
#   ruler    kvpot eval ruler at 4K and 16K (the 11 tasks kvpot generates: niah_single_1/2/3,
#            niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe), 3 templates inside the chat
#            template (how kvpress' pipeline and RULER prompt an instruct model), 1 sample each = 33 items per
#            method and length; kvpot's Full, SnapKV, PyramidKV and InfiniPot (the paper's, and one kept set per
#            model) at compression ratios 0.25, 0.5 and 0.75: one process per method and ratio (13).
#   presses  kvpress 0.5.5's SnapKV, PyramidKV, ExpectedAttention, StreamingLLM and TOVA presses on the same
#            items at the same ratios, into ruler/ too: one process per press and ratio (15). A call of its own:
#            kvpress' workers are CPU-bound and starved beside kvpot's processes (20-40 s an answer).
# Run from the repository root:  OUT=/tmp/out bash benchmarks/protocol-smollm2-gpu/run_gpu.sh grid|new|ruler|presses [SECONDS]
# Needs what ../real-model-smollm2/setup_gpu.sh checks (the GGUF at /tmp/smollm2.gguf, gguf importable or in
# .whl/), and for presses kvpress' folder: /tmp/kvpress-site, or .whl-kvpress/ (../kvpress-env/make_wheels.sh)
# installed into it here. SECONDS (default 400) is each process's `kvpot eval --time-limit`: it starts no sample
# (or kvpress answer) that would end later, then writes its summary (`timeout` a minute later is only a safety
# net). Every process runs with --resume from what records/protocol-smollm2-gpu/MODE/ already holds (copied
# into $out first): unpack a call's results there and call the same mode again to continue. Results:
# $OUT/protocol-MODE.tar.gz (one folder per process: config.json, results.jsonl, summary.*, logs); unpack it
# into records/protocol-smollm2-gpu/MODE/ and run `kvpot report --write`.
set -uo pipefail
mode=${1:?grid, new, ruler or presses}
limit=${2:-400}
case $mode in grid|new|ruler|presses) ;; *) echo "mode: grid, new, ruler or presses" >&2; exit 2;; esac
source benchmarks/real-model-smollm2/setup_gpu.sh
folder=$mode; [ "$mode" = presses ] && folder=ruler  # the presses' rows sit beside kvpot's RULER rows
before=records/protocol-smollm2-gpu/$folder  # earlier calls' folders: every process resumes its own
if [ -d "$before" ]; then
  for folder in "$before"/*/; do [ -f "$folder/config.json" ] && cp -r "$folder" "$out/"; done
  cp "$before"/*.log "$out/" 2>/dev/null
  [ -f "$before/machine.txt" ] && { echo "--- earlier calls:"; cat "$before/machine.txt"; } >> "$out/machine.txt"
fi
rest=0-$((cores - 1))  # no demo beside this run: every core
common=(--model smollm2-135m --device cuda --seed 0 --templates all)

run_() {  # run_ NAME ARGS... : one background `kvpot eval`, continuing its folder, finishing by $limit s; its log
  # (appended to by every call) beside its folder
  local name=$1; shift
  taskset -c "$rest" timeout $((limit + 60)) python -m kvpot eval "$@" "${common[@]}" --out "$out/$name" \
    --time-limit "$limit" --resume >> "$out/$name.log" 2>&1 &
}

specs=(full snapkv:budget=2048 infinipot:catalyst=question infinipot:catalyst=question,share=model
       infinipot:catalyst=question,nuc_ratio=1 infinitehip citrus:keep=1024,chunk_size=512
       tova:budget=1536,chunk_size=512 streaming:window=1532,chunk_size=512 h2o:heavy=768,recent=768,chunk_size=512
       d2o:budget=2048)
# issue 31's methods at the same 2,048 entries (budget + chunk where they read in chunks, as TOVA above)
new_specs=(pyramidkv:budget=2048 scissorhands:budget=1536,chunk_size=512 roco:budget=1536,chunk_size=512
           sirllm:pot_size=2048 cam:start=4,recent=1532,chunk_size=512 selfextend infllm)
if [ "$mode" = grid ]; then
  for i in "${!specs[@]}"; do
    run_ "m$i-4k32k" passkey --method "${specs[$i]}" --chat both --lengths 4k,16k,32k --depths 0.1,0.5,0.9 --samples 1
    run_ "m$i-64k128k" passkey --method "${specs[$i]}" --chat both --lengths 64k,128k --depths 0.5 --samples 1
  done
elif [ "$mode" = new ]; then
  for i in "${!new_specs[@]}"; do
    run_ "n$i-passkey" passkey --method "${new_specs[$i]}" --chat both --lengths 4k,16k,32k --depths 0.1,0.5,0.9 \
      --samples 1
    run_ "n$i-passkey64k" passkey --method "${new_specs[$i]}" --chat both --lengths 64k --depths 0.5 --samples 1
  done
  every=("${specs[@]}" "${new_specs[@]}")
  for ((i = 0; i < ${#every[@]}; i += 2)); do
    pair=(--method "${every[$i]}")
    [ $((i + 1)) -lt ${#every[@]} ] && pair+=(--method "${every[$((i + 1))]}")
    run_ "niah$i" niah "${pair[@]}" --chat both --lengths 4k,16k,32k,64k --depths 0.5 --samples 1
  done
else
  site=/tmp/kvpress-site
  if [ ! -d "$site/kvpress" ] && ls .whl-kvpress/*.whl > /dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps --target "$site" .whl-kvpress/*.whl
  fi
  [ -d "$site/kvpress" ] || { echo "no kvpress folder at $site (and no .whl-kvpress/): presses not run" >&2; }
  tasks=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe
  ruler=(ruler --tasks "$tasks" --lengths 4k,16k --samples 1 --chat chat)
  [ "$mode" = ruler ] && run_ full "${ruler[@]}" --method full
  for ratio in 0.25 0.5 0.75; do
    for spec in snapkv pyramidkv infinipot:catalyst=question infinipot:catalyst=question,share=model; do
      [ "$mode" = ruler ] || break
      run_ "$(echo "$spec" | tr ':=,' '___')-$ratio" "${ruler[@]}" --method "$spec" --compression-ratios "$ratio"
    done
    # kvpress' workers (transformers' eager generate) are CPU-bound: under 43 processes an answer took 20-40 s,
    # so `ruler` runs kvpot's rows and `presses` the presses' rows, each in calls of their own
    if [ "$mode" = presses ] && [ -d "$site/kvpress" ]; then
      for press in snapkv pyramidkv expected_attention streaming_llm tova; do
        run_ "kvpress-$press-$ratio" "${ruler[@]}" --baseline kvpress --press "$press" --compression-ratios "$ratio" \
          --kvpress-path "$site"
      done
    fi
  done
fi
wait
echo "evals done after $(( $(date +%s) - started )) s" >> "$out/machine.txt"
tail -n 2 "$out"/*.log > "$out/log-tails.txt" 2>&1
tar -czf "$OUT/protocol-$mode.tar.gz" -C "$out" . && rm -rf "$out"  # presses: unpack into ruler/
python - "$OUT/protocol-$mode.tar.gz" <<'EOF'
import io, json, sys, tarfile
from collections import defaultdict
counts = defaultdict(lambda: [0, 0])  # (method, length or group) -> [correct, total]
with tarfile.open(sys.argv[1]) as tar:
    for member in tar.getmembers():
        if member.name.endswith("results.jsonl"):
            for line in io.TextIOWrapper(tar.extractfile(member), encoding="utf-8"):
                row = json.loads(line)
                key = (row["method"], row.get("group") or row["length"])
                counts[key][0] += bool(row["correct"])
                counts[key][1] += 1
for (method, where), (correct, total) in sorted(counts.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
    print(f"{method:60s} {where!s:>7} {correct:3d}/{total}")
EOF
echo "total $(( $(date +%s) - started )) s"
