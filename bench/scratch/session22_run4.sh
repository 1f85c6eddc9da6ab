#!/bin/bash
# Session 22: shape 6 through the bridge's direct launch vs through jax vs JAX (shape6_paths.py), then the
# bridge's forward piece by piece on shapes 11, 13, 8 (bridge_pieces.py).
# Usage, on the H200 from the repository root:  bash bench/scratch/session22_run4.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
timeout 260 python3 bench/scratch/shape6_paths.py "$OUT" 6 > "$OUT/shape6-paths.log" 2>&1
echo "shape6 rc=$?"; tail -16 "$OUT/shape6-paths.log"
timeout 200 python3 bench/scratch/bridge_pieces.py "$OUT" 11,13,8 > "$OUT/bridge-pieces.log" 2>&1
echo "pieces rc=$?"; tail -5 "$OUT/bridge-pieces.log"
