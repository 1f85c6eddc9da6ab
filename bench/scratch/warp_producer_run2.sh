#!/bin/bash
# Session 21, issue 3: warp_producer's neighbours at the main case (ping-pong back on, 3 and 5 stages), then
# warp_producer against each default where the Mosaic kernel runs long sequences: shape 14's call (B=8),
# head_dim 128 and 256 at S=16384 (multicast defaults, warpgroup lowering), head_dim 32 at S=8192.
# Usage, on the H200 from the repository root:  bash bench/scratch/warp_producer_run2.sh OUT
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/main" "$OUT/b8" "$OUT/hd128" "$OUT/hd256" "$OUT/hd32"
timeout 200 python3 bench/scratch/variant_power.py "$OUT/main" 3 warp_producer warp_producer+pingpong=1 \
  warp_producer+num_stages=3 warp_producer+num_stages=5 --causal-only > "$OUT/main.log" 2>&1
echo "main rc=$?"
timeout 60 python3 bench/scratch/variant_power.py "$OUT/hd128" 3 warp_producer --causal-only --case=1,16,16384,128 > "$OUT/hd128.log" 2>&1
echo "hd128 rc=$?"
timeout 60 python3 bench/scratch/variant_power.py "$OUT/hd256" 3 warp_producer --causal-only --case=1,16,16384,256 > "$OUT/hd256.log" 2>&1
echo "hd256 rc=$?"
timeout 50 python3 bench/scratch/variant_power.py "$OUT/hd32" 3 warp_producer --causal-only --case=4,16,8192,32 > "$OUT/hd32.log" 2>&1
echo "hd32 rc=$?"
timeout 150 python3 bench/scratch/variant_power.py "$OUT/b8" 2 warp_producer --causal-only --case=8,16,100000,64 > "$OUT/b8.log" 2>&1
echo "b8 rc=$?"
for f in main hd128 hd256 hd32 b8; do echo "== $f"; grep -E "^check|^causal|Error" "$OUT/$f.log" | cut -c1-160; done
