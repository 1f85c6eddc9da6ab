#!/usr/bin/env bash
# Session 14's third device run: the Mosaic stack kernel with chain_key_blocks (now the default) against
# the build without it, at the split-key shapes (kernel time, harness rule), then the official suite on
# those shapes (a third part for the session's merged official file).
# Run from the repository root on the H200: bash bench/scratch/chain_run.sh $OUT
set -u
OUT=${1:-/tmp/out}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 200 python3 bench/fused_stack_mgpu_ablate.py --out "$OUT" --shapes 2,1,3,9,10,7 \
  --variants default,no_chain_keys --kernels --tag session14-chain > "$OUT/ablate-chain.log" 2>&1
tail -6 "$OUT/ablate-chain.log"
timeout 330 python3 -m bench.cli --suite official --shapes 2,1,3,4,9,10,7 --no-plot --out "$OUT" \
  --tag official-2026-12-01-h200-session14-part3 > "$OUT/official-2026-12-01-h200-session14-part3.log" 2>&1
tail -14 "$OUT/official-2026-12-01-h200-session14-part3.log"
