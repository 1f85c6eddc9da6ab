#!/bin/bash
# Session 20, issue 3: with K/V multicast on, the consumers without the ping-pong token ring
# (pingpong=0) ran 498.8 against the default's 494.5 TFLOP/s at the main case (3 rounds,
# variant-power-2026-12-02-nvidia-h200.json). Here: 5 rounds of it and its neighbours at the main case,
# then the same switch at shape 14's call (B=8) and at head_dim 128, S=16384 (multicast defaults both),
# then ncu's cycles and instructions of pingpong=0 against the default. Usage, on the H200:
#   bash bench/scratch/pingpong_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 bench/scratch/variant_power.py "$OUT" 5 pingpong=0 pingpong=0+num_stages=3 pingpong=0+num_stages=5 \
  pingpong=0+kv_multicast=0 --causal-only > "$OUT/main.log" 2>&1
echo "main rc=$?"
timeout 150 python3 bench/scratch/variant_power.py "$OUT" 3 pingpong=0 --causal-only --case=8,16,100000,64 > "$OUT/b8.log" 2>&1
echo "b8 rc=$?"
timeout 100 python3 bench/scratch/variant_power.py "$OUT" 3 pingpong=0 --causal-only --case=1,16,16384,128 > "$OUT/hd128.log" 2>&1
echo "hd128 rc=$?"
timeout 100 ncu --clock-control none --cache-control none -k regex:entry_mosaic \
  --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum \
  --csv --page raw python3 bench/scratch/ncu_attention.py 1,16,100000,64,1 default pingpong=0 \
  2> "$OUT/ncu.err" | python3 bench/scratch/ncu_columns.py > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
for f in main b8 hd128; do grep -E "^check|^causal" "$OUT/$f.log"; done
grep "Kernel Name" "$OUT/ncu.txt"
