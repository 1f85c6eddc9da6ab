#!/bin/bash
# Session 21, issue 5: shape 14 with the head_dim-64 attention default now loading from one producer warp
# (warp_producer; B=8 call 497.5 against 490.3 TFLOP/s), full validation and the torch peer.
# Predicted 2835-2850 ms (session 20: 2881.7). Usage, on the H200:  bash bench/scratch/session21_scale_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 480 python3 -m bench.scale --no-multi --peer --timing-calls 3 --out "$OUT" \
  --tag scale-2026-12-02-nvidia-h200-session21 > "$OUT/scale.log" 2>&1
echo "scale rc=$?"
tail -14 "$OUT/scale.log"
