"""Where a batch split's time goes on several GPUs: a CUDA activity timeline of one warm call (issue 5:
shape 6 on two H200s ran 1.32x, not 1.8x, and chunking made it slower).

    PYTHONPATH=. python3 bench/split_timeline.py [--shape 6] [--chunks 1,2,4,8] [--out bench/results]

Per chunk count: the split call (`bridge.forward(..., data_parallel=n, split_chunks=C)`, x on GPU 0)
timed with CUDA events (bench.timing, median of 5 warm calls), then one more call under torch.profiler with CUDA
activities. CUPTI sees the whole process, so jax's kernels and copies are in the trace with torch's. From
it, per GPU: the span of its work, the time its kernels run (union of their intervals), the time copies
run, and how much of the copy time overlaps kernels on that GPU; plus the whole call's span. If the copies
overlap compute, the split costs about max(compute per GPU) + one chunk's copies; if not, compute plus all
copies. Writes <out>/split-timeline-<date>-<gpu>.json (summaries; the raw traces are not kept) and prints
a table.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

KERNEL_CATEGORIES = ("kernel",)
COPY_CATEGORIES = ("gpu_memcpy",)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where two unions of intervals overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_activity(trace: dict) -> dict:
    """A torch.profiler chrome trace -> per GPU {"span_ms", "kernel_ms", "copy_ms", "copy_overlapping_kernels_ms",
    "kernels", "copies", "streams"} and the whole trace's GPU "span_ms". GPU events are the complete ("X")
    events of category kernel / gpu_memcpy; their GPU is args.device (else the event's pid)."""
    per_device: dict[int, dict[str, list]] = collections.defaultdict(lambda: {"kernel": [], "copy": [], "streams": set()})
    for event in trace.get("traceEvents", []):
        category = event.get("cat")
        if event.get("ph") != "X" or category not in KERNEL_CATEGORIES + COPY_CATEGORIES:
            continue
        args = event.get("args", {})
        device = int(args.get("device", event.get("pid", 0)))
        start = float(event["ts"]) / 1e3   # us -> ms
        interval = (start, start + float(event.get("dur", 0.0)) / 1e3)
        bucket = per_device[device]
        bucket["kernel" if category in KERNEL_CATEGORIES else "copy"].append(interval)
        bucket["streams"].add(args.get("stream", event.get("tid")))
    if not per_device:
        raise ValueError("the trace holds no GPU kernel or copy events (was CUDA activity profiled?)")
    devices = {}
    every = []
    for device, bucket in sorted(per_device.items()):
        kernels, copies = _union(bucket["kernel"]), _union(bucket["copy"])
        both = _union(kernels + copies)
        every += both
        devices[str(device)] = {
            "span_ms": both[-1][1] - both[0][0], "kernel_ms": _length(kernels), "copy_ms": _length(copies),
            "copy_overlapping_kernels_ms": _intersection(kernels, copies),
            "kernels": len(bucket["kernel"]), "copies": len(bucket["copy"]), "streams": len(bucket["streams"])}
    every = _union(every)
    return {"span_ms": every[-1][1] - every[0][0], "devices": devices}


def run(shape_id: str, chunk_counts: list[int]) -> dict:
    import torch
    import bridge
    import jax
    import ttj_jax as T
    from bench.baseline import TransformerConfig, harness_models, make_inputs
    from bench.timing import time_contenders

    n = len(jax.devices())
    if n < 2:
        raise SystemExit(f"split_timeline needs several GPUs (jax sees {n})")
    config = T.OFFICIAL[shape_id].config
    _, model = harness_models(TransformerConfig(**vars(config)), bridge.TTJTransformer, device=torch.device("cuda"))
    x, mask = make_inputs(config, 4321, device="cuda")
    result = {"shape": T.OFFICIAL[shape_id].describe(), "devices": n, "chunks": {}}

    def timed(fn):   # the harness's protocol (CUDA events per call), fewer calls: these take milliseconds
        return time_contenders({"call": fn}, warmup=2, rounds=1, calls=5, device="cuda")["call"]["median_ms"]

    with torch.inference_mode():
        result["one_device_ms"] = timed(lambda: bridge.forward(model, x, mask, data_parallel=1))
        for chunks in chunk_counts:
            if x.shape[0] % (n * chunks):
                continue
            call = lambda c=chunks: bridge.forward(model, x, mask, data_parallel=n, split_chunks=c)   # noqa: E731
            record = {"ms": timed(call)}
            with tempfile.TemporaryDirectory() as folder:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=activities) as profiler:
                    call()
                    torch.cuda.synchronize()
                path = os.path.join(folder, "trace.json")
                profiler.export_chrome_trace(path)
                with open(path) as f:
                    record.update(summarize_activity(json.load(f)))
            result["chunks"][str(chunks)] = record
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="6")
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import torch
    import jax
    result = run(args.shape, [int(c) for c in args.chunks.split(",")])
    gpu = torch.cuda.get_device_name()
    result.update({"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__,
                   "date": datetime.date.today().isoformat(),
                   "command": "python bench/split_timeline.py " + " ".join(sys.argv[1:] if argv is None else argv)})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"split-timeline-{result['date']}-{gpu.split()[-1].lower()}x{result['devices']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{result['shape']}: one device {result['one_device_ms']:.2f} ms")
    print(f"{'chunks':>6} {'ms':>7} {'span':>7}  per GPU: span / kernels / copies / copies under kernels (ms)")
    for chunks, r in result["chunks"].items():
        per_gpu = "  ".join(f"gpu{d}: {v['span_ms']:.2f}/{v['kernel_ms']:.2f}/{v['copy_ms']:.2f}/"
                            f"{v['copy_overlapping_kernels_ms']:.2f}" for d, v in r["devices"].items())
        print(f"{chunks:>6} {r['ms']:7.2f} {r['span_ms']:7.2f}  {per_gpu}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
