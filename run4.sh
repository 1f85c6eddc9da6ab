#!/bin/bash
export PYTHONPATH=. PYTHONUNBUFFERED=1 TTJ_CACHE_DIR=/tmp/ttjcache
F='^[WI]0000|^W1203|^I1203|^E0000|UserWarning|_warn_once'
timeout 250 python3 -m bench.train --configs bert-base,gpt2-s4096,8,13,1 --breakdown --out $OUT 2>&1 | grep -Ev "$F"
timeout 110 python3 -m bench.grad_check --configs 13,bert-base --seeds 3 --padding 0.3 --out $OUT 2>&1 | grep -Ev "$F"
