"""Where the bridge's host time goes, against the JAX-direct call, per shape (GPU), and how it compares
with the GPU time of the same call.

Every number is a drained host time (the GPU synced before each call, `perf_counter` around the call: the
official run's `bridge_host_us` / `jax_host_us`), and all the variants of one shape are sampled
interleaved (bench.timing.interleaved_host_overhead_us), so their differences are the cost of what one
adds to the other, not of the host's pace drifting between two measurements. The variants build the
bridge's call up step by step:

    jax_direct       the JAX user's call (prepared weights, a jax input; its output, a jax array, freed)
    dispatch         the bridge's own compiled call on an input imported once (output freed as a jax array)
    +import          + the per-call ordering event and DLPack import of x
    +export          + the DLPack export of the output (freed as a torch tensor)
    +weights         + the parameters' key compared with the one the call's weights carry (as forward)
    bridge           the whole `forward(x, mask)`: + argument checks, mask kind, plan lookup
    bridge_no_mask   the same with mask=None
    bridge_reimport  `forward` with two input tensors in turn (a check that the bridge's cost does not
                     depend on meeting the same input again)

and each step alone: the weights check, the front of forward (validation once per signature, the mask's
kind, the plan lookup), the import (event included), the export of a kept result (nothing freed).
Then how long freeing an output takes: a
jax array and a DLPack-exported torch tensor, from an idle GPU and right after the call that made it (GPU
busy). Then the harness's CUDA event timing of the bridge (one input, and two in turn) next to the JAX
loop, and an ordering check of the import: x rewritten in place on torch's stream behind a long matmul,
the bridge called at once, its output compared with a call on a fresh copy (the same program: equal to
the bit). (The event test is short; the harness loop of `ttj-bench` is the one that caught an import
cache losing the order, see bridge/transfer.py's Transfer.)

The target: per shape, the bridge's host time per call (`bridge` above, drained) below 60% of its GPU time
per call. `gpu_ms` is the CUDA-event median of back-to-back bridge calls, as the harness times them
(`events_ms["bridge"]`), and `host_over_gpu` the ratio of the two; a host-bound call reads about 1 or more
(its events then span the host's issue time too). Both are None on the CPU.

    python -m bench.host_overhead [--shapes 11,13,8,5,2 | all] [--calls 150] [--tag T] [--out DIR] [--graph]

--shapes takes shape ids, comma-separated (official ones, or a general-suite config's, with its padding),
or "all" (the harness's shapes, 1-13). Where the plan passes the mask, the jax steps take it imported
once (the bridge imports it per call).
--graph (docs/decisions.md, "Bridge and host cost") adds `dispatch_graph`: the bridge's program for
the shape compiled with XLA command buffers that take custom calls too (GRAPH_OPTIONS: the whole program
one CUDA graph), called like `dispatch`, interleaved with it; its host time against `dispatch`'s is what
the graph saves per call, `events_ms["jax_loop_graph"]` its back-to-back time beside `jax_loop`'s, and
`graph_max_abs_diff` its output against the bridge program's (the same program: 0 expected).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import TransformerConfig, harness_models, make_inputs  # noqa: E402
from bench.cli import time_jax_loop, ttj_jax_contender  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402
from bench.timing import interleaved_host_overhead_us, time_contenders  # noqa: E402
from bridge import runtime, settings  # noqa: E402
from bridge.transfer import transfer_for  # noqa: E402
from ttj_jax.model import validate_inputs  # noqa: E402
from ttj_jax.shapes import HARNESS_IDS  # noqa: E402

CUMULATIVE = ("jax_direct", "dispatch", "+import", "+export", "+weights", "bridge", "bridge_no_mask",
              "bridge_reimport")
# --graph: XLA command buffers over every kind of op, custom calls (our Pallas kernels) included, from one
# op on.
GRAPH_OPTIONS = (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"),
                 ("xla_gpu_graph_min_graph_size", 1))
# The owner's target: the bridge's host time per call below this fraction of its GPU time per call.
HOST_OVER_GPU_TARGET = 0.6


def parse_shapes(text: str) -> list[str]:
    """Shape ids from "11,13,8" (official ids, or any suite's: "enc-tiny-s32"; any order, no repeats) or
    "all" (the harness's shapes)."""
    if text.strip() == "all":
        return list(HARNESS_IDS)
    ids = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in ids if shape_by_id(s) is None]
    if unknown or not ids:
        raise argparse.ArgumentTypeError(f"unknown shape ids {unknown}; known: {list(T.OFFICIAL)}, "
                                         f"{list(T.SUITES['general'])} or 'all'")
    return list(dict.fromkeys(ids))


def shape_by_id(sid: str):
    """The shape with id `sid` in whichever suite has it (their ids do not overlap), else None."""
    return next((suite[sid] for suite in T.SUITES.values() if sid in suite), None)


def ordering_check(ours, x, mask, rounds: int, device: torch.device) -> dict:
    """Max |difference| between the bridge's output on x rewritten in place just before the call (the
    write still queued behind ~1 ms of torch work) and on a fresh copy of the new values."""
    if device.type != "cuda":
        return {"rounds": 0}
    busy = torch.randn(4096, 4096, device=device)
    generator = torch.Generator(device=device).manual_seed(7)
    worst = 0.0
    for _ in range(rounds):
        values = torch.randn(x.shape, generator=generator, device=device)
        torch.cuda.synchronize(device)
        for _ in range(4):
            busy = (busy @ busy).mul_(1e-2)              # keeps torch's stream busy
        x.copy_(values)                                  # queued behind it; bumps x's version
        out = ours(x, mask)
        expected = ours(values.clone(), mask)
        worst = max(worst, float((out - expected).abs().max()))
    return {"rounds": rounds, "max_abs_diff": worst}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_us(make, calls: int, *, busy: bool, device: torch.device) -> float:
    """Median host time of dropping the last reference to make()'s result: after a sync (idle GPU) or
    right after the call (busy: the GPU still runs the call that writes it)."""
    samples = []
    for _ in range(calls):
        _sync(device)
        out = make()
        if not busy:
            _sync(device)
        start = time.perf_counter()
        del out
        samples.append((time.perf_counter() - start) * 1e6)
    _sync(device)
    return statistics.median(samples)


def warm_bridge(sid: str, device: torch.device):
    """Shape `sid` as the harness builds it, through the bridge, its first call made (under
    inference_mode) and finished: (config, module, x, mask, the module's bridge state, its one call)."""
    shape = shape_by_id(sid)
    config = shape.config
    hc = TransformerConfig(**vars(config))
    _, ours = harness_models(hc, bridge.TTJTransformer, device=device)
    x, mask = make_inputs(hc, 1234 + 100000, device=device, padding_ratio=shape.padding)
    with torch.inference_mode():
        ours(x, mask)
        _sync(device)
    state = runtime.module_state(ours)
    return config, ours, x, mask, state, next(iter(state.calls.values()))


def profile_shape(sid: str, calls: int, device: torch.device, graph: bool = False) -> dict:
    config, ours, x, mask, state, call = warm_bridge(sid, device)
    with torch.inference_mode():
        transfer = call.transfer
        weights = state.call_weights(call)
        transfer.order_before_jax()
        jx = transfer.to_jax(x)
        jm = transfer.to_jax(mask) if call.passes_mask else None
        kept = call.run(weights, jx, jm)
        jax.block_until_ready(kept)
        jax_fn, jax_plan = ttj_jax_contender(ours, config, x, mask)
        jax.block_until_ready(jax_fn())

        def imported():
            transfer.order_before_jax()
            return transfer.to_jax(x)

        def weights_check():   # as forward: the parameters' key against the one the call's weights carry
            return state.call_weights(call)

        def front():   # as forward: the signature's validation (once), the mask's kind, the plan lookup
            if (x.shape, x.dtype, (mask.shape, mask.dtype)) not in state.validated:
                validate_inputs(x.shape, "float32", mask.shape, "bool", state.config)
            return state.calls.get((x.shape, x.dtype, x.device, state.classify(mask), None, None))

        x_other = x.clone()
        flip = [x, x_other]

        def reimport():
            flip.reverse()
            return ours(flip[0], mask)

        variants = {
            "jax_direct": jax_fn,
            "dispatch": lambda: call.run(weights, jx, jm),
            "+import": lambda: call.run(weights, imported(), jm),
            "+export": lambda: transfer.to_torch(call.run(weights, imported(), jm)),
            "+weights": lambda: transfer.to_torch(call.run(weights_check(), imported(), jm)),
            "bridge": lambda: ours(x, mask),
            "bridge_no_mask": lambda: ours(x, None),
            "bridge_reimport": reimport,
            "alone_weights_check": weights_check,
            "alone_front": front,
            "alone_import": imported,
            "alone_export_kept": lambda: transfer.to_torch(kept),
        }
        if call.direct is not None:   # a direct launch never reaches the jax steps
            for name in ("dispatch", "+import", "+export", "+weights"):
                variants.pop(name)
        graph_run = None
        if graph and call.direct is None:
            graph_run = T.model.executable(call.plan, state.model_key, GRAPH_OPTIONS)
            graph_out = jax.block_until_ready(graph_run(weights, jx, jm))   # compiled before the samples
            # the same program under other launch options: its output must be the same
            graph_diff = float(jax.numpy.abs(graph_out - kept).max())
            variants["dispatch_graph"] = lambda: graph_run(weights, jx, jm)
        host = interleaved_host_overhead_us(variants, calls, device=device)
        frees = {}
        if call.direct is None:
            for busy in (False, True):
                when = "busy" if busy else "idle"
                frees[f"jax_array_{when}"] = free_us(lambda: call.run(weights, jx, jm), calls // 2,
                                                     busy=busy, device=device)
                frees[f"exported_tensor_{when}"] = free_us(
                    lambda: transfer.to_torch(call.run(weights, imported(), jm)), calls // 2, busy=busy,
                    device=device)
        frees["bridge_output_idle"] = free_us(lambda: ours(x, mask), calls // 2, busy=False, device=device)
        frees["bridge_output_busy"] = free_us(lambda: ours(x, mask), calls // 2, busy=True, device=device)
        events = {}
        if device.type == "cuda":
            timed = time_contenders({"bridge": lambda: ours(x, mask), "bridge_reimport": reimport},
                                    warmup=20, rounds=3, calls=100, device=device)
            events = {name: t["median_ms"] for name, t in timed.items()}
            events["jax_loop"] = time_jax_loop(jax_fn, warmup=20, rounds=3, calls=100)["median_ms"]
            if graph_run is not None:
                events["jax_loop_graph"] = time_jax_loop(lambda: graph_run(weights, jx, jm), warmup=20,
                                                          rounds=3, calls=100)["median_ms"]
        ordering = ordering_check(ours, x, mask, 10, device)
    gpu_ms = events.get("bridge")   # back-to-back calls under the harness's events; None on the CPU
    host_ms = host["bridge"]["median_us"] / 1e3
    return {"plan": call.plan.explain(), "direct_launch": call.direct is not None,
            "jax_plan_stack": jax_plan.stack, "host_us": host, "free_us": frees, "events_ms": events,
            "ordering": ordering, **({"graph_max_abs_diff": graph_diff} if graph_run is not None else {}),
            "bridge_minus_jax_us": host["bridge"]["median_us"] - host["jax_direct"]["median_us"],
            "host_ms": host_ms, "gpu_ms": gpu_ms,
            "host_over_gpu": host_ms / gpu_ms if gpu_ms else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shapes, default="11,13,8,5,2",
                   help='shape ids, comma-separated (official or general), or "all" (shapes 1-13)')
    p.add_argument("--calls", type=int, default=150, help="samples per variant (default 150)")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default=default_out_dir())
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke test of the script)")
    p.add_argument("--graph", action="store_true",
                   help="also the program as one CUDA graph (dispatch_graph; on the CPU XLA ignores the options)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench.host_overhead measures on a CUDA GPU; none is visible (--device cpu runs a smoke test)")
    result = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "jax": jax.__version__, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(),
              "command": "python -m bench.host_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
              "calls": args.calls, settings.KEEP_X_IMPORT_ENV: settings.keep_x_import(),
              "host_over_gpu_target": HOST_OVER_GPU_TARGET, "shapes": {}}
    for sid in args.shapes:
        print(f"shape {sid} ...", flush=True)
        result["shapes"][sid] = profile_shape(sid, args.calls, device, graph=args.graph)
        # whether this shape's bridge calls kept x's import (bridge/transfer.py, Transfer.to_jax_kept)
        result["shapes"][sid]["compute_stream_ordered"] = transfer_for(device).compute_stream is not None
    path = str(write_json(result, args.out, f"host-overhead-{result['date']}-{slug(result['gpu'])}"
                                            f"{'-' + args.tag if args.tag else ''}"))
    names = [n for n in CUMULATIVE] + ["alone_weights_check", "alone_front", "alone_import", "alone_export_kept"]
    if args.graph:
        names.insert(2, "dispatch_graph")
    print("drained host us (median), interleaved; " + path)
    print("shape " + " ".join(f"{n[:14]:>14}" for n in names) + "   bridge-jax")
    for sid, r in result["shapes"].items():
        cells = [f"{r['host_us'][n]['median_us']:14.1f}" if n in r["host_us"] else f"{'-':>14}" for n in names]
        print(f"{sid:>5} " + " ".join(cells) + f"   {r['bridge_minus_jax_us']:+.1f}")
        print("      free us: " + ", ".join(f"{k} {v:.1f}" for k, v in r["free_us"].items()))
        print("      events ms: " + ", ".join(f"{k} {v:.4f}" for k, v in r["events_ms"].items())
              + f"; ordering check: {r['ordering']}")
    print(f"\nbridge host time against GPU time per call (target: host_over_gpu < {HOST_OVER_GPU_TARGET})")
    print(f"{'shape':>5} {'host_ms':>9} {'gpu_ms':>9} {'host_over_gpu':>14}")
    for sid, r in result["shapes"].items():
        gpu = f"{r['gpu_ms']:9.4f}" if r["gpu_ms"] is not None else f"{'-':>9}"
        ratio = r["host_over_gpu"]
        verdict = "" if ratio is None else ("  ok" if ratio < HOST_OVER_GPU_TARGET else "  above target")
        print(f"{sid:>5} {r['host_ms']:9.4f} {gpu} {('-' if ratio is None else f'{ratio:.3f}'):>14}{verdict}")


if __name__ == "__main__":
    main()
