#!/bin/bash
export PYTHONPATH=. PYTHONUNBUFFERED=1 TTJ_CACHE_DIR=/tmp/c4
F='^[WI]0000|^W1203|^I1203|^E0000|UserWarning|_warn_once|warnings.warn'
timeout 245 python3 -m bench.cli --suite general --shapes dec-l8-d128,enc-small-s128,vit-s197,dec-l8-d256-hd128 --peer --extra-seeds 0 --warmup 3 --rounds 3 --calls 10 --out $OUT --tag general-final --no-plot > $OUT/general-final.log 2>&1
echo "rc=$?"; grep -E "chose" $OUT/general-final.log | cut -c1-150; grep -Ev "$F" $OUT/general-final.log | grep -v "ttj-jax: \(measuring\|chose\)" | tail -10
