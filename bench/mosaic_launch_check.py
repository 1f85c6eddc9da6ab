"""GPU check of the bridge's own launches: the Mosaic GPU whole-stack kernel (bridge/mosaic_launch.py) and
a program of Triton kernels (bridge/triton_launch.py).

    PYTHONPATH=. python3 bench/mosaic_launch_check.py --out bench/results [--shapes 2,1,3,4,5,9,10,12,6]
    PYTHONPATH=. python3 bench/mosaic_launch_check.py --out bench/results --shapes 7 --stack fused_mgpu
    PYTHONPATH=. python3 bench/mosaic_launch_check.py --out bench/results --shapes 11 --stack fused_mgpu --against planner
    PYTHONPATH=. python3 bench/mosaic_launch_check.py --out bench/results --shapes 2,7,11 --stack rows --against jax
    PYTHONPATH=. python3 bench/mosaic_launch_check.py --out bench/results --shapes 2,7,12 --stack fused_mgpu \
        --mask holes --against jax

--stack forces a stack through `bridge.forward(..., stack=...)` instead of the module's own call (the
planner's choice): how a build the planner does not pick yet (shape 7's d_model 32) is checked.
--mask holes replaces the harness's all-True masks by masks with holes (position 0 valid, x zeroed at
invalid rows), which need key masking: with --stack fused_mgpu, the kernel's masked build.

Per official shape, through the bridge module as the harness calls it (all-True mask, fp32 x on cuda):
- the plan and whether the bridge launches the kernel itself (explain()); its one-time comparison with
  the jax path must have passed, else the call runs through jax and the note says why;
- accuracy on the 5 harness seeds against the eager baseline (harness rule);
- stream order: x produced on a side stream behind ~50 ms of queued matmuls, the bridge called on that
  stream; its output must equal the default-stream output bitwise (a launch on another stream would read
  x before it is written);
- host us per call (perf_counter, no sync) and the harness timing (CUDA events per call, 3 x 100 calls)
  of the bridge with the launch, and of the same module forced to the Triton kernel through jax
  (--against fused, the default) or called as the harness calls it, the planner's choice (--against
  planner: with --stack, what the forced stack would replace, e.g. shape 11's rows stack), or the same
  plan through jax, the bridge's own launches off (--against jax).
Writes <out>/mosaic-launch-<date>-<gpu>.json (triton-launch-... for --stack rows or fused) and prints a
table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from unittest import mock

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.cli import HARNESS_SEEDS, TIMING_SEED_OFFSET  # noqa: E402
from bench.timing import (
    host_us,  # noqa: E402
    time_contenders,  # noqa: E402
)
from bridge import runtime, settings  # noqa: E402

DEFAULT_SHAPES = "2,1,3,4,5,9,10,12,6"


def with_holes(x: torch.Tensor, mask: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x zeroed at its invalid rows, a mask of x's [B, S] with holes: bench/fused_stack_mgpu_check.py's
    "holes" mask from `seed`, on mask's device); the inputs are not modified."""
    from bench.fused_stack_mgpu_check import make_mask
    holes = torch.from_numpy(make_mask("holes", *mask.shape, seed=seed)).to(mask.device)
    return x * holes[..., None], holes


def on_busy_side_stream(run, x: torch.Tensor) -> torch.Tensor:
    """run(x_side) on a side stream, where x_side (equal to x) is written only after ~50 ms of matmuls
    queued on that stream: a launch that does not follow the caller's stream reads it before it is
    written. Returns run's output after the side stream finished."""
    device = x.device
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        big = torch.randn(8192, 8192, device=device)
        for _ in range(8):
            big = torch.tanh(big @ big * 1e-4)
        x_side = x + big[0, 0] * 0.0          # written only after the matmuls, on the side stream
        y_side = run(x_side)
    side.synchronize()
    return y_side


def check_shape(sid: str, device: torch.device, stack: str | None = None, against: str = "fused",
                mask_kind: str = "all_true") -> dict:
    config = T.OFFICIAL[sid].config
    harness_config = TransformerConfig(**vars(config))
    baseline, module = harness_models(harness_config, bridge.TTJTransformer, device=device)
    record: dict = {"shape": T.OFFICIAL[sid].describe(), "stack_forced": stack, "mask": mask_kind}
    ours = module if stack is None else (lambda x, mask: runtime.forward(module, x, mask, stack=stack))
    # Made outside inference mode, as the harness's timing input: the bridge classifies such a mask once
    # (all True: no mask work). An inference tensor's mask is decided on the device (the Triton kernel).
    x, mask = make_inputs(harness_config, HARNESS_SEEDS[0] + TIMING_SEED_OFFSET, device=device)
    inputs = [make_inputs(harness_config, seed, device=device) for seed in HARNESS_SEEDS]
    if mask_kind == "holes":
        x, mask = with_holes(x, mask, HARNESS_SEEDS[0] + TIMING_SEED_OFFSET)
        inputs = [with_holes(xs, ms, seed) for (xs, ms), seed in zip(inputs, HARNESS_SEEDS)]
    with torch.inference_mode():
        t0 = time.perf_counter()
        y = ours(x, mask)
        torch.cuda.synchronize()
        record["first_call_s"] = time.perf_counter() - t0
        [call] = [c for k, c in runtime.module_state(module).calls.items() if k[-1] == stack and k[-2] is None]
        record["plan"] = call.plan.explain()
        record["stack"] = call.plan.stack
        record["launched_by_bridge"] = call.direct is not None
        record["note"] = call.direct_note

        failed, worst = 0, 0.0
        for xs, ms in inputs:
            f, w = check_close(ours(xs, ms), baseline(xs, ms))
            failed, worst = failed + f, max(worst, w)
        record["accuracy"] = {"seeds": len(HARNESS_SEEDS), "failed_elements": failed, "worst_err_over_tol": worst}

        y_side = on_busy_side_stream(lambda x_side: ours(x_side, mask), x)
        record["side_stream_equal"] = bool(torch.equal(y_side, y))

        record["host_us_bridge"] = host_us(lambda: ours(x, mask))["median_us"]
        if against == "planner":   # the module as the harness calls it
            other_name, other = "bridge_planner", (lambda: module(x, mask))
        elif against == "jax":   # the same plan, built with the bridge's own launches off (its own call key)
            other_name = "bridge_via_jax"
            other = (lambda: runtime.forward(module, x, mask, stack=stack, data_parallel=1))
            with mock.patch.dict(os.environ, {settings.MOSAIC_LAUNCH_ENV: "0", settings.TRITON_LAUNCH_ENV: "0"}):
                other()
        else:
            other_name, other = "bridge_triton_via_jax", (lambda: runtime.forward(module, x, mask, stack="fused"))
        other()
        record["against"] = other_name
        record[f"host_us_{other_name}"] = host_us(other)["median_us"]
        timings = time_contenders({"bridge": lambda: ours(x, mask), other_name: other},
                                  warmup=20, rounds=3, calls=100, device=device)
        record["harness_ms"] = {k: v["median_ms"] for k, v in timings.items()}
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--stack", default=None, choices=("fused_mgpu", "rows", "fused"),
                        help="force this stack instead of the planner's choice (e.g. shape 7's d_model 32)")
    parser.add_argument("--against", default="fused", choices=("fused", "planner", "jax"),
                        help="time the bridge against the Triton kernel through jax, the planner's choice, "
                             "or the same plan through jax")
    parser.add_argument("--mask", default="all_true", choices=("all_true", "holes"),
                        help="the harness's all-True mask, or masks with holes (key masking)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    suffix = ("" if args.stack is None else f"-{args.stack}") + ("" if args.mask == "all_true" else f"-{args.mask}")
    kind = "triton" if args.stack in ("rows", "fused") else "mosaic"
    path = os.path.join(args.out, f"{kind}-launch-{datetime.date.today()}-{name.split()[-1].lower()}{suffix}.json")
    result = {"gpu": name, "jax": jax.__version__, "torch": torch.__version__,
              "date": str(datetime.date.today()), "command": " ".join(sys.argv), "shapes": {}}
    for sid in args.shapes.split(","):
        t0 = time.perf_counter()
        try:
            record = check_shape(sid, device, args.stack, args.against, args.mask)
        except Exception as e:   # noqa: BLE001 - one shape's failure is recorded, the rest still run
            record = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        record["wall_s"] = time.perf_counter() - t0
        result["shapes"][sid] = record
        print(f"shape {sid}: {json.dumps(record)[:600]}", flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{'id':>3} {'stack':>11} {'bridge?':>7} {'failed':>6} {'worst':>6} {'stream':>6} "
          f"{'host us':>8} {'bridge ms':>9} {'other ms':>9} {'other':>22} {'its host us':>11}")
    for sid, r in result["shapes"].items():
        if "error" in r:
            print(f"{sid:>3} ERROR {r['error'][:100]}")
            continue
        acc, ms = r["accuracy"], r["harness_ms"]
        print(f"{sid:>3} {r['stack']:>11} {str(r['launched_by_bridge']):>7} {acc['failed_elements']:>6} "
              f"{acc['worst_err_over_tol']:>6.3f} {str(r['side_stream_equal']):>6} {r['host_us_bridge']:>8.1f} "
              f"{ms['bridge']:>9.4f} {ms[r['against']]:>9.4f} {r['against']:>22} {r['host_us_' + r['against']]:>11.1f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
