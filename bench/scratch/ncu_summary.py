"""Summarise Nsight Compute CSV pages of the attention kernel's builds into one JSON (session 18).

    python3 bench/scratch/ncu_summary.py OUT.json LABEL=DIR/NAME[:BUILD,BUILD] [...] [--kernels=1,3] [--builds=a,b]

Each DIR/NAME names the pages `ncu -i NAME.ncu-rep --page raw --csv` (NAME-raw.csv) and `--page source
--csv --print-source sass` (NAME-source.csv) wrote for one report (bench/scratch/ncu_attention.py makes
the report). --kernels picks the kernels (by position in the report, default every odd one: the second
call of each build, after its warm-up); `:BUILD,BUILD` after a report names its kernels, --builds those
of every report without such names. Per kernel: duration, SM clock, cycles,
warp instructions, issue activity, L2 hit rate, DRAM bytes; the stall samples by reason; and the hottest
loop (the instructions executed most often times their count: the consumers' main loop) with its length,
opcode counts and the SASS of its non-floating-point instructions (where the bookkeeping lives).
"""
from __future__ import annotations

import collections
import csv
import json
import pathlib
import sys

RAW_METRICS = {
    "duration_ms": "gpu__time_duration.sum",
    "sm_clock_ghz": "sm__cycles_elapsed.avg.per_second",
    "sm_cycles": "sm__cycles_elapsed.avg",
    "warp_instructions": "smsp__inst_executed.sum",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "dram_read_mb": "dram__bytes_read.sum",
    "grid": "launch__grid_size",
}
FLOAT_OPS = {"FMNMX", "FADD", "FFMA", "MUFU", "FMUL", "F2FP"}


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def raw_page(path: pathlib.Path) -> list[dict]:
    rows = list(csv.reader(path.open()))
    header, units = rows[0], rows[1]
    kernels = []
    for row in rows[2:]:
        values = dict(zip(header, row))
        kernels.append({key: _number(values[name]) for key, name in RAW_METRICS.items() if name in values})
        kernels[-1]["units"] = {key: units[header.index(name)] for key, name in RAW_METRICS.items() if name in header}
    return kernels


def source_page(path: pathlib.Path) -> list[list[dict]]:
    kernels, header = [], None
    for row in csv.reader(path.open()):
        if not row:
            continue
        if row[0] == "Kernel Name":
            kernels.append([])
            continue
        if row[0] == "Address":
            header = row
            continue
        kernels[-1].append({key: _number(value) if key not in ("Address", "Source") else value
                            for key, value in zip(header, row)})
    return kernels


def opcode(source: str) -> str:
    words = source.split()
    word = words[1] if words[0].startswith("@") else words[0]
    return word.split(".")[0]


def summarise_source(instructions: list[dict]) -> dict:
    stalls = collections.Counter()
    for ins in instructions:
        for key, value in ins.items():
            if key.startswith("stall_") and "(Not" not in key and isinstance(value, float) and value:
                stalls[key[len("stall_"):]] += value
    counts = collections.Counter(ins["Instructions Executed"] for ins in instructions)
    hot = max(counts, key=lambda n: n * counts[n])
    loop = [ins for ins in instructions if ins["Instructions Executed"] == hot]
    return {
        "sass_instructions": len(instructions),
        "stall_samples": dict(stalls.most_common()),
        "hot_loop": {
            "length": len(loop),
            "executions": hot,
            "opcodes": dict(collections.Counter(map(opcode, (i["Source"] for i in loop))).most_common()),
            "stall_samples": sum(i["Warp Stall Sampling (All Samples)"] for i in loop),
            "non_float_sass": [f'{i["Source"].strip()}  # samples {i["Warp Stall Sampling (All Samples)"]:.0f}'
                               for i in loop if opcode(i["Source"]) not in FLOAT_OPS],
        },
    }


def main(argv):
    out = pathlib.Path(argv[0])
    picks = next((a.split("=", 1)[1] for a in argv if a.startswith("--kernels=")), None)
    builds = next((a.split("=", 1)[1].split(",") for a in argv if a.startswith("--builds=")), None)
    reports = [a for a in argv[1:] if not a.startswith("--")]
    result = {"command": "python3 bench/scratch/ncu_summary.py " + " ".join(argv), "reports": {}}
    for report in reports:
        label, stem = report.split("=", 1)
        stem, _, own_builds = stem.partition(":")
        stem = pathlib.Path(stem)
        raw = raw_page(stem.with_name(stem.name + "-raw.csv"))
        source = source_page(stem.with_name(stem.name + "-source.csv"))
        chosen = [int(i) for i in picks.split(",")] if picks else list(range(1, len(raw), 2))
        names = own_builds.split(",") if own_builds else builds or [f"kernel{i}" for i in chosen]
        result["reports"][label] = {name: {**raw[i], **summarise_source(source[i])} for name, i in zip(names, chosen)}
        for name, i in zip(names, chosen):
            k = result["reports"][label][name]
            issue = f"issue {k['issue_active_pct']:.1f}% " if "issue_active_pct" in k else ""
            print(f"{label:10s} {name:12s} {k['duration_ms']:8.3f} ms {k['sm_clock_ghz']:.3f} GHz "
                  f"inst {k['warp_instructions']:.4g} {issue}loop {k['hot_loop']['length']} x "
                  f"{k['hot_loop']['executions']:.0f}")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
