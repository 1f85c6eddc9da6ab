"""Host time of a JAX user's call: `ttj_jax.forward(prepared, x, config=...)` against the compiled
executable it ends in (`ttj_jax.executable(plan, ...)(weights, x, None)`), per shape; and forward with its
plan cache emptied before every call ("forward_replanning": validation, planning and the executable lookup
paid on every call, i.e. what the cache saves).

forward keeps the plan and executable per input signature (model.clear_forward_cache empties it), so a repeated call
should cost little more than the executable's own dispatch. Samples of the three are interleaved
(forward, executable, forward_replanning, forward, ...), no sync inside a call, medians in microseconds.
On a GPU the queue is drained every 50 calls so that it never fills (a full queue would make the host wait
on the GPU, not on Python).

    PYTHONPATH=. python3 -m bench.forward_overhead [--shapes 2,11,13] [--calls 2000] [--out DIR]
On a machine without a GPU it runs the CPU-sized suite's shapes (ttj_jax.CPU_SMALL) instead.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ttj_jax as T  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402
from ttj_jax import model  # noqa: E402
from ttj_jax.model import executable, kernel_weights, model_key, plan_for  # noqa: E402


def measure(shape: T.Shape, calls: int) -> dict:
    config = shape.config
    prepared = jax.block_until_ready(T.prepare_weights(T.init_params(jax.random.key(0), config), T.MIXED_FP16))
    x = jax.random.normal(jax.random.key(1), (config.batch_size, config.seq_len, config.d_model), jnp.float32)
    plan = plan_for(config, x, T.MaskKind.NONE)
    run = executable(plan, model_key(config))
    weights = kernel_weights(prepared, model_key(config), plan)
    def forward_replanning():   # forward with its per-signature cache emptied: planned on every call
        model.clear_forward_cache()
        return T.forward(prepared, x, config=config)

    contenders = {"forward": lambda: T.forward(prepared, x, config=config),
                  "executable": lambda: run(weights, x, None),
                  "forward_replanning": forward_replanning}
    for fn in contenders.values():
        for _ in range(20):
            fn()
    jax.block_until_ready(run(weights, x, None))
    samples = {name: [] for name in contenders}
    for i in range(calls):
        for name, fn in contenders.items():
            start = time.perf_counter()
            out = fn()
            samples[name].append((time.perf_counter() - start) * 1e6)
        if i % 50 == 49:
            jax.block_until_ready(out)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    return {"shape": shape.describe(), "plan": plan.stack, "median_us": medians,
            "forward_minus_executable_us": medians["forward"] - medians["executable"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="official shape ids (GPU) or CPU_SMALL ids")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", default=default_out_dir())
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    suite = T.OFFICIAL if on_gpu else T.CPU_SMALL
    ids = args.shapes.split(",") if args.shapes else (["2", "11", "13"] if on_gpu else ["cpu-2", "cpu-11"])
    device = jax.devices()[0]
    result = {"gpu": device.device_kind if on_gpu else None, "device": device.device_kind, "jax": jax.__version__,
              "date": datetime.date.today().isoformat(),
              "command": "python -m bench.forward_overhead " + " ".join(argv if argv is not None else []),
              "calls": args.calls, "shapes": {}}
    for sid in ids:
        print(f"shape {sid} ...", flush=True)
        result["shapes"][sid] = measure(suite[sid], args.calls)
    path = write_json(result, args.out, f"forward-overhead-{result['date']}-{slug(result['device'])}"
                                        f"{'-' + args.tag if args.tag else ''}")
    print(f"{'shape':>8} {'plan':>12} {'forward us':>11} {'executable us':>14} {'difference':>11} "
          f"{'replanning us':>14}")
    for sid, r in result["shapes"].items():
        m = r["median_us"]
        print(f"{sid:>8} {r['plan']:>12} {m['forward']:11.1f} {m['executable']:14.1f} "
              f"{r['forward_minus_executable_us']:+11.1f} {m['forward_replanning']:14.1f}")
    print("->", path)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
