#!/usr/bin/env bash
# Session 12's device run: the packed fp16 exp2 in the attention kernel (checked, then timed at the
# main case next to the default and cuDNN) and in the Mosaic stack kernel (official shapes, kernel time,
# harness rule). Run from the repository root on the H200: bash bench/scratch/half_exp2_run.sh $OUT
set -u
OUT=${1:-/tmp/out}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv
timeout 280 python3 bench/bench_attention_mgpu.py --poly --out "$OUT" 2>&1 | tail -25
timeout 300 python3 bench/fused_stack_mgpu_ablate.py --out "$OUT" --shapes 2,1,3,5,9,10,7,12,6 \
  --variants default,half_softmax --kernels --tag session12-half 2>&1 | tail -30
