#!/usr/bin/env bash
# Session 14's second device run: the Mosaic stack kernel with software-pipelined projections
# (kernel_function(pipeline=True)) and the older `overlap` against the default (residual accumulator):
# ptxas's report for the pipelined build at shape 2, then kernel times and the harness rule.
# Run from the repository root on the H200: bash bench/scratch/pipeline_run.sh $OUT
set -u
OUT=${1:-/tmp/out}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 60 python3 bench/scratch/ptxas_dump.py /tmp/ptxas-dump stack_shape2_pipeline > "$OUT/ptxas-pipeline.log" 2>&1
grep -E "^==|spill|serializ|sass:" "$OUT/ptxas-pipeline.log"
timeout 300 python3 bench/fused_stack_mgpu_ablate.py --out "$OUT" --shapes 2,1,12,9,5,6 \
  --variants default,pipeline,overlap --kernels --tag session14-pipeline > "$OUT/ablate-pipeline.log" 2>&1
tail -12 "$OUT/ablate-pipeline.log"
