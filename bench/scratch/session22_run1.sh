#!/bin/bash
# Session 22, issue 4: the bridge's kept import of x (TTJ_BRIDGE_KEEP_X_IMPORT=1) on the GPU, first time.
# Usage, on the H200 from the repository root:  bash bench/scratch/session22_run1.sh OUT
# 1. host_overhead on shapes 11, 13, 8 with the switch off, then on (same machine, one after the other):
#    the host cost per step, and the ordering check (x rewritten behind busy torch work; must stay 0);
# 2. ttj-bench --suite official --shapes 8,11,13 with the switch on (25 seeds, harness timing).
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
TTJ_BRIDGE_KEEP_X_IMPORT=0 timeout 120 python3 -m bench.host_overhead --shapes 11,13,8 --calls 150 --out "$OUT" \
  --tag host-overhead-session22-keep0 > "$OUT/keep0.log" 2>&1
echo "keep0 rc=$?"; tail -22 "$OUT/keep0.log"
TTJ_BRIDGE_KEEP_X_IMPORT=1 timeout 120 python3 -m bench.host_overhead --shapes 11,13,8 --calls 150 --out "$OUT" \
  --tag host-overhead-session22-keep1 > "$OUT/keep1.log" 2>&1
echo "keep1 rc=$?"; tail -22 "$OUT/keep1.log"
TTJ_BRIDGE_KEEP_X_IMPORT=1 timeout 260 python3 -m bench.cli --suite official --shapes 8,11,13 --out "$OUT" \
  --tag official-session22-keep1-shapes-8-11-13 > "$OUT/official.log" 2>&1
echo "official rc=$?"; tail -30 "$OUT/official.log"
