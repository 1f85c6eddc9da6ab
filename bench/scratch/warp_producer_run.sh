#!/bin/bash
# Session 21, issue 3: the producer's loads from one warp (MgpuBlockSizes.warp_producer) against the
# head_dim-64 default (K/V multicast, no ping-pong) at the main case, 5 alternating rounds, plus the same
# switch on the plain tiling (no multicast, ping-pong ring); then Nsight Compute's cycles and instructions.
# Prediction: +0.5-1.5% at the main case (the producer's ~1.0 G of 18.3 G warp instructions gone).
# Usage, on the H200 from the repository root:  bash bench/scratch/warp_producer_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 260 python3 bench/scratch/variant_power.py "$OUT" 5 warp_producer kv_multicast=0+pingpong=1 \
  kv_multicast=0+pingpong=1+warp_producer --causal-only > "$OUT/main.log" 2>&1
echo "main rc=$?"
timeout 150 ncu --clock-control none --cache-control none -k regex:entry_mosaic \
  --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum \
  --csv --page raw python3 bench/scratch/ncu_attention.py 1,16,100000,64,1 default warp_producer \
  2> "$OUT/ncu.err" | python3 bench/scratch/ncu_columns.py > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "^check|^causal|Error|error" "$OUT/main.log" | head -20
cat "$OUT/ncu.txt" | head -20; tail -5 "$OUT/ncu.err"
