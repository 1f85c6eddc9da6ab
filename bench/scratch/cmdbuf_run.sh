#!/bin/bash
# Session 15: XLA command buffers (CUDA graphs) on the jax-path shapes. Shape 8's kernels summed to 981 us
# per call against a 1082 us span (ablate8-tanh-...-session12.json): ~100 us between ~50 kernels.
# Each program compiled with XLA's defaults, with graphs from one op on (xla_gpu_graph_min_graph_size=1),
# with the command-buffer op kinds named, and with command buffers off; timed and profiled by kernel.
# Usage (on the H200, from the repository root): bash bench/scratch/cmdbuf_run.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T8="mixed_fp16_gemm16_tanh@xla_gpu_enable_triton_gemm=false"
KINDS="xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"
timeout 280 python3 bench/ablate.py --shapes 8 --seeds 3 --kernels --variant-sep ";" --out "$OUT" \
  --tag ablate8-cmdbuf-2026-12-01-nvidia-h200-session15 \
  --variants "$T8;$T8+xla_gpu_graph_min_graph_size=1;$T8+$KINDS;$T8+$KINDS+xla_gpu_graph_min_graph_size=1;$T8+xla_gpu_enable_command_buffer=" \
  > "$OUT/ablate8-cmdbuf-2026-12-01-nvidia-h200-session15.log" 2>&1
echo "shape 8 rc=$?"
timeout 250 python3 bench/ablate.py --shapes 11,13 --seeds 3 --kernels --variant-sep ";" --out "$OUT" \
  --tag ablate-rows-cmdbuf-2026-12-01-nvidia-h200-session15 \
  --variants "mixed_fp16;mixed_fp16@xla_gpu_graph_min_graph_size=1;mixed_fp16@$KINDS+xla_gpu_graph_min_graph_size=1;mixed_fp16@xla_gpu_enable_command_buffer=" \
  > "$OUT/ablate-rows-cmdbuf-2026-12-01-nvidia-h200-session15.log" 2>&1
echo "shapes 11, 13 rc=$?"
tail -14 "$OUT"/ablate8-cmdbuf-*.log; tail -16 "$OUT"/ablate-rows-cmdbuf-*.log
