#!/bin/bash
# Session 20, issue 3: the new head_dim-64 multicast default (no ping-pong) against the previous one
# (pingpong=1) at shape 14's attention call (B=8 H=16 S=100000), then issue 3's benchmark with it.
# Usage, on the H200 from the repository root:  bash bench/scratch/session20_final_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 bench/scratch/variant_power.py "$OUT" 3 pingpong=1 --causal-only --case=8,16,100000,64 > "$OUT/b8.log" 2>&1
echo "b8 rc=$?"
grep -E "^check|^causal" "$OUT/b8.log"
timeout 420 python3 bench/bench_attention.py --out "$OUT" > "$OUT/bench_attention.log" 2>&1
echo "bench_attention rc=$?"
tail -40 "$OUT/bench_attention.log"
