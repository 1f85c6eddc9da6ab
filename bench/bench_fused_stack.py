"""The whole layer stack as one Pallas kernel against the XLA program, on the launch-bound official shapes.

    python bench/bench_fused_stack.py [--shapes 1,2,12] [--quick] [--ptxas] [--out DIR]

For each official shape the fused kernel supports (of 1, 2, 3, 4, 7, 9, 10, 11, 12): builds params with
`ttj_jax.init_params`, runs the XLA program (`ttj_jax.forward`'s executable for the mask-free plan) and the
fused kernel (`fused_stack_forward`, several tilings) on one fp32 input, checks each kernel output against
the XLA output and against the exact fp32 reference under the harness rule (atol 0.002, rtol 0.02), and
times every contender, compile apart:
- ms: median over TIMING_REPEATS timings of N back-to-back calls closed by one block_until_ready, with N
  chosen so one timing lasts >= MIN_TIMING_S (what a stream of calls costs, dispatch overlapped);
- in_graph_ms: IN_GRAPH_REPEATS dependent calls inside one jitted program, per call (device time, no
  dispatch);
- dispatch_us: host time for one call to return (async), median;
- latency_ms: one call plus block_until_ready, median.
Every contender runs inside try/except: a failure is recorded, never fatal. Writes
<out>/fused-stack-<date>-<gpu>.json and prints a table last; exit status 1 if a check failed.

--ptxas compiles each variant's Triton IR for sm_90 with the `triton` package's own compiler and ptxas
(no GPU needed) and records registers, spilled bytes and shared memory: run it on a CPU to vet tilings
before spending GPU time. --smoke runs small shapes in interpret mode to test this script on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ttj_jax as T  # noqa: E402
from bench.jax_timing import stream_ms_per_call  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import describe_error, slug  # noqa: E402
from ttj_jax.kernels.fused_stack import fused_stack_forward, stack_weights, supports  # noqa: E402

SHAPE_IDS = ("1", "2", "3", "4", "7", "9", "10", "11", "12")
# Small shapes for --smoke (interpret mode on a CPU): ids, config.
SMOKE_SHAPES = {"smoke-S32": T.Config(2, 32, 64, 4, 64, 2, True), "smoke-hd8": T.Config(1, 16, 32, 4, 32, 1, True)}
MIN_TIMING_S = 0.05
TIMING_REPEATS = 7
IN_GRAPH_REPEATS = 50
LATENCY_CALLS = 50
DEFAULT = {"block_sequences": 1, "num_warps": 8, "num_stages": 1, "ffn_block": 64}


def log(message: str):
    print(message, flush=True)


def variants(config: T.Config, *, quick: bool) -> list[dict]:
    """Tilings to time for one shape, the default first. Packing pays only for short sequences (the score
    tile grows as the square of block_sequences * S), so block_sequences > 1 is tried for S <= 64 only."""
    tried = [dict(DEFAULT), dict(DEFAULT, num_warps=4), dict(DEFAULT, num_warps=16)]
    if config.seq_len <= 64:
        tried += [dict(DEFAULT, block_sequences=2, num_warps=4), dict(DEFAULT, block_sequences=4)]
    if not quick:
        tried += [dict(DEFAULT, num_stages=2), dict(DEFAULT, num_stages=3), dict(DEFAULT, ffn_block=128),
                  dict(DEFAULT, unroll=True)]
    return tried


def _variant_name(variant: dict) -> str:
    return (f"bs{variant['block_sequences']} w{variant['num_warps']} s{variant['num_stages']} "
            f"f{variant['ffn_block']}" + (" unrolled" if variant.get("unroll") else ""))


def _fused_fn(config: T.Config, variant: dict, interpret: bool):
    kwargs = dict(num_heads=config.num_heads, causal=config.causal, interpret=interpret, **variant)
    return jax.jit(lambda weights, x: fused_stack_forward(weights, x, **kwargs))


def _xla_fn(config: T.Config, x):
    """The XLA program (`stack="layers"`: the planner would now pick the fused kernel itself here) that
    `ttj_jax.forward` runs for this input without a mask (planning done once, here)."""
    from ttj_jax.model import plan_for
    plan = plan_for(config, x, T.MaskKind.NONE, stack="layers")
    executable = T.executable(plan, T.model_key(config))
    return (lambda weights, x: executable(weights, x, None)), plan.explain()


# ----------------------------------------------------------------------------------------------------
# Checking and timing.

def _harness_check(out, ref) -> dict:
    """Failing elements and the worst |err|/tolerance under the harness rule (bench.baseline.check_close)."""
    import torch

    from bench.baseline import check_close
    failed, worst = check_close(torch.from_numpy(np.asarray(out, np.float32)),
                                torch.from_numpy(np.asarray(ref, np.float32)))
    max_abs = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32))))
    return {"failed": failed, "worst_ratio": worst, "max_abs_err": max_abs}


def _repeated(fn, repeats: int):
    """`repeats` dependent calls of fn(weights, x) in one program: each call's input takes one element
    of the previous output, so the calls cannot overlap or be elided."""
    def run(weights, x):
        def body(_, carry):
            x, _ = carry
            y = fn(weights, x)
            return x.at[0, 0, 0].set(y[0, 0, 0]), y
        return jax.lax.fori_loop(0, repeats, body, (x, jnp.zeros_like(x)))[1]
    return jax.jit(run)


def _time_dispatch_and_latency(fn, args) -> tuple[float, float]:
    """Median host time for one call to return (us), and median time of one call plus its sync (ms)."""
    dispatch, latency = [], []
    for _ in range(LATENCY_CALLS):
        start = time.perf_counter()
        out = fn(*args)
        returned = time.perf_counter()
        jax.block_until_ready(out)
        done = time.perf_counter()
        dispatch.append((returned - start) * 1e6)
        latency.append((done - start) * 1e3)
    return statistics.median(dispatch), statistics.median(latency)


def measure(fn, args) -> dict:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))                       # compile and warm up
    record = {"compile_s": round(time.perf_counter() - start, 3)}
    for _ in range(20):
        out = fn(*args)
    jax.block_until_ready(out)
    record["ms"], _ = stream_ms_per_call(fn, args, min_seconds=MIN_TIMING_S, repeats=TIMING_REPEATS)
    record["dispatch_us"], record["latency_ms"] = _time_dispatch_and_latency(fn, args)
    looped = _repeated(fn, IN_GRAPH_REPEATS)
    jax.block_until_ready(looped(*args))
    record["in_graph_ms"] = stream_ms_per_call(looped, args, min_seconds=MIN_TIMING_S,
                                               repeats=TIMING_REPEATS)[0] / IN_GRAPH_REPEATS
    return record


# ----------------------------------------------------------------------------------------------------
# --ptxas: registers, spills and shared memory of each tiling, from Triton's own compiler.

def _triton_ir(config: T.Config, variant: dict) -> str:
    """The Triton IR (text) that Pallas lowers the kernel to for CUDA, captured from its private lowering
    hook (version-dependent: any failure is reported, not fatal)."""
    from jax._src.pallas.triton import lowering
    captured = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    params = jax.eval_shape(lambda: T.init_params(jax.random.key(0), config))
    weights = jax.eval_shape(lambda p: stack_weights(T.prepare_weights(p, T.MIXED_FP16),
                                                     num_heads=config.num_heads), params)
    x = jax.ShapeDtypeStruct((config.batch_size, config.seq_len, config.d_model), jnp.float32)
    lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(_fused_fn(config, variant, False)).trace(weights, x).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return captured[-1]


def ptxas_report(config: T.Config, variant: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    with tempfile.TemporaryDirectory() as folder:
        ttir = pathlib.Path(folder) / "ttj_fused_stack.ttir"
        ttir.write_text(_triton_ir(config, variant))
        kernel = triton.compile(str(ttir), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": variant["num_warps"], "num_stages": variant["num_stages"]})
        ptx = pathlib.Path(folder) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        ptxas = os.environ.get("TRITON_PTXAS_PATH") or str(
            pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas")
        info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(ptx), "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else None
    return {"triton": triton.__version__, "registers": number(r"Used (\d+) registers"),
            "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads"), "shared_bytes": kernel.metadata.shared,
            "wgmma": kernel.asm["ptx"].count("wgmma.mma_async")}


# ----------------------------------------------------------------------------------------------------

def run_shape(shape_id: str, config: T.Config, *, quick: bool, ptxas: bool, interpret: bool) -> list[dict]:
    records = []
    base = {"shape": shape_id, "B": config.batch_size, "S": config.seq_len, "d": config.d_model,
            "H": config.num_heads, "ffn": config.ffn_dim, "L": config.num_layers}
    tilings = variants(config, quick=quick or interpret)
    if ptxas and not interpret and jax.devices()[0].platform != "gpu":   # vetting on a CPU: compile only
        for variant in tilings:
            record = dict(base, contender="fused", variant=variant)
            try:
                record["ptxas"] = ptxas_report(config, variant)
            except Exception as exc:  # noqa: BLE001 - one tiling's failure must not end the run
                record["error"] = describe_error(exc)
            records.append(record)
            _log_record(record)
        return records

    params = T.init_params(jax.random.key(int(re.sub(r"\D", "", shape_id) or 0)), config)
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    weights = stack_weights(prepared, num_heads=config.num_heads)
    x = jax.random.normal(jax.random.key(1234), (config.batch_size, config.seq_len, config.d_model), jnp.float32)
    exact = np.asarray(T.reference(params, x, config=config))

    xla_out = None
    record = dict(base, contender="xla")
    try:
        xla, explanation = _xla_fn(config, x)
        xla_out = np.asarray(xla(prepared, x))
        record.update(plan=explanation, vs_exact=_harness_check(xla_out, exact))
        record.update(measure(xla, (prepared, x)))
    except Exception as exc:  # noqa: BLE001 - one contender's failure must not end the run
        record["error"] = describe_error(exc)
    records.append(record)
    _log_record(record)

    for variant in tilings:
        record = dict(base, contender="fused", variant=variant)
        try:
            if ptxas:
                record["ptxas"] = ptxas_report(config, variant)
            fused = _fused_fn(config, variant, interpret)
            out = np.asarray(fused(weights, x))
            record["vs_exact"] = _harness_check(out, exact)
            if xla_out is not None:
                record["vs_xla"] = _harness_check(out, xla_out)
            record["check_passed"] = all(record[k]["failed"] == 0 for k in ("vs_exact", "vs_xla") if k in record)
            record.update(measure(fused, (weights, x)))
        except Exception as exc:  # noqa: BLE001
            record["error"] = describe_error(exc)
        records.append(record)
        _log_record(record)
    return records


def _log_record(r: dict):
    name = r["contender"] + (f" {_variant_name(r['variant'])}" if "variant" in r else "")
    parts = [f"  shape {r['shape']:>9s} {name:24s}"]
    if "ms" in r:
        parts.append(f"{r['ms'] * 1e3:8.1f} us/call stream, {r['in_graph_ms'] * 1e3:8.1f} us in graph, "
                     f"{r['dispatch_us']:6.1f} us dispatch, {r['latency_ms'] * 1e3:8.1f} us latency")
    for key in ("vs_xla", "vs_exact"):
        if key in r:
            parts.append(f"{key} failed={r[key]['failed']} worst={r[key]['worst_ratio']:.3f}")
    if "ptxas" in r:
        p = r["ptxas"]
        parts.append(f"regs={p['registers']} spill={p['spill_store_bytes']}/{p['spill_load_bytes']} B "
                     f"smem={p['shared_bytes']} B")
    if "error" in r:
        parts.append("ERROR " + r["error"][:300])
    log("  ".join(parts))


def _print_table(records: list[dict]):
    log("")
    log(f"{'shape':>9s} {'contender':26s} {'us/call':>8s} {'in-graph':>8s} {'dispatch':>8s} {'vs xla':>7s} "
        f"{'worst/tol':>9s} {'regs':>5s} {'spill':>6s} {'smem KB':>7s}")
    xla_us = {r["shape"]: r["ms"] * 1e3 for r in records if r["contender"] == "xla" and "ms" in r}
    for r in records:
        name = r["contender"] + (f" {_variant_name(r['variant'])}" if "variant" in r else "")
        us = f"{r['ms'] * 1e3:8.1f}" if "ms" in r else f"{'-':>8s}"
        graph = f"{r['in_graph_ms'] * 1e3:8.1f}" if "in_graph_ms" in r else f"{'-':>8s}"
        dispatch = f"{r['dispatch_us']:8.1f}" if "dispatch_us" in r else f"{'-':>8s}"
        speedup = f"{xla_us[r['shape']] / (r['ms'] * 1e3):6.2f}x" if "ms" in r and r["shape"] in xla_us else f"{'':>7s}"
        worst = max((r[k]["worst_ratio"] for k in ("vs_xla", "vs_exact") if k in r), default=None)
        worst = f"{worst:9.3f}" if worst is not None else f"{'-':>9s}"
        p = r.get("ptxas", {})
        regs = f"{p['registers']:5d}" if p.get("registers") is not None else f"{'-':>5s}"
        spill = f"{p['spill_store_bytes']:6d}" if p.get("spill_store_bytes") is not None else f"{'-':>6s}"
        smem = f"{p['shared_bytes'] / 1024:7.0f}" if p.get("shared_bytes") is not None else f"{'-':>7s}"
        flag = "  CHECK FAILED" if r.get("check_passed") is False else ("  ERROR" if "error" in r else "")
        log(f"{r['shape']:>9s} {name:26s} {us} {graph} {dispatch} {speedup} {worst} {regs} {spill} {smem}{flag}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shapes", default=",".join(SHAPE_IDS), help="official shape ids, comma-separated")
    parser.add_argument("--quick", action="store_true", help="time fewer tilings per shape")
    parser.add_argument("--ptxas", action="store_true",
                        help="also compile each tiling with the triton package and record registers/spills/smem "
                             "(on a CPU: only that, no runs)")
    parser.add_argument("--out", default=default_out_dir(), help="folder for the JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="small shapes in interpret mode: tests this script on a CPU, numbers mean nothing")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    if device.platform != "gpu" and not (args.smoke or args.ptxas):
        log(f"bench_fused_stack needs a GPU (found {device.platform}); --smoke tests the script on a CPU, "
            "--ptxas vets the tilings' registers without one")
        return 2
    gpu_name = getattr(device, "device_kind", device.platform) if device.platform == "gpu" else "cpu"
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    log(f"device: {gpu_name}, jax {jax.__version__}, torch {torch_version}")
    started = time.perf_counter()

    if args.smoke:
        shapes = dict(SMOKE_SHAPES)
    else:
        requested = [s.strip() for s in args.shapes.split(",") if s.strip()]
        unknown = [s for s in requested if s not in T.OFFICIAL]
        if unknown:
            parser.error(f"unknown shape ids {unknown}; official ids are {list(T.OFFICIAL)}")
        shapes = {s: T.OFFICIAL[s].config for s in requested}
    records = []
    for shape_id, config in shapes.items():
        if not supports(config, config.seq_len):
            log(f"shape {shape_id}: skipped, the fused kernel does not support it")
            records.append({"shape": shape_id, "contender": "fused", "error": "unsupported by the fused kernel"})
            continue
        log(f"shape {shape_id}: B={config.batch_size} S={config.seq_len} d={config.d_model} H={config.num_heads} "
            f"ffn={config.ffn_dim} L={config.num_layers} ({time.perf_counter() - started:.0f} s so far)")
        records += run_shape(shape_id, config, quick=args.quick, ptxas=args.ptxas, interpret=args.smoke)

    date = datetime.date.today().isoformat()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-smoke" if args.smoke else ("-ptxas" if args.ptxas and device.platform != "gpu" else "")
    path = out_dir / f"fused-stack-{date}-{slug(gpu_name)}{suffix}.json"
    payload = {"gpu": gpu_name, "jax": jax.__version__, "torch": torch_version, "date": date,
               "quick": args.quick, "timing": {"min_timing_s": MIN_TIMING_S, "repeats": TIMING_REPEATS,
                                               "in_graph_repeats": IN_GRAPH_REPEATS},
               "records": records}
    path.write_text(json.dumps(payload, indent=1, default=str) + "\n")

    _print_table(records)
    failed = [f"{r['shape']} {_variant_name(r['variant'])}" for r in records if r.get("check_passed") is False]
    checked = [r for r in records if "check_passed" in r]
    log(f"\nchecks failed: {failed}" if failed else
        f"\nall {len(checked)} checks passed" if checked else "\nno checks ran (--ptxas on a CPU compiles only)")
    log(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
