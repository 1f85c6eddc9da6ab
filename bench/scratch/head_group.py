"""Session 23: the packed-heads Mosaic stack kernel with sub-heads side by side (`head_group`), on the GPU.

    PYTHONPATH=. python3 bench/scratch/head_group.py OUT [shapes] [groups]

Prediction (before any run): a sub-head's attention at shape 11 costs ~3.2 us per layer against ~0.5 us
of issue slots (session 23), so it is latency-bound; two sub-heads side by side should take ~1.3x one
(not 2x): 226.7 -> ~150-170 us per call at head_group 2, more at 4 unless spills eat it. Per shape
(default 11) and group (default 1,2,4): the output against group 1's (must be bitwise equal) and against
the fp32 reference (harness rule), and the time per call through jax (back-to-back calls,
bench.jax_timing). Each group runs in a child process first (a hang or crash is reported, not waited
for). Writes OUT/head-group-2026-12-02-nvidia-h200.json and prints a table last.
"""
import json
import os
import subprocess
import sys
import time


def child(sid: str, group: int, out_path: str) -> None:
    import jax
    import numpy as np
    import ttj_jax as T
    from bench.fused_stack_mgpu_check import _setup, _time_jax, harness_stats
    from ttj_jax.kernels import fused_stack_mgpu as fsm
    config, params, x, weights = _setup(sid)
    run = jax.jit(lambda w, x: fsm.fused_stack_mgpu_forward(w, x, num_heads=config.num_heads, head_group=group))
    t0 = time.perf_counter()
    y = np.asarray(jax.block_until_ready(run(weights, x)))
    record = {"first_call_s": round(time.perf_counter() - t0, 1)}
    ref = np.asarray(T.reference(params, x, config=config))
    record["vs_reference"] = harness_stats(y, ref)
    base_path = out_path.replace(f"-g{group}.npy", "-g1.npy")
    if group == 1:
        np.save(out_path, y)
    elif os.path.exists(base_path):
        base = np.load(base_path)
        record["max_abs_diff_vs_group_1"] = float(np.abs(y - base).max())
        record["bitwise_equal_to_group_1"] = bool(np.array_equal(y, base))
    record["timing"] = _time_jax(run, (weights, x))
    print("RESULT " + json.dumps(record), flush=True)


def main(out_dir: str, shapes: str = "11", groups: str = "1,2,4") -> None:
    os.makedirs(out_dir, exist_ok=True)
    result = {"command": "PYTHONPATH=. python3 bench/scratch/head_group.py " + " ".join(sys.argv[1:]),
              "date": "2026-12-02", "shapes": {}}
    path = os.path.join(out_dir, "head-group-2026-12-02-nvidia-h200.json")
    for sid in shapes.split(","):
        result["shapes"][sid] = {}
        for group in [int(g) for g in groups.split(",")]:
            npy = os.path.join("/tmp", f"head-group-{sid}-g{group}.npy")
            try:
                done = subprocess.run([sys.executable, __file__, "--child", sid, str(group), npy],
                                      capture_output=True, text=True, timeout=150)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                record = json.loads(lines[-1][7:]) if lines else {"error": done.stderr[-1500:], "rc": done.returncode}
            except subprocess.TimeoutExpired:
                record = {"error": "timed out after 150 s (a hang?)"}
            result["shapes"][sid][str(group)] = record
            print(sid, group, json.dumps(record)[:400], flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    print(f"\n{'id':>3} {'group':>5} {'us/call':>8} {'failed':>6} {'worst':>6} {'== g1':>6}")
    for sid, groups_ in result["shapes"].items():
        for group, r in groups_.items():
            if "error" in r:
                print(f"{sid:>3} {group:>5} ERROR {r['error'][-200:]}")
                continue
            acc = r["vs_reference"]
            print(f"{sid:>3} {group:>5} {r['timing']['ms_per_call'] * 1e3:>8.1f} {acc['failed_elements']:>6} "
                  f"{acc['worst_err_over_tol']:>6.3f} {str(r.get('bitwise_equal_to_group_1', '-')):>6}")
    print(f"wrote {path}")


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main(*sys.argv[1:])
