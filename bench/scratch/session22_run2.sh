#!/bin/bash
# Session 22, issue 4: the bridge as committed (kept import on by default, compute-stream-only wait in
# forward, the parameter-object check), host cost per step on shapes 11, 13, 8, then the official suite's
# first ten shapes (part 1 of the full run; part 2, shapes 5, 7, 6, is session22_run3.sh).
# Usage, on the H200 from the repository root:  bash bench/scratch/session22_run2.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
timeout 110 python3 -m bench.host_overhead --shapes 11,13,8 --calls 150 --out "$OUT" \
  --tag host-overhead-session22-default > "$OUT/host.log" 2>&1
echo "host rc=$?"; tail -12 "$OUT/host.log"
timeout 420 python3 -m bench.cli --suite official --shapes 11,13,8,12,2,1,3,4,9,10 --no-plot --out "$OUT" \
  --tag official-2026-12-02-nvidia-h200-session22 > "$OUT/official-part1.log" 2>&1
echo "official rc=$?"; tail -22 "$OUT/official-part1.log"
