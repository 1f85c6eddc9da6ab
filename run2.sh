#!/bin/bash
export PYTHONPATH=. PYTHONUNBUFFERED=1 TTJ_CACHE_DIR=/tmp/ttjcache
F='^[WI]0000|^W1203|^I1203|^E0000'
timeout 90 python3 -m bench.device_branch --size 4096 --layers 4 --calls 50 --out $OUT 2>&1 | grep -Ev "$F"
timeout 200 python3 -m bench.train --configs bert-base --breakdown --kernels --out $OUT 2>&1 | grep -Ev "$F"
timeout 280 python3 -m bench.grad_check --configs 1,2,3,4,5,6,7,8,9,10,11,12,13 --seeds 3 --padding 0.3 --out $OUT 2>&1 | grep -Ev "$F"
