#!/bin/bash
# Session 21, issue 4 (docs/host-cost.md's two leads for shape 11) and issue 3 (softmax overlap with the
# multicast default). Usage, on the H200 from the repository root:  bash bench/scratch/session21_run1.sh OUT
# 1. shape 11 on the bridge-launched Mosaic whole-stack kernel (never timed there; estimated ~220 us
#    against the rows stack's ~150);
# 2. the bridge's program as one CUDA graph (host_overhead --graph) on shapes 11, 13, 8;
# 3. overlap_softmax builds against the head_dim-64 default (multicast, no ping-pong), main case.
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/launch" "$OUT/host" "$OUT/vp"
timeout 150 python3 bench/mosaic_launch_check.py --out "$OUT/launch" --shapes 11 --stack fused_mgpu > "$OUT/launch.log" 2>&1
echo "launch rc=$?"; tail -8 "$OUT/launch.log"
timeout 230 python3 -m bench.host_overhead --shapes 11,13,8 --graph --calls 150 --out "$OUT/host" \
  --tag session21-graph > "$OUT/host.log" 2>&1
echo "host rc=$?"; tail -30 "$OUT/host.log"
timeout 170 python3 bench/scratch/variant_power.py "$OUT/vp" 3 overlap_softmax+overlap_one_accumulator \
  num_compute_wgs=2+overlap_softmax --causal-only > "$OUT/vp.log" 2>&1
echo "vp rc=$?"; grep -E "^check|^causal" "$OUT/vp.log"
