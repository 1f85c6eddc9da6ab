#!/bin/bash
# Session 15, issue 3: the softmax instruction-count variants (MgpuBlockSizes.prescaled_q, half_row_sum)
# checked and timed at the main case in alternating rounds, then ptxas's report and SASS opcode counts
# of each build (DUMPS=name,... picks them). Usage (on the H200, from the repository root):
#   [DUMPS=...] [STUDY=--lazy] bash bench/scratch/softmax_run.sh OUT
# (session 16: STUDY picks bench_attention_mgpu's study, --softmax by default; --lazy for lazy_rescale)
set -u
OUT=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 330 python3 bench/bench_attention_mgpu.py ${STUDY:---softmax} --out "$OUT" --budget-s 280 > "$OUT/softmax.log" 2>&1
echo "bench rc=$?"
timeout 200 python3 bench/scratch/ptxas_dump.py /tmp/dumps \
  ${DUMPS:-hd64_default,hd64_prescaled_q,hd64_half_row_sum,hd64_prescaled_q_half_row_sum} > "$OUT/ptxas.log" 2>&1
echo "ptxas_dump rc=$?"
cp /tmp/dumps/ptxas-summary.json "$OUT/" 2>/dev/null
(cd /tmp/dumps && tar czf "$OUT/sass.tgz" hd64_*/entry_0.sass hd64_default/entry_0.ptx 2>/dev/null)
tail -25 "$OUT/softmax.log"
python3 - "$OUT/ptxas-summary.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
ops = ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "F2FP", "HADD2", "HFMA2", "SHFL", "STL", "LDL")
print(f"{'build':32s}" + "".join(f"{o:>7s}" for o in ops))
for name, v in d.items():
    print(f"{name:32s}" + "".join(f"{v.get('opcodes', {}).get(o, 0):7d}" for o in ops))
PY
