"""Summarise Nsight Compute source-page exports (`ncu -i REP --page source --csv --print-source sass`, gzipped)
by execution count: instructions that ran the same number of times form one loop body (session 20).

    python3 bench/scratch/ncu_source_summary.py SRC.csv.gz [SRC.csv.gz ...]

Per file: the total instructions executed and stall samples, then the largest groups of SASS instructions with
equal execution counts (in the attention kernel: the consumers' main loop runs 12 warps x key blocks times, the
producer's 4 warps x key blocks), and for the largest group its stall reasons and opcode counts.
"""
from __future__ import annotations

import collections
import csv
import gzip
import sys


def load(path: str) -> tuple[list[str], list[dict]]:
    with gzip.open(path, "rt") as f:
        reader = csv.reader(f)
        next(reader)   # "Kernel Name", ...
        header = next(reader)
        rows = []
        for values in reader:
            row = dict(zip(header, values))
            if len(values) >= len(header) and row["Instructions Executed"].isdigit():
                rows.append(row)
    return header, rows


def opcode(source: str) -> str:
    words = source.split()
    return words[1] if words[0].startswith("@") else words[0]


def summarise(path: str, groups: int = 6) -> None:
    header, rows = load(path)
    executed = sum(int(r["Instructions Executed"]) for r in rows)
    samples = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows)
    print(f"{path}: {executed / 1e9:.3f} G instructions executed, {samples} stall samples, {len(rows)} SASS instructions")
    by_count = collections.defaultdict(list)
    for r in rows:
        by_count[int(r["Instructions Executed"])].append(r)
    ranked = sorted(by_count.items(), key=lambda item: -item[0] * len(item[1]))
    for count, group in ranked[:groups]:
        group_samples = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in group)
        print(f"  executed {count:>10d} times: {len(group):4d} instructions, {count * len(group) / 1e9:6.3f} G "
              f"({100 * count * len(group) / executed:4.1f}%), stall samples {100 * group_samples / samples:4.1f}%")
    _, loop = ranked[0]
    stalls = collections.Counter()
    for r in loop:
        for column in header:
            if column.startswith("stall_") and r.get(column, "").isdigit():
                stalls[column] += int(r[column])
    total = sum(stalls.values())
    print("  largest group's stall reasons: " + ", ".join(f"{c[6:]} {100 * v / total:.1f}%" for c, v in stalls.most_common(8)))
    print("  largest group's opcodes: " + ", ".join(f"{op} {n}" for op, n in
                                                     collections.Counter(opcode(r["Source"]) for r in loop).most_common(12)))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarise(arg)
