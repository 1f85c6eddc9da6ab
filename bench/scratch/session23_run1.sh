#!/bin/bash
# Session 23, issue 4: the Mosaic whole-stack kernel with packed heads (16 heads of 8 in four 32-column
# blocks) at shape 11, first GPU run. Usage, on the H200 from the repository root:
#   bash bench/scratch/session23_run1.sh OUT
# 1. bench/fused_stack_mgpu_check.py on shapes 11 and 1 (1: the 4-head build, as a control): child-process
#    probe first (a hang is reported, not waited for), then accuracy against the fp32 reference and against
#    `emulate`, and the kernel's time through jax against the Triton fused kernel and the XLA program;
# 2. only if shape 11's probe passed: bench/mosaic_launch_check.py for shape 11 with the stack forced to
#    fused_mgpu (the bridge launches it on torch tensors), against the planner's choice (the rows stack):
#    5 harness seeds, the side-stream check, host us per call and the harness timing of both.
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
timeout 330 python3 bench/fused_stack_mgpu_check.py --out "$OUT" --shapes 11,1 --no-variant > "$OUT/mgpu_check.log" 2>&1
echo "mgpu_check rc=$?"; tail -12 "$OUT/mgpu_check.log"
if python3 -c "
import glob, json, sys
[p] = glob.glob('$OUT/fused-stack-mgpu-*.json')
sys.exit(0 if json.load(open(p)).get('probe', {}).get('11', {}).get('status') == 'ok' else 1)"; then
  timeout 220 python3 bench/mosaic_launch_check.py --out "$OUT" --shapes 11 --stack fused_mgpu --against planner \
    > "$OUT/launch.log" 2>&1
  echo "launch rc=$?"; tail -6 "$OUT/launch.log"
else
  echo "shape 11's probe did not pass: no bridge launch"
fi
