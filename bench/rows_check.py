"""The "rows" stack (ttj_jax/kernels/row_block.py) against the XLA program and the fused stack, on the GPU.

    python -m bench.rows_check [--shapes 13,1,5,6] [--seeds 3] [--out DIR]

Per official shape (those the rows stack runs): the harness's baseline and our module; accuracy of each
stack through the bridge against the baseline (TF32, as the harness runs it) on `--seeds` harness inputs,
harness rule; then the timing of each stack through the bridge, harness protocol (CUDA events on torch's
stream), and from JAX (a JAX user's loop: back-to-back calls, one block_until_ready). Writes
<out>/rows-<date>-<gpu>.json and prints a table last; exit 1 if any checked element fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import check_close, harness_models, make_inputs  # noqa: E402
from bench.jax_timing import stream_ms_per_call  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import describe_error, run_shapes, slug  # noqa: E402
from bench.timing import time_contenders  # noqa: E402
from bridge import runtime  # noqa: E402
from ttj_jax.kernels import fused_stack, row_block  # noqa: E402

SHAPES = ("13", "2", "3", "4", "12", "1", "5", "9", "10", "7", "6")


def stacks_for(config) -> list[str]:
    names = ["layers", "rows"]
    if fused_stack.supports(config, config.seq_len):
        names.append("fused")
    return names


def run_shape(sid: str, seeds: int) -> dict:
    config = T.OFFICIAL[sid].config
    base, ours = harness_models(config, bridge.TTJTransformer, device="cuda")
    stacks = stacks_for(config)
    record = {"config": dataclasses.asdict(config), "accuracy": {}, "bridge_ms": {}, "jax_ms": {}, "errors": {}}
    with torch.no_grad():
        for seed in range(1234, 1234 + seeds):
            x, mask = make_inputs(config, seed, device="cuda")
            ref = base(x, mask)
            for stack in stacks:
                try:
                    failed, worst = check_close(runtime.forward(ours, x, mask, stack=stack), ref)
                except Exception as e:   # a stack that fails is recorded, not fatal
                    record["errors"][stack] = describe_error(e)
                    continue
                entry = record["accuracy"].setdefault(stack, {"failed_elements": 0, "worst_err_over_tol": 0.0})
                entry["failed_elements"] += failed
                entry["worst_err_over_tol"] = round(max(entry["worst_err_over_tol"], worst), 4)
        x, mask = make_inputs(config, 1234 + 100000, device="cuda")
        ok = [s for s in stacks if s not in record["errors"]]
        timed = time_contenders({s: (lambda s=s: runtime.forward(ours, x, mask, stack=s)) for s in ok},
                                warmup=20, rounds=3, calls=100, device="cuda")
        record["bridge_ms"] = {s: round(v["median_ms"], 4) for s, v in timed.items()}
        record["plans"] = {s: runtime.module_state(ours).calls[next(k for k in runtime.module_state(ours).calls
                                                              if k[-1] == s)].plan.name for s in ok}

    params = T.params_from_state_dict({k: v.detach().clone() for k, v in ours.state_dict().items()}, config)
    jx = jax.dlpack.from_dlpack(x.detach().clone())
    prepared = jax.block_until_ready(T.prepare_weights(params, T.MIXED_FP16))
    for stack in ok:
        plan = T.model.plan_for(config, jx, T.MaskKind.ALL_TRUE, stack=stack)
        weights = T.model.kernel_weights(prepared, T.model_key(config), stack)
        run = T.executable(plan, T.model_key(config))
        jax.block_until_ready(run(weights, jx, None))
        record["jax_ms"][stack] = round(stream_ms_per_call(run, (weights, jx, None), min_seconds=0.05,
                                                           repeats=5)[0], 4)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rows_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default=default_out_dir())
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.rows_check needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(),
              "command": "python -m bench.rows_check " + " ".join(sys.argv[1:] if argv is None else argv),
              "shapes": {}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rows-{result['date']}-{slug(gpu)}.json")
    def run_one(sid):
        config = T.OFFICIAL[sid].config
        if not row_block.supports(config) or (config.batch_size * config.seq_len) % 64:
            return None
        return run_shape(sid, args.seeds)

    bad = run_shapes(result, path, args.shapes.split(","), run_one, lambda record: json.dumps(record)[:600])
    print(f"\n{'shape':>5} {'stack':>7} {'bridge ms':>10} {'jax ms':>8} {'failed':>7} {'worst':>6}")
    for sid, r in result["shapes"].items():
        for stack, accuracy in r.get("accuracy", {}).items():
            print(f"{sid:>5} {stack:>7} {r['bridge_ms'].get(stack, float('nan')):>10.4f} "
                  f"{r['jax_ms'].get(stack, float('nan')):>8.4f} {accuracy['failed_elements']:>7} "
                  f"{accuracy['worst_err_over_tol']:>6.3f}")
        if "error" in r:
            print(f"{sid:>5} error: {r['error'][:100]}")
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
