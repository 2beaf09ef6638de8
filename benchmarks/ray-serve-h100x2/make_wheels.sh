#!/usr/bin/env bash
# The wheels `run.sh` needs on the GPU machine, which has no PyPI: Ray Serve 2.60.0 with its requirements (kvpot
# serve's fastapi and uvicorn among them), for CPython 3.12 on x86-64 Linux, packed into one archive and cut into
# parts that each travel beside the working tree in one device call (64 MiB a call; the tree is ~23 MB):
#
#   bash benchmarks/ray-serve-h100x2/make_wheels.sh [DIR (.rayw)] [PART_MB (40, MiB)]
#
# writes DIR/1/rayw.part00, DIR/2/rayw.part01, ... (DIR is git-ignored through .git/info/exclude). Then, on one warm
# machine of kind nvidia-h200-x2 (or -h100-x2), back to back (a machine keeps /tmp for 30 s between calls):
#   call k < last (carry DIR/k):  cp DIR/k/* /tmp/
#   last call (carry DIR/last):   cp DIR/last/* /tmp/ && OUT=$OUT bash benchmarks/ray-serve-h100x2/run.sh
# run.sh joins /tmp/rayw.part*, unpacks the wheels into /tmp/wheels and installs from there without an index.
# numpy is left out: the machine's torch has it.
set -euo pipefail
dir=${1:-.rayw} part_mb=${2:-40}
work=$(mktemp -d)
python3 -m pip download -q "ray[serve]==2.60.0" "fastapi>=0.110,<1" "uvicorn>=0.29,<1" --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any --only-binary=:all: -d "$work/wheels"
rm -f "$work"/wheels/numpy-*.whl
tar -cf "$work/rayw.tar" -C "$work" wheels
rm -rf "$dir"
mkdir -p "$dir"
split -b "${part_mb}M" -d "$work/rayw.tar" "$work/rayw.part"
i=0
for part in "$work"/rayw.part*; do
  i=$((i + 1))
  mkdir -p "$dir/$i"
  mv "$part" "$dir/$i/"
done
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
sha256sum "$work/rayw.tar" | cut -d' ' -f1 > "$dir/$i/rayw.tar.sha256"  # travels with the last part
rm -rf "$work"
echo "$i parts in $dir (carry $dir/1 ... $dir/$i, one a call); the archive's SHA-256 in $dir/$i/rayw.tar.sha256"
ls -l "$dir"/*/
