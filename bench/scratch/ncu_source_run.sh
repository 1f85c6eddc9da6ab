#!/bin/bash
# Session 20, issue 3: where the head_dim-64 kernel's instructions go, per SASS instruction (Nsight
# Compute's SourceCounters: executed instructions and stall samples per instruction), for the default
# (K/V multicast, no ping-pong) and the plain build (no multicast, ping-pong), at the main case. Multicast
# added 3.8% instructions (ncu-multicast-cycles-2026-12-02-nvidia-h200.txt): producer or consumers?
# Usage, on the H200:  bash bench/scratch/ncu_source_run.sh OUT   (bench/scratch/ncu_source_summary.py reads it)
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
i=0
for build in default kv_multicast=0+pingpong=1; do
  timeout 200 ncu --clock-control none -k regex:entry_mosaic --launch-count 1 --section SourceCounters \
    --section WarpStateStats -o /tmp/src_$i python3 bench/scratch/ncu_attention.py 1,16,100000,64,1 "$build" --calls=1 \
    > "$OUT/ncu_$i.log" 2>&1
  echo "ncu $build rc=$?"
  ncu -i /tmp/src_$i.ncu-rep --page source --csv --print-source sass 2> "$OUT/src_$i.err" | gzip > "$OUT/src_$i.csv.gz"
  echo "source export rc=${PIPESTATUS[0]}"
  ncu -i /tmp/src_$i.ncu-rep --page details --csv > "$OUT/details_$i.csv" 2>&1
  i=$((i+1))
done
ls -la "$OUT"
zcat "$OUT/src_0.csv.gz" | head -3 | cut -c1-600
