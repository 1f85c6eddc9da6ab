"""Where the Mosaic whole-stack kernel's time goes: drop-one ablations of it, timed side by side (H200).

    PYTHONPATH=. python3 bench/fused_stack_mgpu_ablate.py --out bench/results [--shapes 2,12,9]
        [--variants default,all_keys+rational_erf,no_mask,no_attention] [--kernels] [--tag T]
    shapes: official ids or BxSxH (shape 1's model at that batch, sequence length and heads)

The profiler build (bench/fused_stack_mgpu_profile.py) runs 2x slower than the plain kernel, so its
per-phase split cannot say where the plain kernel's ~88 us per 128-row tile go. This script builds the
plain kernel several times, each with one piece of work removed or changed
(`fused_stack_mgpu.ABLATIONS`, `kernel_function(ablate=...)`; `a+b` combines two), and times them in
alternating rounds (median of ROUNDS timings of back-to-back calls each, bench.jax_timing): what a piece
costs is the default's time minus the variant's. Every variant except "all_keys", "shift_mask" and
the KERNEL_OPTIONS computes a WRONG output on purpose; each variant's failing elements against the
fp32 reference (harness rule) are recorded anyway, so the ones meant to be exact are checked.

Questions asked with it (session 7, H200; kernel times from --kernels):
1. Why shape 12 (S=32, four sequences packed per tile) took ~118 us against shape 2's ~84 (the same work
   per tile). Prediction: its block-diagonal mask's two int32 divisions per score element, ~30 us.
   Answer: the mask was 36 us (no_mask), but shifts instead of divisions changed nothing (shift_mask);
   elementwise work in general was the cost (no softmax, GELU and LayerNorm: 46 us). Each consumer's
   rows hold whole sequences, so scoring only its own 64 keys (half the scores, one unsigned compare
   for the mask) took shape 12 to 71 us (...-session7-keys.json; the old layout is "all_keys").
2. Whether S=128 tiles are bound by elementwise work: removing softmax, GELU and LayerNorm took shape 2
   from 84 to 46 us, the attention alone 22 (...-session7-kernels.json). Consumer 0 scoring only keys
   0-63 (its others are all in the future) with the fast erf: 6-17% faster up to 64 tiles, slower at
   128 and 10000 (...-session7-defaults.json; fused_stack_mgpu.SPLIT_MAX_TILES).

3. Session 14: where the default build's waits for wgmma cost time. Chaining the out-projection's and
   MLP-out's products into an accumulator seeded with the residual (residual_acc, now the default) took
   shape 2 from 78.3 to 72.3 us of kernel time, consumer 1's two key blocks chained (no_chain_keys is
   the build without) another ~2-3 us; pipelining the projections did not pay (pipeline; ...-session14-
   {resacc,chain,pipeline}.json, README "Official shapes 1-13").

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

from bench.fused_stack_mgpu_check import VARIANTS, harness_stats  # noqa: E402

DEFAULT_SHAPES = "12,2,9"
DEFAULT_VARIANTS = "default,all_keys+rational_erf,no_mask,no_softmax,no_attention,no_gelu,no_layer_norm"
ROUNDS = 7
KERNEL_CALLS = 20   # --kernels: calls under torch.profiler per variant
MIN_TIMING_S = 0.04


# kernel_function's own switches: the check script's variants, and the fast erf by name
KERNEL_OPTIONS = {**VARIANTS, "fast_erf": {"fast_erf": True}, "half_softmax": {"half_softmax": True},
                  "residual_acc": {"residual_accumulator": True},      # the default since session 14
                  "no_residual_acc": {"residual_accumulator": False},  # the build before it
                  "pipeline": {"pipeline": True},
                  "no_chain_keys": {"chain_key_blocks": False}}   # the build before session 14's second change


def parse_variant(text: str) -> dict:
    """'default' -> {}; 'a+b' -> kernel_function keyword arguments: names from ABLATIONS go into
    ablate=..., names in KERNEL_OPTIONS their keyword arguments."""
    from ttj_jax.kernels.fused_stack_mgpu import ABLATIONS
    if text == "default":
        return {}
    names = set(text.split("+"))
    unknown = names - set(ABLATIONS) - set(KERNEL_OPTIONS)
    if unknown:
        raise ValueError(f"unknown variant parts {sorted(unknown)} in {text!r}; known: "
                         f"{sorted(ABLATIONS) + list(KERNEL_OPTIONS)}")
    kwargs = {key: value for name in names & set(KERNEL_OPTIONS) for key, value in KERNEL_OPTIONS[name].items()}
    ablate = frozenset(names - set(KERNEL_OPTIONS))
    return {**kwargs, "ablate": ablate} if ablate else kwargs


def shape_config(sid: str):
    """An official shape id, or 'BxSxH' (shape 1's model at that batch, sequence length and heads)."""
    import dataclasses

    import ttj_jax as T
    if sid in T.OFFICIAL:
        return T.OFFICIAL[sid].config
    try:
        batch, seq_len, heads = (int(v) for v in sid.split("x"))
    except ValueError:
        raise ValueError(f"shape {sid!r}: an official id or BxSxH, e.g. 64x64x4") from None
    return dataclasses.replace(T.OFFICIAL["1"].config, batch_size=batch, seq_len=seq_len, num_heads=heads)


def gpu_activity(fn, args, calls: int = KERNEL_CALLS) -> dict:
    """GPU time per call of `calls` back-to-back calls under torch.profiler: kernel time, copies, span."""
    from bench.cuda_trace import kernel_table, profile_cuda, summarize_activity
    trace = profile_cuda(lambda: fn(*args), calls)   # the GPU drained before and after
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

    config = shape_config(sid)
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
                                             **parse_variant(name)))
            y = np.asarray(jax.block_until_ready(fn(x, weights.mats, weights.vecs)))
        except Exception as e:   # recorded; the other variants still run
            record["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:800]}"}
            log(f"  shape {sid} {name}: ERROR {type(e).__name__}")
            continue
        calls[name], outputs[name] = fn, y
        record["variants"][name] = {"compile_and_first_call_s": round(time.perf_counter() - start, 1),
                                    **harness_stats(y, ref)}
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
    for sid in args.shapes.split(","):
        shape_config(sid)
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
    try:   # torch reads the GPU's kernel times for --kernels
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    result = {"script": "bench/fused_stack_mgpu_ablate.py", "gpu": gpu, "jax": jax.__version__,
              "torch": torch_version, "date": date,
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
