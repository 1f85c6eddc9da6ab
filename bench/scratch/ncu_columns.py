"""Print the kernel name, duration, SM cycles and clock of each row of `ncu --csv --page raw` read from stdin."""
import csv, sys
want = ["Kernel Name", "gpu__time_duration.sum", "sm__cycles_elapsed.avg", "sm__cycles_elapsed.avg.per_second"]
rows = [r for r in csv.reader(sys.stdin) if r]
hdr = None
for r in rows:
    if r[0] == "ID": hdr = r; continue
    if hdr and r[0].isdigit():
        d = dict(zip(hdr, r)); print(" | ".join(f"{w}={d.get(w)}" for w in want))
    elif not r[0].startswith('"') and not r[0]=="": print(",".join(r)[:200])
