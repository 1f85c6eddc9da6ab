"""Print the kernel name, duration, SM cycles and clock of each kernel row of `ncu --csv --page raw` read
from stdin (and pass other non-CSV lines through, e.g. the profiled program's own output). Session 18:

    ncu ... --csv --page raw python3 bench/scratch/ncu_gap.py 4 --no-loop | python3 bench/scratch/ncu_columns.py
"""
import csv
import sys

COLUMNS = ("Kernel Name", "gpu__time_duration.sum", "sm__cycles_elapsed.avg", "sm__cycles_elapsed.avg.per_second",
           "smsp__inst_executed.sum")


def main(lines) -> None:
    header = None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "ID":
            header = row
        elif header and row[0].isdigit():
            values = dict(zip(header, row))
            print(" | ".join(f"{name}={values.get(name)}" for name in COLUMNS))
        elif row[0]:
            print(",".join(row)[:200])


if __name__ == "__main__":
    main(sys.stdin)
