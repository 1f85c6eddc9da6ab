"""Where the bridge module's host time per call goes, part by part, per shape (GPU), next to its GPU time.

    PYTHONPATH=. python3 bench/host_parts.py [--shapes 7,9,10,12,1,2,5,11 | all] [--calls 200] [--out DIR]
                                             [--device cpu]   (a smoke run: no launch, nothing GPU)

Per shape: the module built as the harness builds it (bench.baseline.harness_models, on cuda), the
harness's all-True mask, one call made under torch.inference_mode (the plan, compiles, the one-time
check of a direct launch). Then each part below is sampled interleaved, the GPU drained before each sample
(bench.timing.interleaved_host_overhead_us, as bench.host_overhead and bench.torch_check's host_us), median
microseconds:

    noop            a Python lambda (the timer's own floor)
    empty           torch.empty of the output's shape on the GPU
    module          the module's __call__ (what the harness calls)
    lane            bridge.runtime.fast_forward alone: the native lane's repeat (C++), where the module has one
    forward         bridge.runtime.forward (validation, mask kind, plan lookup, weights check, launch)
    state           runtime's per-module state lookup with its structure check
    classify        the mask's kind (a GPU mask: cached per tensor object and version)
    weights_check   the parameters' in-place-write check (bridge/versions.py ParameterWatch.changed)
    kernel_tensors  the kernel's weights for this call (the check above plus the cache lookup)
    direct          the direct launch alone (allocation, pointers, stream check, launch), where the call has one
                    (the Mosaic kernel, or the rows stack's Triton kernels)
    kernel_call     MosaicStackLaunch.__call__ alone, where the direct launch is the Mosaic kernel
    raw_launch      the Mosaic kernel's host entry with fixed pointers (MosaicLauncher.launch)

plus b2b_module: the module's mean host time per call over 200 calls back to back (not drained), and
gpu_us: the module's CUDA-event median per call, back to back (bench.timing.time_contenders), with
host_over_gpu = module / gpu_us (the target: below 0.6). Writes <out>/host-parts-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import bridge  # noqa: E402
from bench.baseline import TransformerConfig, harness_models, make_inputs  # noqa: E402
from bench.host_overhead import HOST_OVER_GPU_TARGET, parse_shapes, shape_by_id  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402
from bench.timing import interleaved_host_overhead_us, time_contenders  # noqa: E402
from bridge import runtime  # noqa: E402
from bridge.mosaic_launch import MosaicStackLaunch  # noqa: E402


def parts(ours, x: torch.Tensor, mask: torch.Tensor) -> dict:
    """The contenders for one module and input (after its first call)."""
    state = runtime.module_state(ours)
    call = next(c for key, c in state.calls.items() if key[0] == x.shape)
    stack = call.plan.stack
    contenders = {
        "noop": lambda: None,
        "empty": lambda: torch.empty(x.shape, dtype=torch.float32, device=x.device),
        "module": lambda: ours(x, mask),
        "forward": lambda: runtime.forward(ours, x, mask),
        "state": lambda: runtime._state(ours, None),
        "classify": lambda: state.classify(mask),
        "weights_check": lambda: state.watch.changed(),
    }
    if state.lane is not None:
        contenders["lane"] = lambda: runtime.fast_forward(ours, x, mask)
    if call.direct is not None:
        tensors = state.kernel_tensors(stack)
        contenders["kernel_tensors"] = lambda: state.kernel_tensors(stack)
        contenders["direct"] = lambda: call.direct(x, mask, tensors)
        kernel = getattr(call.direct, "kernel", None)
        if isinstance(kernel, MosaicStackLaunch):   # the Mosaic kernel: its own call, and its host entry with fixed pointers
            arrays = ((mask,) if getattr(call.direct, "mode", None) == "masked" else ()) + tuple(tensors)
            kept = kernel(x, *arrays)
            pointers = (x.data_ptr(), *(a.data_ptr() for a in arrays), kept.data_ptr())
            contenders["kernel_call"] = lambda: kernel(x, *arrays)
            contenders["raw_launch"] = lambda: kernel._launch(pointers)
    info = {"stack": stack, "direct": call.direct is not None, "direct_note": call.direct_note,
            "shared_version_counter": state.watch.shared}
    return contenders, info


def back_to_back_us(fn, device: torch.device, calls: int = 200) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default="7,9,10,12,1,2,5,11")
    parser.add_argument("--calls", type=int, default=200, help="drained samples per part")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: bench.paths.default_out_dir())")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run (no launch)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/host_parts.py: no CUDA device here (--device cpu runs the CPU path)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"date": str(datetime.date.today()), "gpu": gpu, "torch": torch.__version__,
              "command": "python3 bench/host_parts.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "calls": args.calls, "shapes": {}}
    out_dir = args.out or default_out_dir()
    stem = f"host-parts-{result['date']}-{slug(gpu)}"
    for sid in args.shapes:
        shape = shape_by_id(sid)
        config = TransformerConfig(**{k: getattr(shape.config, k) for k in TransformerConfig.__dataclass_fields__})
        _, ours = harness_models(config, bridge.TTJTransformer, device=device)
        x, mask = make_inputs(config, 1, device=device)
        with torch.inference_mode():
            ours(x, mask)
            contenders, info = parts(ours, x, mask)
            medians = {name: round(r["median_us"], 2) for name, r in
                       interleaved_host_overhead_us(contenders, args.calls, device=device).items()}
            medians["b2b_module"] = round(back_to_back_us(contenders["module"], device), 2)
            gpu_ms = time_contenders({"module": contenders["module"]}, device=device)["module"]["median_ms"]
        entry = {**info, **medians, "gpu_us": round(gpu_ms * 1e3, 2),
                 "host_over_gpu": round(medians["module"] / (gpu_ms * 1e3), 3)}
        result["shapes"][sid] = entry
        path = write_json(result, out_dir, stem)
        shown = " ".join(f"{k}={v}" for k, v in entry.items() if isinstance(v, float))
        print(f"{sid:>3} {info['stack']:<10} {shown}", flush=True)
        contenders = ours = x = mask = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    over = [sid for sid, e in result["shapes"].items() if e["host_over_gpu"] >= HOST_OVER_GPU_TARGET]
    print(f"host/GPU >= {HOST_OVER_GPU_TARGET}: {over or 'none'}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
