#!/bin/bash
# Session 20, issue 3: the K/V multicast default (session 19) against its neighbours at the main case
# (B=1 H=16 S=100000 hd 64, causal), in alternating rounds with clock, power and NVML energy per call
# (variant_power.py), then Nsight Compute's cycle count of the multicast build against the plain one
# (is multicast's +1% fewer cycles, or less energy at the same cycles?). Usage, on the H200 from the
# repository root:  bash bench/scratch/multicast_tune_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 330 python3 bench/scratch/variant_power.py "$OUT" 3 kv_multicast=0 num_stages=3 num_stages=5 num_stages=6 \
  block_kv=192+num_stages=3 pingpong=0 --causal-only > "$OUT/variant-power.log" 2>&1
echo "variant_power rc=$?"
timeout 200 ncu --clock-control none --cache-control none -k regex:entry_mosaic \
  --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum \
  --csv --page raw python3 bench/scratch/ncu_attention.py 1,16,100000,64,1 default kv_multicast=0 \
  > "$OUT/ncu-raw.csv" 2> "$OUT/ncu.err"
echo "ncu rc=$?"
python3 bench/scratch/ncu_columns.py < "$OUT/ncu-raw.csv" > "$OUT/ncu.txt" 2>&1
tail -12 "$OUT/variant-power.log"
cat "$OUT/ncu.txt"
