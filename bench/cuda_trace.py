"""Reading CUDA activity traces recorded with torch.profiler, shared by the bench scripts that ask where GPU
time goes. CUPTI sees the whole process, so jax's kernels and copies are in the trace with torch's.

- `profile_cuda(fn, calls)`: run `fn` `calls` times under torch.profiler (CUDA activities), return the
  chrome trace as a dict.
- `summarize_activity(trace)`: per GPU, busy time of kernels and copies and their overlap (split_timeline).
- `kernel_table(trace, calls)`: per kernel name, GPU time per call, largest first (ablate --kernels).
"""

from __future__ import annotations

import collections
import json
import os
import tempfile

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


def profile_cuda(fn, calls: int = 1) -> dict:
    """`fn()` `calls` times under torch.profiler with CUDA activities (the GPU drained before and after);
    the chrome trace as a dict."""
    import torch
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def kernel_table(trace: dict, calls: int = 1, top: int = 20) -> dict:
    """Per kernel name: GPU time per call (us) and launches per call, largest first (`top` rows; the rest
    summed as "(other)"), plus the total kernel time per call and the GPU span per call (first start to
    last end over all kernels and copies, divided by `calls`). Names are cut to 120 characters."""
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    intervals = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in KERNEL_CATEGORIES + COPY_CATEGORIES:
            continue
        start, duration = float(event["ts"]), float(event.get("dur", 0.0))
        intervals.append((start, start + duration))
        if event.get("cat") in KERNEL_CATEGORIES:
            row = per_name[str(event.get("name", "?"))[:120]]
            row[0] += duration
            row[1] += 1
    if not intervals:
        raise ValueError("the trace holds no GPU kernel or copy events (was CUDA activity profiled?)")
    rows = sorted(per_name.items(), key=lambda item: -item[1][0])
    table = [{"kernel": name, "us_per_call": total / calls, "launches_per_call": count / calls}
             for name, (total, count) in rows[:top]]
    rest = rows[top:]
    if rest:
        table.append({"kernel": "(other)", "us_per_call": sum(r[1][0] for r in rest) / calls,
                      "launches_per_call": sum(r[1][1] for r in rest) / calls})
    span = max(b for _, b in intervals) - min(a for a, _ in intervals)
    return {"kernels": table, "kernel_us_per_call": sum(r[1][0] for r in rows) / calls,
            "span_us_per_call": span / calls}
