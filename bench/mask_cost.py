"""What each way of finding a GPU mask's kind costs (TTJ_GPU_MASK), per shape, through the bridge module on one GPU.

    PYTHONPATH=. python3 bench/mask_cost.py [--shapes 7,12,2,1,13,8,11,vit-s197] [--out DIR]

Per shape (the module built as the harness builds it, under torch.inference_mode, with the harness's
all-True mask), CUDA-event medians of back-to-back calls (bench.timing.time_contenders), in ms:
    cached_ms       TTJ_GPU_MASK=host: the mask classified on the host once (version-tracked), then planned
                    mask-free
    device_ms       TTJ_GPU_MASK=device: the device decides on every call (MaskKind.UNKNOWN), as "auto" does
                    below planner.HOST_MASK_READ_MIN_FLOP, planned as the rules say
    read_ms         TTJ_GPU_MASK=auto as it runs from that threshold on (here forced at any size): the mask
                    read on the host on every call (one host sync), then planned as cached
    masked_mgpu_ms  the device-decided mask through the Mosaic kernel's masked build (stack="fused_mgpu"),
                    where it builds
plus the plans taken, the largest differences of the outputs from the cached call's, and the masked build
against the baseline (the harness rule, failed elements and worst error over tolerance) with a mask with
holes (bench/fused_stack_mgpu_check.make_mask "holes"; x zeroed at invalid rows). The masked build's first
launch at a new shape is a first run of new GPU code: probe it with bench/fused_stack_mgpu_check.py
--mask holes first (a fault there poisons the process's CUDA context). Writes
<out>/mask-cost-<date>-<gpu>.json after every shape.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import bridge  # noqa: E402
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.fused_stack_mgpu_check import make_mask  # noqa: E402
from bench.host_overhead import parse_shapes, shape_by_id  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402
from bench.timing import time_contenders  # noqa: E402
from bridge import runtime, settings  # noqa: E402
from ttj_jax import planner  # noqa: E402


def _module_in_mode(copied, mode: str, x, mask):
    """`copied` (a copy of the module, made outside inference mode) with its bridge state made under
    TTJ_GPU_MASK=mode (read at its first call)."""
    before = os.environ.get(settings.GPU_MASK_ENV)
    os.environ[settings.GPU_MASK_ENV] = mode
    try:
        copied(x, mask)
    finally:
        os.environ.pop(settings.GPU_MASK_ENV) if before is None else os.environ.update({settings.GPU_MASK_ENV: before})
    return copied


def measure(config, device: torch.device) -> dict:
    base, ours = harness_models(config, bridge.TTJTransformer, device=device)
    x, mask = make_inputs(config, 1, device=device)
    threshold = planner.HOST_MASK_READ_MIN_FLOP
    planner.HOST_MASK_READ_MIN_FLOP = 0.0   # "auto" reads every mask on the host, whatever the call's size
    copies = [copy.deepcopy(ours) for _ in range(3)]   # parameters with version counters, as the harness's
    try:
        with torch.inference_mode():
            cached_module, device_module, read_module = (_module_in_mode(module, mode, x, mask)
                                                         for module, mode in zip(copies, ("host", "device", "auto")))
            cached = cached_module(x, mask)
            contenders = {"cached": lambda: cached_module(x, mask), "device": lambda: device_module(x, mask),
                          "read": lambda: read_module(x, mask)}
            entry = {"device_vs_cached_max_abs_diff": float((device_module(x, mask) - cached).abs().max()),
                     "read_vs_cached_max_abs_diff": float((read_module(x, mask) - cached).abs().max())}
            unknown = torch.ones_like(mask)          # an inference tensor: decided on the device
            try:
                forced = runtime.forward(cached_module, x, unknown, stack="fused_mgpu")
                entry["masked_mgpu_vs_cached_max_abs_diff"] = float((forced - cached).abs().max())
                contenders["masked_mgpu"] = lambda: runtime.forward(cached_module, x, unknown, stack="fused_mgpu")
                holes = torch.from_numpy(make_mask("holes", config.batch_size, config.seq_len)).to(device)
                x_holes = x * holes.unsqueeze(-1).to(x.dtype)
                failed, worst = check_close(runtime.forward(cached_module, x_holes, holes, stack="fused_mgpu"),
                                            base(x_holes, holes))
                entry["masked_mgpu_holes"] = {"failed_elements": int(failed), "worst_err_over_tol": float(worst)}
            except (ValueError, RuntimeError) as e:   # not a shape the build takes, or no Hopper GPU
                entry["masked_mgpu_error"] = f"{type(e).__name__}: {e}"[:300]
            entry["plans"] = {name: [call.plan.explain().split(":")[0] for call in runtime.module_state(m).calls.values()]
                              for name, m in (("cached", cached_module), ("device", device_module),
                                              ("read", read_module))}
            times = time_contenders(contenders, device=device)
    finally:
        planner.HOST_MASK_READ_MIN_FLOP = threshold
    entry.update({f"{name}_ms": round(t["median_ms"], 4) for name, t in times.items()})
    return entry


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default="7,12,2,1,13,8,11,vit-s197")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: bench.paths.default_out_dir())")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/mask_cost.py times GPU calls: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    result = {"date": str(datetime.date.today()), "gpu": gpu, "torch": torch.__version__,
              "command": "python3 bench/mask_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "shapes": {}}
    out_dir, stem = args.out or default_out_dir(), f"mask-cost-{result['date']}-{slug(gpu)}"
    for sid in args.shapes:
        shape = shape_by_id(sid)
        config = TransformerConfig(**{k: getattr(shape.config, k) for k in TransformerConfig.__dataclass_fields__})
        result["shapes"][sid] = entry = measure(config, device)
        write_json(result, out_dir, stem)
        print(sid, entry, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
