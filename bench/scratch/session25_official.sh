#!/bin/bash
# Session 25 (issue 4): a fresh official run of shapes 1-13 at the final build (shape 7's 16-wide head
# blocks included), in two calls on one H200 as in session 22 (one call's limit is 600 s):
#   bash bench/scratch/session25_official.sh 1 OUT   # shapes 11,13,8,12,2,1,3,4,9,10, new file
#   bash bench/scratch/session25_official.sh 2 OUT   # shapes 5,7,6 merged into the committed part-1 file
set -u
PART=$1
OUT=$2
TAG=official-2026-12-02-nvidia-h200-session25
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
if [ "$PART" = 1 ]; then
  timeout 540 python3 -m bench.cli --suite official --shapes 11,13,8,12,2,1,3,4,9,10 --no-plot \
    --out "$OUT" --tag "$TAG" > "$OUT/official-part1.log" 2>&1
  echo "official part 1 rc=$?"; tail -20 "$OUT/official-part1.log"
else
  cp "bench/results/$TAG.json" "$OUT/"
  timeout 500 python3 -m bench.cli --suite official --shapes 5,7,6 --merge --out "$OUT" \
    --tag "$TAG" > "$OUT/official-part2.log" 2>&1
  echo "official part 2 rc=$?"; tail -26 "$OUT/official-part2.log"
fi
