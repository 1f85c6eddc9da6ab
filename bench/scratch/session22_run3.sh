#!/bin/bash
# Session 22, issue 4: part 2 of the full official run (shapes 5, 7, 6), merged into part 1's file
# (bench/results/official-2026-12-02-nvidia-h200-session22.json, copied to OUT first).
# Usage, on the H200 from the repository root:  bash bench/scratch/session22_run3.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
cp bench/results/official-2026-12-02-nvidia-h200-session22.json "$OUT/"
timeout 500 python3 -m bench.cli --suite official --shapes 5,7,6 --merge --out "$OUT" \
  --tag official-2026-12-02-nvidia-h200-session22 > "$OUT/official-part2.log" 2>&1
echo "official rc=$?"; tail -30 "$OUT/official-part2.log"
