"""Where the Mosaic GPU stack kernel's time goes, phase by phase, on the GPU (issue 4: the ~88 us latency
of one 128-row tile that sets shapes 1-6, 9, 10 and 12).

    PYTHONPATH=. python3 bench/fused_stack_mgpu_profile.py [--shapes 2,1,9,12] [--out DIR]

Per official shape: the kernel built with Mosaic GPU's profiler (`fused_stack_mgpu.kernel_function(...,
profile_dir=...)`: every layer phase a named region per warpgroup, timestamps from the SM's global
timer), one compile-and-run call, one warm call whose trace is read. From the trace, per warpgroup role
(consumer 0, consumer 1, producer) and phase: the mean time per tile in us (inclusive: the waits for
weights inside a phase are also counted on their own as `wait_weights`) and the mean span of a tile.
Next to it the uninstrumented kernel's time per call (back-to-back calls, bench.jax_timing), so the
instrumentation's own cost shows. What this answers: is the tile's time in the matmuls, in LayerNorm /
softmax / GELU, or in waiting (weights from L2, the other consumer's k and v)?

Writes <out>/fused-stack-mgpu-profile-<date>-<gpu>.json (the summaries, not the raw traces) and prints a
table per shape last.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from bench.paths import default_out_dir  # noqa: E402

ROLES = ("consumer0", "consumer1", "producer")   # warpgroups of one CUDA block, in thread order


def summarize_trace(trace: dict, warpgroups_per_block: int = len(ROLES)) -> dict:
    """A Mosaic GPU profiler trace ({"traceEvents": [{"name", "ph": "B"|"E", "ts" (us), "tid"}, ...]},
    one tid per warpgroup of each block, tid = 1 + warpgroup + warpgroups_per_block * block) ->
    {"tiles": n, "span_us": mean span of a block (first event to last, over its warpgroups),
     "phases": {role: {name: mean inclusive us per tile}}, "calls": {role: {name: mean count per tile}}}.
    Nested regions each count in full (inclusive times). Raises ValueError on unbalanced events."""
    per_tid: dict[int, list] = collections.defaultdict(list)
    for event in trace.get("traceEvents", []):
        per_tid[int(event["tid"])].append(event)
    totals: dict[tuple[int, str], dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    counts: dict[tuple[int, str], dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    block_bounds: dict[int, list[float]] = {}
    for tid, events in per_tid.items():
        block, warpgroup = divmod(tid - 1, warpgroups_per_block)
        role = ROLES[warpgroup] if warpgroups_per_block == len(ROLES) else f"wg{warpgroup}"
        stack = []
        for event in sorted(events, key=lambda e: float(e["ts"])):
            if event["ph"] == "B":
                stack.append((event["name"], float(event["ts"])))
            elif event["ph"] == "E":
                if not stack or stack[-1][0] != event["name"]:
                    raise ValueError(f"unbalanced profiler events on tid {tid}: end of {event['name']!r} "
                                     f"with {[name for name, _ in stack]} open")
                name, start = stack.pop()
                totals[(block, role)][name] += float(event["ts"]) - start
                counts[(block, role)][name] += 1
        if stack:
            raise ValueError(f"unbalanced profiler events on tid {tid}: {[name for name, _ in stack]} never end")
        times = [float(e["ts"]) for e in events]
        low, high = block_bounds.get(block, (float("inf"), float("-inf")))
        block_bounds[block] = [min(low, min(times)), max(high, max(times))]
    if not block_bounds:
        raise ValueError("the trace holds no events")
    tiles = len(block_bounds)
    phases: dict[str, dict[str, float]] = collections.defaultdict(dict)
    calls: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for role in sorted({role for _, role in totals}):
        names = sorted({name for (_, r), named in totals.items() if r == role for name in named})
        for name in names:
            phases[role][name] = sum(totals[(b, role)].get(name, 0.0) for b in block_bounds) / tiles
            calls[role][name] = sum(counts[(b, role)].get(name, 0) for b in block_bounds) / tiles
    return {"tiles": tiles, "span_us": statistics.fmean(high - low for low, high in block_bounds.values()),
            "phases": dict(phases), "calls": dict(calls)}


def profile_shape(sid: str, trace_dir: pathlib.Path) -> dict:
    import jax

    import ttj_jax as T
    from bench.jax_timing import stream_ms_per_call
    from ttj_jax.kernels import fused_stack_mgpu as fsm

    config = T.OFFICIAL[sid].config
    params = T.init_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (config.batch_size, config.seq_len, config.d_model), jax.numpy.float32)
    weights = jax.block_until_ready(fsm.stack_weights_mgpu(params, config.num_heads))
    shape_dir = trace_dir / f"shape{sid}"
    shape_dir.mkdir(parents=True, exist_ok=True)
    args = (config.batch_size, config.seq_len, config.num_heads, config.num_layers, config.causal)
    profiled = jax.jit(fsm.kernel_function(*args, profile_dir=str(shape_dir)))
    plain = jax.jit(fsm.kernel_function(*args))
    operands = (x, weights.mats, weights.vecs)
    y_profiled = jax.block_until_ready(profiled(*operands))   # compile and first run (a trace too)
    jax.block_until_ready(profiled(*operands))                # the warm run whose trace is read
    jax.effects_barrier()                                     # the trace is written by a host callback
    traces = sorted(shape_dir.glob("*-trace.json"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"no trace file written into {shape_dir}")
    summary = summarize_trace(json.loads(traces[-1].read_text()))
    y_plain = jax.block_until_ready(plain(*operands))
    summary["max_abs_diff_profiled_vs_plain"] = float(abs(y_profiled - y_plain).max())
    summary["plain_us_per_call"] = stream_ms_per_call(plain, operands, min_seconds=0.05, repeats=5)[0] * 1e3
    summary["profiled_us_per_call"] = stream_ms_per_call(profiled, operands, min_seconds=0.05, repeats=3)[0] * 1e3
    summary["shape"] = T.OFFICIAL[sid].describe()
    return summary


def print_summary(sid: str, summary: dict) -> None:
    print(f"shape {sid}: {summary['shape']}: {summary['tiles']} tiles, span {summary['span_us']:.1f} us per tile; "
          f"kernel {summary['plain_us_per_call']:.1f} us per call ({summary['profiled_us_per_call']:.1f} "
          f"instrumented), profiled-vs-plain max |diff| {summary['max_abs_diff_profiled_vs_plain']:.2g}")
    roles = list(summary["phases"])
    names = sorted({n for role in roles for n in summary["phases"][role]},
                   key=lambda n: -max(summary["phases"][r].get(n, 0.0) for r in roles))
    print(f"  {'phase':24s}" + "".join(f"{role:>12s}" for role in roles) + "   (us per tile)")
    for name in names:
        print(f"  {name:24s}" + "".join(f"{summary['phases'][r].get(name, 0.0):12.2f}" for r in roles))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="2,1,9,12", help="official shape ids the kernel supports")
    parser.add_argument("--out", default=default_out_dir())
    args = parser.parse_args(argv)
    import jax
    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"fused_stack_mgpu_profile needs a Hopper GPU (found {device.platform})")
        return 2
    gpu = getattr(device, "device_kind", device.platform)
    document = {"script": "bench/fused_stack_mgpu_profile.py", "gpu": gpu, "jax": jax.__version__,
                "date": datetime.date.today().isoformat(), "shapes": {}, "errors": {}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"fused-stack-mgpu-profile-{document['date']}-{gpu.replace(' ', '-').lower()}.json"
    with tempfile.TemporaryDirectory() as trace_dir:
        for sid in args.shapes.split(","):
            try:
                document["shapes"][sid] = profile_shape(sid, pathlib.Path(trace_dir))
            except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
                document["errors"][sid] = f"{type(exc).__name__}: {exc}"[:2000]
            path.write_text(json.dumps(document, indent=1))
    for sid, summary in document["shapes"].items():
        print_summary(sid, summary)
    for sid, error in document["errors"].items():
        print(f"shape {sid}: ERROR {error}")
    print(f"wrote {path}")
    return 1 if document["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
