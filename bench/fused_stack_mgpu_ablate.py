"""Where the Mosaic whole-stack kernel's time goes: drop-one ablations of it, timed side by side (H200).

    PYTHONPATH=. python3 bench/fused_stack_mgpu_ablate.py --out bench/results [--shapes 2,12,9]
        [--variants default,shift_mask,no_mask,no_softmax,no_attention,no_gelu,no_layer_norm] [--tag T]

The profiler build (bench/fused_stack_mgpu_profile.py) runs 2x slower than the plain kernel, so its
per-phase split cannot say where the plain kernel's ~88 us per 128-row tile go. This script builds the
plain kernel several times, each with one piece of work removed or changed
(`fused_stack_mgpu.ABLATIONS`, `kernel_function(ablate=...)`; `a+b` combines two), and times them in
alternating rounds (median of ROUNDS timings of back-to-back calls each, bench.jax_timing): what a piece
costs is the default's time minus the variant's. Every variant except "shift_mask" computes a WRONG
output on purpose; each variant's failing elements against the fp32 reference (harness rule) are
recorded anyway, so the one meant to be exact is checked.

Question 1 (session 7): shape 12 (S=32, four sequences packed per tile) takes ~122 us against shape
2's ~88 (one 128-row tile, the same work per tile). The only code that differs is the block-diagonal
mask, built per head from two int32 divisions per score element; if those are real divisions (~20
instructions each, 64 elements per thread, 4 heads, 4 layers), they cost ~30 us. Prediction: with
"shift_mask" shape 12 drops to ~90 us, shape 2 does not move (its mask has no division).
Question 2: at S=128, is the tile bound by elementwise work (softmax, GELU, LayerNorm) or by the wgmma
chain? If removing the softmax or the GELU saves about what their instruction counts predict (~4 and
~2 us per layer), elementwise work is the lever.

Writes <out>/fused-stack-mgpu-ablate-<date>-<gpu>[-<tag>].json after every shape; prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

DEFAULT_SHAPES = "12,2,9"
DEFAULT_VARIANTS = "default,shift_mask,no_mask,no_softmax,no_attention,no_gelu,no_layer_norm"
ROUNDS = 7
KERNEL_CALLS = 20   # --kernels: calls under torch.profiler per variant
MIN_TIMING_S = 0.04
ATOL, RTOL = 0.002, 0.02


def parse_variant(text: str) -> frozenset:
    """'default' -> no ablation; 'a+b' -> {a, b}; names must be in ABLATIONS."""
    from ttj_jax.kernels.fused_stack_mgpu import ABLATIONS
    if text == "default":
        return frozenset()
    names = frozenset(text.split("+"))
    unknown = names - set(ABLATIONS)
    if unknown:
        raise ValueError(f"unknown ablations {sorted(unknown)} in {text!r}; known: {sorted(ABLATIONS)}")
    return names


def harness(out, ref) -> dict:
    import numpy as np
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    tolerance = np.maximum(ATOL, RTOL * np.abs(ref))
    ratio = np.where(np.isfinite(out), np.abs(out - ref) / tolerance, np.inf)
    return {"failed_elements": int((ratio > 1).sum()), "worst_err_over_tol": float(ratio.max())}


def gpu_activity(fn, args, calls: int = KERNEL_CALLS) -> dict:
    """GPU time per call of `calls` back-to-back calls under torch.profiler: kernel time, copies, span."""
    import jax

    from bench.cuda_trace import kernel_table, profile_cuda, summarize_activity
    trace = profile_cuda(lambda: fn(*args), calls)
    jax.block_until_ready(fn(*args))
    table = kernel_table(trace, calls, top=4)
    activity = summarize_activity(trace)
    device = next(iter(activity["devices"].values()))
    return {"kernel_us_per_call": table["kernel_us_per_call"], "span_us_per_call": table["span_us_per_call"],
            "kernels_per_call": device["kernels"] / calls, "copies_per_call": device["copies"] / calls,
            "copy_us_per_call": device["copy_ms"] * 1e3 / calls, "kernels": table["kernels"]}


def run_shape(sid: str, variants: list[str], log, kernels: bool = False) -> dict:
    import jax
    import numpy as np

    import ttj_jax as T
    from bench.jax_timing import stream_ms_per_call
    from ttj_jax.kernels import fused_stack_mgpu as fsm

    config = T.OFFICIAL[sid].config
    params = T.init_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (config.batch_size, config.seq_len, config.d_model), jax.numpy.float32)
    weights = jax.block_until_ready(fsm.stack_weights_mgpu(params, config.num_heads))
    ref = np.asarray(T.reference(params, x, config=config))
    record = {"shape": f"B={config.batch_size} S={config.seq_len} d={config.d_model} H={config.num_heads} "
                       f"L={config.num_layers}", "variants": {}}
    calls, outputs = {}, {}
    for name in variants:
        start = time.perf_counter()
        try:
            fn = jax.jit(fsm.kernel_function(config.batch_size, config.seq_len, config.num_heads,
                                             config.num_layers, True, d_model=config.d_model,
                                             ablate=parse_variant(name)))
            y = np.asarray(jax.block_until_ready(fn(x, weights.mats, weights.vecs)))
        except Exception as e:   # recorded; the other variants still run
            record["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            log(f"  shape {sid} {name}: ERROR {type(e).__name__}")
            continue
        calls[name], outputs[name] = fn, y
        record["variants"][name] = {"compile_and_first_call_s": round(time.perf_counter() - start, 1),
                                    **harness(y, ref)}
        log(f"  shape {sid} {name}: built in {time.perf_counter() - start:.1f} s, "
            f"{record['variants'][name]['failed_elements']} failing elements")
    if "default" in outputs:
        for name, y in outputs.items():
            record["variants"][name]["max_abs_diff_vs_default"] = float(np.max(np.abs(y - outputs["default"])))
    timings = {name: [] for name in calls}
    args = (x, weights.mats, weights.vecs)
    for round_index in range(ROUNDS):   # alternating rounds: drift hits every variant alike
        for name, fn in calls.items():
            ms, _ = stream_ms_per_call(fn, args, min_seconds=MIN_TIMING_S, repeats=1)
            timings[name].append(ms * 1e3)
    for name, values in timings.items():
        record["variants"][name]["us_per_call"] = statistics.median(values)
        record["variants"][name]["us_per_call_rounds"] = values
        if kernels:
            try:
                record["variants"][name]["gpu"] = gpu_activity(calls[name], args)
            except Exception as e:   # recorded; the timings above stand
                record["variants"][name]["gpu"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="")
    parser.add_argument("--kernels", action="store_true",
                        help="also record each variant's GPU kernel time per call (torch.profiler)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for name in variants:
        parse_variant(name)   # bad names fail before any GPU work
    import jax
    from bench.report import slug
    device = jax.devices()[0]
    if device.platform != "gpu":
        print("this script times a Hopper kernel: it needs an sm_90 GPU", file=sys.stderr)
        return 2
    gpu = device.device_kind
    date = datetime.date.today().isoformat()
    path = pathlib.Path(args.out) / f"fused-stack-mgpu-ablate-{date}-{slug(gpu)}{'-' + args.tag if args.tag else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"script": "bench/fused_stack_mgpu_ablate.py", "gpu": gpu, "jax": jax.__version__, "date": date,
              "command": "python3 bench/fused_stack_mgpu_ablate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rounds": ROUNDS, "shapes": {}}
    log = lambda text: print(text, flush=True)   # noqa: E731
    for sid in args.shapes.split(","):
        log(f"shape {sid}: {len(variants)} builds")
        result["shapes"][sid] = run_shape(sid, variants, log, kernels=args.kernels)
        path.write_text(json.dumps(result, indent=1))
    log(f"\nus per call (median of {ROUNDS} alternating rounds); delta against default; failing elements")
    log(f"{'variant':<28}" + "".join(f"{'shape ' + s:>24}" for s in result["shapes"]))
    for name in variants:
        cells = []
        for rec in result["shapes"].values():
            v, base = rec["variants"].get(name, {}), rec["variants"].get("default", {})
            if "us_per_call" not in v:
                cells.append(f"{'error':>24}")
                continue
            delta = v["us_per_call"] - base["us_per_call"] if "us_per_call" in base else float("nan")
            kernel = v.get("gpu", {}).get("kernel_us_per_call")
            cells.append(f"{v['us_per_call']:>9.1f} ({delta:+6.1f}) {v['failed_elements']:>6}"
                         + (f" k{kernel:>6.1f}" if kernel is not None else ""))
        log(f"{name:<28}" + "".join(cells))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
