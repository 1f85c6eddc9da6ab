#!/bin/bash
# Prepared in session 24 for the next session (issue 4): the GPU checks shape 7's 16-wide head blocks
# (fused_stack_mgpu.MIN_BLOCK = 16, session 24) still need. Usage, on the H200 from the repository root:
#   bash bench/scratch/session25_run1.sh OUT
# 1. bench/mosaic_launch_check.py --shapes 7: the bridge launches the 16-wide build on torch tensors
#    (its one-time comparison with the jax path must pass), 5 harness seeds, the side-stream check, host
#    us and the harness timing against the Triton kernel through jax;
# 2. the official row for shape 7 (baseline, torch peer, bridge, JAX; 25 seeds), for the README table,
#    whose shape-7 row is still session 22's 32-wide build (0.04906 ms through the bridge).
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 200 python3 bench/mosaic_launch_check.py --out "$OUT" --shapes 7 > "$OUT/launch7.log" 2>&1
echo "launch rc=$?"; tail -6 "$OUT/launch7.log"
timeout 300 python3 -m bench.cli --suite official --shapes 7 --out "$OUT" \
  --tag official-shape7-nvidia-h200-session25 > "$OUT/official7.log" 2>&1
echo "official rc=$?"; tail -8 "$OUT/official7.log"
