"""Where a kernel's register spills sit in its SASS: each STL/LDL classified by the instructions within
WINDOW lines of it (wgmma, the special-function unit's exp2, rsqrt, reciprocal), plus the MUFU counts.

    python3 bench/scratch/spill_sites.py SASS_FILE[.gz] [OUT.json]

SASS from bench/scratch/ptxas_dump.py (its dump folder's entry_0.sass).
"""
import collections
import gzip
import json
import re
import sys

WINDOW = 40
TAGS = (("hgmma", "HGMMA"), ("ex2", "MUFU.EX2"), ("rsq", "MUFU.RSQ"), ("rcp", "MUFU.RCP"))


def classify(text: str) -> dict:
    ops = []
    for line in text.splitlines():
        match = re.search(r"\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        ops.append(match.group(2) if match else "")
    sites = [i for i, op in enumerate(ops) if op.startswith(("STL", "LDL"))]
    near = collections.Counter()
    for i in sites:
        window = ops[max(0, i - WINDOW):i + WINDOW]
        tags = [tag for tag, prefix in TAGS if any(op.startswith(prefix) for op in window)]
        near[" ".join(tags) or "none"] += 1
    return {"spill_instructions": len(sites), "window_lines": WINDOW, "near": dict(near.most_common()),
            "mufu": dict(collections.Counter(op for op in ops if op.startswith("MUFU")))}


def main(path: str, out: str | None = None) -> int:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        result = {"sass": path, **classify(f.read())}
    print(json.dumps(result, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
