#!/usr/bin/env bash
# run_modes.sh SECONDS MODE... : run_gpu.sh's modes side by side in one call on a warm device machine, each
# resuming from what earlier calls of the same hold left in /tmp/res (on top of the folders this copy carries).
# Run from kvpot's root (an extracted archive, e.g. /tmp/k) with PYTHONPATH set to its src/ and gguf's site.
# Each mode's tarball goes to $OUT and /tmp/res. The presses' and kvpot's RULER rows share ruler/: a mode's
# tarball holds the other's folders as they were when it started, so only its own folders are unpacked.
set -u
limit=$1; shift
P=records/protocol-smollm2-gpu
mkdir -p /tmp/res
for f in /tmp/res/protocol-*.tar.gz; do
  [ -f "$f" ] || continue
  case $f in *presses*) tar -xzf "$f" -C $P/ruler --wildcards './kvpress-*';;
             *ruler*) tar -xzf "$f" -C $P/ruler --exclude './kvpress-*';;
             *grid*) tar -xzf "$f" -C $P/grid;; *new*) tar -xzf "$f" -C $P/new;; esac
done
for mode in "$@"; do
  mkdir -p /tmp/o-$mode && rm -rf /tmp/o-$mode/*
  OUT=/tmp/o-$mode bash benchmarks/protocol-smollm2-gpu/run_gpu.sh $mode $limit > /tmp/o-$mode.log 2>&1 &
done
wait
for mode in "$@"; do
  cp /tmp/o-$mode/protocol-$mode.tar.gz /tmp/res/ && cp /tmp/o-$mode/protocol-$mode.tar.gz "$OUT/"
  echo "=== $mode"; grep -v "^\s*$" /tmp/o-$mode.log | tail -n 60 | cut -c1-120
done
