"""GPU check of the Mosaic GPU whole-stack kernel (`ttj_jax/kernels/fused_stack_mgpu.py`) on an H200.

    PYTHONPATH=. python3 bench/fused_stack_mgpu_check.py --out bench/results [--shapes 2,1,9,10,12,5]
        [--mask all_true|prefix|holes] [--dtype float16|bfloat16]
    PYTHONPATH=. python3 bench/fused_stack_mgpu_check.py --out /tmp/x --smoke     # CPU: no GPU work

A new build's first launch may fail to compile (ptxas), produce wrong numbers, or deadlock. So:
1. Probe, in child processes: each shape's kernel is compiled and run once (90 s for a child's first
   shape, 45 s for each later one, 200 s in all); a shape that overruns (a barrier deadlock) is marked
   "hung" and its child killed, and a new child continues with the remaining shapes. Only shapes whose
   probe finished ("ok") are run in this process afterwards; if the kernel hangs the run still reports
   the Triton and XLA numbers.
2. Per official shape (2, 1, 9, 10, 12, 5 by default), every step in its own try/except:
   - correctness of `fused_stack_mgpu_forward` against the fp32 reference `ttj_jax.reference` under
     the harness rule (|err| <= max(0.002, 0.02 |ref|)); also against `emulate` (the NumPy model of
     the kernel's algorithm) on the first sequences, which separates kernel bugs from numerics;
   - the same rule for the existing Triton fused kernel and the XLA program, for comparison;
   - timing (median of TIMING_REPEATS timings of back-to-back calls, bench.jax_timing) of the Mosaic
     kernel, the Triton fused kernel (`fused_stack_forward`) and the XLA program
     (`ttj_jax.forward(..., stack="layers")`);
With --mask, the kernel's masked build is probed, checked (against the reference and `emulate` with the
same mask) and timed too ("mgpu_masked"), beside the mask-free build on the same x: all_true prices the
masked build where the mask-free one serves, prefix is a harness --padding-ratio 0.3 mask, holes a
random mask (position 0 valid).
With --dtype, the build that reads and writes that dtype is probed, run on x rounded to it, checked
against the reference on that x and against the fp32 build's output on the same x cast to the dtype
(the same computation: expected equal), and timed ("mgpu_io"); with --mask too, its masked build the
same way ("mgpu_io_masked").
The bridge's own launch of the kernel on torch tensors is checked by bench/mosaic_launch_check.py.
Writes <out>/fused-stack-mgpu-<date>-<gpu>.json after every shape and prints a table last. Budget:
about 6 minutes on an H200 (a deadline skips what is left after DEADLINE_S).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

DEFAULT_SHAPES = ("2", "1", "9", "10", "12", "5", "7")
MASK_KINDS = ("none", "all_true", "prefix", "holes")
TIMING_REPEATS = 7
MIN_TIMING_S = 0.05
EMULATED_SEQUENCES = 2
ATOL, RTOL = 0.002, 0.02
DEADLINE_S = 330.0
PROBE_FIRST_SHAPE_S = 90.0    # jax start-up and the first compile in a child
PROBE_PER_SHAPE_S = 45.0
PROBE_BUDGET_S = 200.0


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > 1500:
        text = text[:1500] + " ..."
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return text + " | at " + " <- ".join(f"{f.name}:{f.lineno}" for f in reversed(frames))


def harness_stats(out, ref) -> dict:
    """Failing elements and worst |err|/tolerance of `out` against `ref` under the harness rule, with the
    largest absolute error and the count of non-finite outputs."""
    import numpy as np
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    tolerance = np.maximum(ATOL, RTOL * np.abs(ref))
    finite = np.isfinite(out) & np.isfinite(ref)
    ratio = np.where(finite, np.abs(out - ref) / tolerance, np.inf)
    return {"failed_elements": int((ratio > 1).sum()), "worst_err_over_tol": float(ratio.max()),
            "max_abs_err": float(np.max(np.where(finite, np.abs(out - ref), np.inf))),
            "non_finite": int((~np.isfinite(out)).sum())}


def make_mask(kind: str, batch: int, seq_len: int, seed: int = 2):
    """The [B, S] bool mask --mask names (None for "none"), from `seed`: "prefix" is the harness's own
    --padding-ratio 0.3 mask (bench.baseline.make_inputs), "holes" ~30% invalid with position 0 valid."""
    import types

    import numpy as np
    if kind == "none":
        return None
    if kind == "all_true":
        return np.ones((batch, seq_len), bool)
    if kind == "prefix":
        from bench.baseline import make_inputs
        shape = types.SimpleNamespace(batch_size=batch, seq_len=seq_len, d_model=1)
        return make_inputs(shape, seed, padding_ratio=0.3)[1].numpy()
    if kind == "holes":
        mask = np.random.default_rng(seed).random((batch, seq_len)) < 0.7
        mask[:, 0] = True
        return mask
    raise ValueError(f"--mask {kind!r} is not one of {MASK_KINDS}")


def _setup(sid: str):
    import jax

    import ttj_jax as T
    from ttj_jax.kernels import fused_stack_mgpu as fsm
    config = T.OFFICIAL[sid].config
    params = T.init_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (config.batch_size, config.seq_len, config.d_model), jax.numpy.float32)
    weights = jax.block_until_ready(fsm.stack_weights_mgpu(params, config.num_heads))
    return config, params, x, weights


# --- 1. Probe (child processes) -----------------------------------------------------------------------

def _probe_child(shape_ids, mask_kind: str = "none", io_dtype: str = "float32") -> None:
    """Runs each shape's kernel once (and its masked build, with a mask); prints 'START sid', then
    'DONE sid seconds' or 'ERROR sid msg'."""
    import jax

    from ttj_jax.kernels import fused_stack_mgpu as fsm
    for sid in shape_ids:
        print(f"START {sid}", flush=True)
        start = time.perf_counter()
        try:
            config, _, x, weights = _setup(sid)
            jax.block_until_ready(fsm.fused_stack_mgpu_forward(weights, x, num_heads=config.num_heads))
            mask = make_mask(mask_kind, x.shape[0], x.shape[1])
            if mask is not None:
                jax.block_until_ready(fsm.fused_stack_mgpu_forward(weights, x, mask, num_heads=config.num_heads))
            if io_dtype != "float32":
                jax.block_until_ready(fsm.fused_stack_mgpu_forward(weights, x.astype(io_dtype),
                                                                   num_heads=config.num_heads))
                if mask is not None:
                    jax.block_until_ready(fsm.fused_stack_mgpu_forward(weights, x.astype(io_dtype), mask,
                                                                       num_heads=config.num_heads))
            print(f"DONE {sid} {time.perf_counter() - start:.1f}", flush=True)
        except Exception as e:   # recorded by the parent; the next shape still runs
            print(f"ERROR {sid} {_error(e)}".replace("\n", " "), flush=True)


def probe(shape_ids, budget_s: float = PROBE_BUDGET_S, mask_kind: str = "none", io_dtype: str = "float32") -> dict:
    """{sid: {"status": "ok"|"error"|"hung"|"crashed"|"not probed", ...}} from child processes (module
    docstring). A child gets PROBE_FIRST_SHAPE_S for its first shape (jax start-up, compile) and
    PROBE_PER_SHAPE_S for each later one; a shape that overruns is "hung", its child is killed, and a
    new child takes the remaining shapes, all within budget_s."""
    import queue
    import threading
    results, remaining = {}, list(shape_ids)
    probe_end = time.perf_counter() + budget_s
    while remaining and time.perf_counter() < probe_end:
        command = [sys.executable, os.path.abspath(__file__), "--probe-child", ",".join(remaining),
                   "--mask", mask_kind, "--dtype", io_dtype]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=_REPO_ROOT)
        lines: queue.Queue = queue.Queue()
        def read(stream=child.stdout, sink=lines):   # bound now: the loop rebinds child and lines
            for line in stream:
                sink.put(line)
            sink.put(None)
        threading.Thread(target=read, daemon=True).start()
        started, limit, first = None, PROBE_FIRST_SHAPE_S, True
        shape_deadline = time.perf_counter() + limit
        while True:
            wait = min(shape_deadline, probe_end) - time.perf_counter()
            try:
                line = lines.get(timeout=max(wait, 0.01))
            except queue.Empty:   # this shape overran its time: a deadlock, most likely
                child.kill()
                victim = started or remaining[0]
                results[victim] = {"status": "hung", "detail": f"no result after {limit:.0f} s; child killed"}
                break
            if line is None:      # the child exited
                child.wait()
                if started is not None:
                    results[started] = {"status": "crashed", "detail": (child.stderr.read() or "")[-1500:]}
                elif not any(s in results for s in remaining):
                    for s in remaining:
                        results[s] = {"status": "crashed", "detail": (child.stderr.read() or "")[-1500:]}
                break
            parts = line.rstrip("\n").split(" ", 2)
            if parts[0] == "START":
                started = parts[1]
                limit = PROBE_FIRST_SHAPE_S if first else PROBE_PER_SHAPE_S
                shape_deadline = time.perf_counter() + limit
                first = False
            elif parts[0] == "DONE":
                results[parts[1]] = {"status": "ok", "first_call_s": float(parts[2])}
                started = None
            elif parts[0] == "ERROR":
                results[parts[1]] = {"status": "error", "error": parts[2] if len(parts) > 2 else ""}
                started = None
        remaining = [s for s in remaining if s not in results]
    for s in remaining:
        results[s] = {"status": "not probed", "detail": "probe budget spent"}
    return results


# --- 2. Per-shape checks ------------------------------------------------------------------------------

def _time_jax(fn, args) -> dict:
    from bench.jax_timing import stream_ms_per_call
    ms, calls = stream_ms_per_call(fn, args, min_seconds=MIN_TIMING_S, repeats=TIMING_REPEATS)
    return {"ms_per_call": ms, "calls_per_timing": calls}


def run_shape(sid: str, probe_status: dict, deadline: float, mask_kind: str = "none",
              io_dtype: str = "float32") -> dict:
    import jax
    import numpy as np

    import ttj_jax as T
    from ttj_jax.kernels import fused_stack_mgpu as fsm
    from ttj_jax.kernels.fused_stack import fused_stack_forward, stack_weights

    record: dict = {"shape": T.OFFICIAL[sid].describe(), "probe": probe_status, "accuracy": {}, "timing": {}}
    config, params, x, weights = _setup(sid)
    H = config.num_heads
    ref = np.asarray(T.reference(params, x, config=config))
    mgpu_ok = probe_status.get("status") == "ok"

    def step(name, fn):
        if time.perf_counter() > deadline:
            record.setdefault("skipped_past_deadline", []).append(name)
            return None
        try:
            return fn()
        except Exception as e:   # one step's failure never stops the run
            record.setdefault("errors", {})[name] = _error(e)
            return None

    mgpu = lambda w, x: fsm.fused_stack_mgpu_forward(w, x, num_heads=H)   # noqa: E731
    default_erf = fsm.default_fast_erf(x.shape[0], x.shape[1], True)   # the erf the whole batch's kernel uses
    y_mgpu = None
    if mgpu_ok:
        y_mgpu = step("mgpu_run", lambda: np.asarray(jax.block_until_ready(mgpu(weights, x))))
        if y_mgpu is not None:
            record["accuracy"]["mgpu"] = harness_stats(y_mgpu, ref)

            def vs_emulation():
                n = min(EMULATED_SEQUENCES, x.shape[0])
                emulated = fsm.emulate(weights, np.asarray(x[:n]), fast_erf=default_erf)
                return {"sequences": n, **harness_stats(y_mgpu[:n], emulated),
                        "emulation_vs_reference": harness_stats(emulated, ref[:n])}
            record["accuracy"]["mgpu_vs_emulation"] = step("mgpu_vs_emulation", vs_emulation)
            record["timing"]["mgpu"] = step("mgpu_timing", lambda: _time_jax(mgpu, (weights, x)))
        mask = make_mask(mask_kind, x.shape[0], x.shape[1])
        if mask is not None:
            record["mask"] = {"kind": mask_kind, "valid_fraction": float(mask.mean())}
            jmask = jax.numpy.asarray(mask)
            masked = lambda w, x, m: fsm.fused_stack_mgpu_forward(w, x, m, num_heads=H)   # noqa: E731
            y_masked = step("mgpu_masked_run", lambda: np.asarray(jax.block_until_ready(masked(weights, x, jmask))))
            if y_masked is not None:
                ref_masked = np.asarray(T.reference(params, x, jmask, config=config))
                record["accuracy"]["mgpu_masked"] = harness_stats(y_masked, ref_masked)
                n = min(EMULATED_SEQUENCES, x.shape[0])
                record["accuracy"]["mgpu_masked_vs_emulation"] = step("mgpu_masked_vs_emulation", lambda: {
                    "sequences": n, **harness_stats(y_masked[:n], fsm.emulate(
                        weights, np.asarray(x[:n]), mask[:n], fast_erf=default_erf))})
                record["timing"]["mgpu_masked"] = step("mgpu_masked_timing",
                                                       lambda: _time_jax(masked, (weights, x, jmask)))
        if io_dtype != "float32":
            x_io = x.astype(io_dtype)
            x_exact = x_io.astype(jax.numpy.float32)   # the same values in fp32

            def io_check(name, build, *mask_args):
                """The build reading and writing io_dtype: run, checked against the reference on x_exact
                and against the fp32 build's output on x_exact cast (expected equal), timed. Its output, or
                None where it did not run."""
                y = step(f"{name}_run", lambda: np.asarray(
                    jax.block_until_ready(build(weights, x_io, *mask_args)), np.float32))
                if y is not None:
                    y_cast = np.asarray(build(weights, x_exact, *mask_args).astype(io_dtype), np.float32)
                    record["accuracy"][name] = {
                        "dtype": io_dtype,
                        **harness_stats(y, np.asarray(T.reference(params, x_exact, *mask_args, config=config))),
                        "equal_to_fp32_build_cast": bool(np.array_equal(y, y_cast)),
                        "max_abs_diff_from_fp32_build_cast": float(np.abs(y - y_cast).max())}
                    record["timing"][name] = step(f"{name}_timing",
                                                  lambda: _time_jax(build, (weights, x_io, *mask_args)))
                return y

            if io_check("mgpu_io", mgpu) is not None and mask is not None:   # then its masked build
                io_check("mgpu_io_masked", masked, jmask)
    else:
        record["mgpu_skipped"] = f"probe status {probe_status.get('status')}"

    fused_weights = step("triton_weights", lambda: jax.block_until_ready(
        stack_weights(T.prepare_weights(params, T.MIXED_FP16), num_heads=H)))
    if fused_weights is not None:
        triton = lambda w, x: fused_stack_forward(w, x, num_heads=H, causal=True)   # noqa: E731
        y = step("triton_run", lambda: np.asarray(jax.block_until_ready(triton(fused_weights, x))))
        if y is not None:
            record["accuracy"]["triton"] = harness_stats(y, ref)
            record["timing"]["triton"] = step("triton_timing", lambda: _time_jax(triton, (fused_weights, x)))

    prepared = step("xla_weights", lambda: jax.block_until_ready(T.prepare_weights(params, T.MIXED_FP16)))
    if prepared is not None:
        xla = lambda w, x: T.forward(w, x, config=config, stack="layers")   # noqa: E731
        y = step("xla_run", lambda: np.asarray(jax.block_until_ready(xla(prepared, x))))
        if y is not None:
            record["accuracy"]["xla"] = harness_stats(y, ref)
            record["timing"]["xla"] = step("xla_timing", lambda: _time_jax(xla, (prepared, x)))

    return record


# --- Driver -------------------------------------------------------------------------------------------

def _row(sid, rec) -> str:
    def ms(name):
        t = (rec.get("timing") or {}).get(name)
        return f"{t['ms_per_call'] * 1e3:8.1f}" if t else "       -"

    def acc(name):
        a = (rec.get("accuracy") or {}).get(name)
        return ("ok" if a["failed_elements"] == 0 else f"FAIL{a['failed_elements']}") if a else "-"

    probe_status = (rec.get("probe") or {}).get("status", "-")
    return (f"{sid:>3} {probe_status:>7} {acc('mgpu'):>9} {acc('mgpu_masked'):>9} {acc('mgpu_io'):>9} {acc('triton'):>7} "
            f"{acc('xla'):>7} {ms('mgpu')} {ms('mgpu_masked')} {ms('mgpu_io')} {ms('triton')} {ms('xla')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="directory for the JSON result (required)")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="official shape ids, comma separated")
    parser.add_argument("--smoke", action="store_true", help="CPU: parse, plan and write the JSON; no GPU work")
    parser.add_argument("--no-probe", action="store_true", help="skip the child-process probe (trust the kernel)")
    parser.add_argument("--mask", default="none", choices=MASK_KINDS,
                        help="also check and time the masked build with this mask (module docstring)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                        help="also check and time the build reading and writing this dtype (module docstring)")
    parser.add_argument("--probe-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_child is not None:
        _probe_child(args.probe_child.split(","), args.mask, args.dtype)
        return 0
    if not args.out:
        parser.error("--out is required")

    started = time.perf_counter()
    deadline = started + DEADLINE_S
    shape_ids = [s.strip() for s in args.shapes.split(",") if s.strip()]
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"script": "bench/fused_stack_mgpu_check.py", "smoke": args.smoke,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "shapes_requested": shape_ids, "harness_rule": {"atol": ATOL, "rtol": RTOL},
                    "mask": args.mask, "io_dtype": args.dtype, "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                    "shapes": {}}
    try:
        import jax

        import ttj_jax as T
        from ttj_jax.kernels import fused_stack_mgpu as fsm
        result["jax_version"] = jax.__version__
        result["devices"] = [str(d) for d in jax.devices()]
        device_name = getattr(jax.devices()[0], "device_kind", "cpu")
        result["gpu"] = device_name
        unknown = [s for s in shape_ids if s not in T.OFFICIAL]
        if unknown:
            raise ValueError(f"unknown shape ids {unknown}")
        result["supported"] = {s: fsm.supports(T.OFFICIAL[s].config, T.OFFICIAL[s].config.seq_len)
                               for s in shape_ids}
    except Exception as e:
        result["setup_error"] = _error(e)
        device_name = "unknown"
    stamp = datetime.date.today().isoformat()
    slug = "".join(c if c.isalnum() else "-" for c in str(device_name).lower()).strip("-") or "unknown"
    path = out_dir / f"fused-stack-mgpu-{stamp}-{'smoke' if args.smoke else slug}.json"

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    if args.smoke:
        result["plan"] = {s: result.get("supported", {}).get(s) for s in shape_ids}
        save()
        print(f"smoke: wrote {path}")
        return 0 if "setup_error" not in result else 1

    probes = {}
    if args.no_probe:
        probes = {s: {"status": "ok", "note": "probe skipped"} for s in shape_ids}
    else:
        try:
            probes = probe([s for s in shape_ids if result.get("supported", {}).get(s)], mask_kind=args.mask,
                           io_dtype=args.dtype)
        except Exception as e:
            result["probe_error"] = _error(e)
    result["probe"] = probes
    save()
    for sid in shape_ids:
        t0 = time.perf_counter()
        try:
            record = run_shape(sid, probes.get(sid, {"status": "not probed"}), deadline, args.mask, args.dtype)
        except Exception as e:
            record = {"error": _error(e)}
        record["wall_s"] = round(time.perf_counter() - t0, 1)
        result["shapes"][sid] = record
        result["total_wall_s"] = round(time.perf_counter() - started, 1)
        save()
        print(f"shape {sid}: {json.dumps(record, default=str)[:600]}", flush=True)

    print(f"\nwrote {path}  ({result['total_wall_s']} s)")
    print("times: us per call (stream of back-to-back jax calls)")
    print(f"{'id':>3} {'probe':>7} {'mgpu':>9} {'masked':>9} {'io':>9} {'triton':>7} {'xla':>7} {'mgpu':>8} "
          f"{'masked':>8} {'io':>8} {'triton':>8} {'xla':>8}")
    for sid, rec in result["shapes"].items():
        try:
            print(_row(sid, rec))
        except Exception as e:
            print(f"{sid:>3} (row failed: {e})")
    bad = any("error" in r or r.get("errors") or (r.get("probe") or {}).get("status") != "ok"
              or any((a or {}).get("failed_elements") or (a or {}).get("equal_to_fp32_build_cast") is False
                     for a in (r.get("accuracy") or {}).values())
              for r in result["shapes"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
