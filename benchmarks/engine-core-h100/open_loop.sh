#!/usr/bin/env bash
# Issue 43's headline workload, open loop, on one GPU: 48 fresh prompts of 2K-32K tokens (drawn), 64-256 new
# tokens each (drawn), Poisson arrivals at 1 request/s, the llama3-8b shape in bf16, InfiniPot with a 4,096-entry
# pot. Rows: the batch (`--mix auto`: prompt chunks in the decoding rows' forward on a GPU, since 2026-11-28), the
# first requests one at a time, and with --mixed / --prompts-apart the batch with prompt chunks in the decoding
# rows' forward / in forwards of their own; extra arguments add rows or change the budget (e.g. --baseline hf
# --hf-timeout 200, --prefill-tokens 1024).
# Usage: OUT=DIR bash benchmarks/engine-core-h100/open_loop.sh NAME [kvpot bench throughput options...]
set -euo pipefail
name=$1; shift
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m kvpot bench throughput --shape llama3-8b --device cuda --method infinipot:pot_size=4096 \
    --users 48 --length-mix 2k-32k --new-tokens-mix 64-256 --arrival-rate 1 --seed 0 \
    --slo-ttft 1.5 --slo-itl 0.06 --out "$OUT/$name" "$@"
