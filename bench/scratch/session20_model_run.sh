#!/bin/bash
# Session 20: shape 14 with the new head_dim-64 attention default (K/V multicast, no ping-pong), full
# validation and the torch peer (issue 5's one-GPU figure), then the official shapes 8, 11 and 13, whose
# JSON now records the torch peer's host time per call (peer_host_us; docs/host-cost.md's open question).
# Usage, on the H200 from the repository root:  bash bench/scratch/session20_model_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 400 python3 -m bench.scale --no-multi --peer --timing-calls 3 --out "$OUT" \
  --tag scale-2026-12-02-nvidia-h200-session20 > "$OUT/scale.log" 2>&1
echo "scale rc=$?"
tail -12 "$OUT/scale.log"
timeout 170 python3 -m bench.cli --suite official --shapes 8,11,13 --out "$OUT" \
  --tag official-2026-12-02-nvidia-h200-session20-shapes-8-11-13 > "$OUT/official.log" 2>&1
echo "official rc=$?"
tail -14 "$OUT/official.log"
