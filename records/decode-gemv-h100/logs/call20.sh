# call 20: InfLLM's decoding step at 128K under the profiler (its busiest operators), beside StreamingLLM
set -u
rm -rf /tmp/k && mkdir -p /tmp/k && tar -xzf devrun/kvpot.tar.gz -C /tmp/k && cp devrun/commit /tmp/k/ && cp src/kvpot/models/reference/model/model.safetensors /tmp/k/src/kvpot/models/reference/model/ && cd /tmp/k
export PYTHONPATH=/tmp/k/src KVPOT_GIT_COMMIT=$(cat commit) PYTHONUNBUFFERED=1 TQDM_DISABLE=1
r=$OUT/r; mkdir -p $r
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $r/machine.txt; echo "commit $KVPOT_GIT_COMMIT" >> $r/machine.txt
timeout -s ABRT 240 python -m kvpot bench decode --device cuda --budget 4096 --decode-steps 32 --warmup-steps 8 --no-floor --shape llama3-8b --lengths 128k --method streaming --method infllm --profile --out $r/infllm-profile > $r/infllm-profile.log 2>&1; echo rc=$?
tail -5 $r/infllm-profile.log | cut -c1-200
tar -czf $OUT/call20.tar.gz -C $OUT r && rm -rf $r
