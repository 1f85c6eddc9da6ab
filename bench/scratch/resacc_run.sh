#!/usr/bin/env bash
# Session 14's device run: the Mosaic stack kernel with the residual as the out-projection's and
# MLP-out's wgmma accumulator (kernel_function(residual_accumulator=True)): ptxas's spill report for it
# against the default (shapes 2 and 6), then kernel times and the harness rule at official shapes, all
# variants side by side. Run from the repository root on the H200: bash bench/scratch/resacc_run.sh $OUT
set -u
OUT=${1:-/tmp/out}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv
DUMP=/tmp/ptxas-dump
timeout 200 python3 bench/scratch/ptxas_dump.py "$DUMP" \
  stack_shape2,stack_shape2_resacc,stack_shape2_overlap_resacc,stack_shape6,stack_shape6_resacc > "$OUT/ptxas.log" 2>&1
grep -E "^==|spill|sass:" "$OUT/ptxas.log"
cp "$DUMP/ptxas-summary.json" "$OUT/ptxas-summary.json" 2>/dev/null
gzip -c "$DUMP/stack_shape2_resacc/entry_0.sass" > "$OUT/stack-shape2-resacc.sass.gz" 2>/dev/null
timeout 330 python3 bench/fused_stack_mgpu_ablate.py --out "$OUT" --shapes 2,1,6,12,9 \
  --variants default,residual_acc,overlap,overlap+residual_acc --kernels --tag session14-resacc > "$OUT/ablate.log" 2>&1
tail -30 "$OUT/ablate.log"
