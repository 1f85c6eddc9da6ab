#!/bin/bash
# Session 21, issue 3: the new head_dim 32/64 default (producer loads from one warp, warp_producer)
# checked by the Mosaic kernel's correctness suite (every head_dim, S in {1, 113, 128, 1000}, causal and
# not, bf16, repeat; the re-pinned S=1000 lane build among them), then issue 3's benchmark with it.
# Usage, on the H200 from the repository root:  bash bench/scratch/session21_final_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/check"
timeout 150 python3 bench/bench_attention_mgpu.py --check --out "$OUT/check" > "$OUT/check.log" 2>&1
echo "check rc=$?"
tail -4 "$OUT/check.log"
timeout 400 python3 bench/bench_attention.py --out "$OUT" > "$OUT/bench_attention.log" 2>&1
echo "bench_attention rc=$?"
tail -40 "$OUT/bench_attention.log"
