"""How long the first call of a new input signature takes, in a fresh process, with the plan cache and
jax's compilation cache cold and then warm: the measured planner's cost and what the caches save.

    PYTHONPATH=. python3 -m bench.first_call [--configs bert-base,gpt2-s4096] [--cache-dir DIR] [--out DIR]

For each config: process 1 starts with an empty cache directory and times its first bridge call
(measuring, compiling, running); process 2 starts with the directory process 1 left and times the same.
Each process also times a second call, the warm steady state. Writes first-call-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.paths import result_file, run_header


def child(config_id: str) -> dict:
    """One process's first and second call of `config_id` through the bridge (run with --child)."""
    started = time.perf_counter()
    import torch

    import bridge
    import ttj_jax as T
    from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs
    imported = time.perf_counter() - started
    shape = T.shapes.find(config_id)
    dtype = getattr(torch, getattr(shape, "dtype", "float32"))
    harness_config = TransformerConfig(**vars(shape.config))
    baseline, ours = harness_models(harness_config, bridge.TTJTransformer, device="cuda", dtype=dtype)
    x, mask = make_inputs(harness_config, 1234, device="cuda", dtype=dtype,
                          padding_ratio=getattr(shape, "padding", 0.0))
    torch.cuda.synchronize()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = ours(x, mask)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        failed, worst = check_close(out, baseline(x, mask))   # a program read back from the cache must be right
        t0 = time.perf_counter()
        ours(x, mask)
        torch.cuda.synchronize()
        second = time.perf_counter() - t0
    return {"import_s": imported, "first_call_s": first, "second_call_s": second, "failed_elements": failed,
            "worst_err_over_tol": worst,
            "plan": bridge.explain(ours, x, mask)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="bert-base")
    p.add_argument("--cache-dir", default=None, help="cache directory to start from (default: a new empty one)")
    p.add_argument("--out", default="results")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child)))
        return 0
    import torch
    gpu = torch.cuda.get_device_name()
    directory = args.cache_dir or tempfile.mkdtemp(prefix="ttj-cache-")
    env = {**os.environ, "TTJ_CACHE_DIR": directory}
    results = {}
    for config_id in args.configs.split(","):
        runs = []
        for process in (1, 2):
            done = subprocess.run([sys.executable, "-m", "bench.first_call", "--child", config_id], env=env,
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"process {process} for {config_id} failed")
            record = json.loads(done.stdout.strip().splitlines()[-1])
            record["process"] = process
            runs.append(record)
            print(f"{config_id} process {process}: first call {record['first_call_s']:.2f} s, second "
                  f"{record['second_call_s'] * 1e3:.2f} ms (import {record['import_s']:.1f} s), "
                  f"{record['failed_elements']} failing", flush=True)
        results[config_id] = runs
    path = result_file("first-call", gpu, args.out)
    with open(path, "w") as f:
        json.dump({"gpu": gpu, **run_header("python -m bench.first_call " + " ".join(
            sys.argv[1:] if argv is None else argv)), "cache_dir_started_empty": args.cache_dir is None,
            "configs": results}, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
