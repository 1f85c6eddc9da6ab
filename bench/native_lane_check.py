"""The bridge's native lane (bridge/native) on a GPU, per official shape: does it engage, is its output
the Python path's, does every change of input send the call back to Python, and what host time it saves.

    PYTHONPATH=. python3 bench/native_lane_check.py [--shapes 7,9,10,12,1,2,3,4,5,11] [--calls 200] [--out DIR]

Per shape, two modules with the harness's weights (bench.baseline.harness_models): `lane` as shipped and
`python` armed with TTJ_NATIVE_LANE=0 (its calls take the Python path). Under torch.inference_mode:
- engaged: after a first call, `runtime.fast_forward` answers for the harness's all-True mask (made
  outside inference mode, as the harness's timing input is: a kept mask) and for no mask;
- same output: the lane's output bitwise equal to the Python path's, and 0 failing elements against the
  baseline under the harness rule;
- refusals, each followed by a check that the answer is right (against the baseline, or the Python path):
  a mask written in place (holes), a parameter written in place (the module's and the baseline's alike),
  a call on a side stream, a non-contiguous x;
- a prefix mask (the harness's --padding-ratio 0.3, made outside inference mode): the lane where the plan
  zeroes the invalid rows after the mask-free kernel (causal), bitwise equal to the Python path;
- an inference-tensor mask (the harness's accuracy trials): the lane when the masked build is planned
  for the shape, else the Python path; bitwise equal to the Python path either way;
- float16 (the harness's --dtype float16: model and x in fp16): the lane engaged, its output bitwise the
  Python path's; the harness rule against the fp16 baseline is reported, not required (docs/decisions.md,
  "Numerics");
- host_us: the module's host time per call, each sample from a drained GPU, interleaved
  (bench.timing.interleaved_host_overhead_us), `lane` against `python`; gpu_us: CUDA-event median per
  call back to back (bench.timing.time_contenders) with the lane; host_over_gpu for each.
Writes <out>/native-lane-<date>-<gpu>.json after every shape; prints a table last; exit 1 on any failure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import bridge  # noqa: E402
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.host_overhead import HOST_OVER_GPU_TARGET, parse_shapes, shape_by_id  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402
from bench.timing import interleaved_host_overhead_us, time_contenders  # noqa: E402
from bridge import native, runtime  # noqa: E402
from bridge.settings import NATIVE_LANE_ENV  # noqa: E402

LAUNCH_BOUND = "7,9,10,12,1,2,3,4,5,11"   # the Mosaic kernel's shapes, and 11 (the rows stack's Triton launch)


def _python_module(baseline, config):
    """A bridge module whose calls stay on the Python path: armed (first call) with the lane switched off."""
    _, module = harness_models(config, bridge.TTJTransformer, device="cuda")
    module.load_state_dict(baseline.state_dict())
    return module


def _without_lane(module, *args):
    """module(*args) with TTJ_NATIVE_LANE=0, so the call arms no lane (the variable is read when arming)."""
    old = os.environ.get(NATIVE_LANE_ENV)
    os.environ[NATIVE_LANE_ENV] = "0"
    try:
        return module(*args)
    finally:
        if old is None:
            os.environ.pop(NATIVE_LANE_ENV)
        else:
            os.environ[NATIVE_LANE_ENV] = old


def check_shape(sid: str, calls: int, half: bool = True) -> dict:
    shape = shape_by_id(sid)
    config = TransformerConfig(**{k: getattr(shape.config, k) for k in TransformerConfig.__dataclass_fields__})
    baseline, lane = harness_models(config, bridge.TTJTransformer, device="cuda")
    python = _python_module(baseline, config)
    x, mask = make_inputs(config, 1, device="cuda")   # outside inference mode: a versioned mask, kept
    entry = {"failures": []}

    def expect(name, ok):
        entry[name] = bool(ok)
        if not ok:
            entry["failures"].append(name)

    def rule(out, ref, name):
        failed, worst = check_close(out, ref)
        entry.setdefault("failed_elements", 0)
        entry["failed_elements"] += failed
        entry.setdefault("worst_err_over_tol", 0.0)
        entry["worst_err_over_tol"] = max(entry["worst_err_over_tol"], worst)
        if failed:
            entry["failures"].append(f"{name}: {failed} failed")

    def py(*args):   # the python module's call, its lane switched off whenever it would arm one
        return _without_lane(python, *args)

    with torch.inference_mode():
        py(x, mask)
        py(x, None)
        expect("python_not_armed", runtime.module_state(python).lane is None)
        first = lane(x, mask)
        state = runtime.module_state(lane)
        entry["stack"] = next(iter(state.calls.values())).plan.stack
        fast = runtime.fast_forward(lane, x, mask)
        expect("engaged_kept_mask", fast is not None)
        ref = baseline(x, mask)
        py_out = py(x, mask)
        expect("bitwise_kept_mask", fast is not None and torch.equal(fast, py_out) and torch.equal(first, py_out))
        rule(fast if fast is not None else first, ref, "kept mask")
        lane(x, None)
        fast_none = runtime.fast_forward(lane, x, None)
        expect("engaged_no_mask", fast_none is not None)
        expect("bitwise_no_mask", fast_none is not None and torch.equal(fast_none, py(x, None)))

        # refusals, each answered right by the Python path
        lane(x, mask)
        with torch.inference_mode(False):   # a versioned mask, whose kind is kept (an inference one is the device's)
            holes = mask.clone()
        lane(x, holes)
        holes[:, 1::3] = False            # an in-place write torch sees: the kept kind is stale
        expect("refused_mask_write", runtime.fast_forward(lane, x, holes) is None)
        rule(lane(x, holes), baseline(x, holes), "mask written in place")
        with torch.no_grad():
            for module in (lane, baseline, python):
                module.layers[0].ffn_in.weight.mul_(1.5)
        expect("refused_weight_write", runtime.fast_forward(lane, x, mask) is None)
        after = lane(x, mask)
        rule(after, baseline(x, mask), "weight written in place")
        expect("bitwise_after_weight_write", torch.equal(after, py(x, mask)))
        expect("engaged_again", runtime.fast_forward(lane, x, mask) is not None)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            expect("refused_side_stream", runtime.fast_forward(lane, x, mask) is None)
            on_side = lane(x, mask)
        torch.cuda.current_stream().wait_stream(side)
        expect("bitwise_side_stream", torch.equal(on_side, py(x, mask)))
        strided = torch.empty(*x.shape[:2], 2 * x.shape[2], device=x.device)[..., :x.shape[2]]
        strided.copy_(x)
        expect("refused_non_contiguous", runtime.fast_forward(lane, strided, mask) is None)
        expect("bitwise_non_contiguous", torch.equal(lane(strided, mask), py(x, mask)))

        # the harness's --padding-ratio 0.3 timing input: a kept prefix mask, invalid rows zeroed after the kernel
        with torch.inference_mode(False):
            x_pad, mask_pad = make_inputs(config, 4, device="cuda", padding_ratio=0.3)
        first_pad = lane(x_pad, mask_pad)
        fast_pad = runtime.fast_forward(lane, x_pad, mask_pad)
        entry["lane_prefix_mask"] = fast_pad is not None
        py_pad = py(x_pad, mask_pad)
        expect("bitwise_prefix_mask", torch.equal(first_pad, py_pad) and (fast_pad is None or torch.equal(fast_pad, py_pad)))
        rule(first_pad, baseline(x_pad, mask_pad), "prefix mask")

        # the harness's accuracy trials: an inference-tensor mask
        x_inf, mask_inf = make_inputs(config, 2, device="cuda")
        lane(x_inf, mask_inf)
        fast_inf = runtime.fast_forward(lane, x_inf, mask_inf)
        entry["lane_inference_mask"] = fast_inf is not None
        out_inf = fast_inf if fast_inf is not None else lane(x_inf, mask_inf)
        expect("bitwise_inference_mask", torch.equal(out_inf, py(x_inf, mask_inf)))
        rule(out_inf, baseline(x_inf, mask_inf), "inference-tensor mask")

        # the harness's --dtype float16: model and x in fp16, computed as float32 by the kernel
        if half:
            with torch.inference_mode(False):   # as the harness builds its models and its timing input
                base16, lane16 = harness_models(config, bridge.TTJTransformer, device="cuda", dtype=torch.float16)
                _, python16 = harness_models(config, bridge.TTJTransformer, device="cuda", dtype=torch.float16)
                x16, mask16 = make_inputs(config, 3, device="cuda", dtype=torch.float16)
            first16 = lane16(x16, mask16)
            fast16 = runtime.fast_forward(lane16, x16, mask16)
            entry["lane_float16"] = fast16 is not None
            py16 = _without_lane(python16, x16, mask16)
            expect("bitwise_float16", torch.equal(first16, py16) and (fast16 is None or torch.equal(fast16, py16)))
            entry["float16_vs_fp16_baseline"] = dict(zip(("failed_elements", "worst_err_over_tol"),
                                                         check_close(py16, base16(x16, mask16))))
            base16 = lane16 = python16 = None

        # host and GPU time per call, the harness's kept mask
        lane(x, mask)
        py(x, mask)   # armed (no lane) for this input and weights: its timed calls below stay on the Python path
        contenders = {"lane": lambda: lane(x, mask), "python": lambda: python(x, mask)}
        host = interleaved_host_overhead_us(contenders, calls, device="cuda")
        gpu = time_contenders(contenders, device="cuda")
    expect("python_without_lane_at_timing", runtime.module_state(python).lane is None)
    for name in contenders:
        entry[f"host_us_{name}"] = round(host[name]["median_us"], 2)
        entry[f"gpu_us_{name}"] = round(gpu[name]["median_ms"] * 1e3, 2)
        entry[f"host_over_gpu_{name}"] = round(host[name]["median_us"] / (gpu["lane"]["median_ms"] * 1e3), 3)
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=LAUNCH_BOUND)
    parser.add_argument("--calls", type=int, default=200, help="drained host-time samples per contender")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: bench.paths.default_out_dir())")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/native_lane_check.py: needs a CUDA device", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    result = {"date": str(datetime.date.today()), "gpu": gpu, "torch": torch.__version__,
              "command": "python3 bench/native_lane_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "shapes": {}}
    native.build()   # the one-time build outside every timing (its progress lines go to stderr)
    out_dir, stem = args.out or default_out_dir(), f"native-lane-{result['date']}-{slug(gpu)}"
    bad = False
    for sid in args.shapes:
        try:
            entry = check_shape(sid, args.calls)
        except Exception as e:   # one shape's failure must not hide the others
            entry = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:],
                     "failures": ["error"]}
        result["shapes"][sid] = entry
        bad |= bool(entry["failures"])
        path = write_json(result, out_dir, stem)
        print(f"{sid:>3} {entry.get('stack', '?'):<11} host lane {entry.get('host_us_lane')} python "
              f"{entry.get('host_us_python')} gpu {entry.get('gpu_us_lane')} us; lane/gpu "
              f"{entry.get('host_over_gpu_lane')}; inference-mask lane {entry.get('lane_inference_mask')}; "
              f"failed {entry.get('failed_elements')}; failures {entry['failures'] or 'none'}", flush=True)
        torch.cuda.empty_cache()
    over = [sid for sid, e in result["shapes"].items()
            if (e.get("host_over_gpu_lane") or 9) >= HOST_OVER_GPU_TARGET]
    print(f"host/GPU >= {HOST_OVER_GPU_TARGET} with the lane: {over or 'none'}; wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
