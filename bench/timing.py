"""The harness's timing protocol (docs/spec.md, "Timing"), and a host-overhead probe.

The harness warms each contender up, then runs rounds of calls, alternating which contender goes first,
and times every call with a pair of CUDA events recorded on torch's current stream. The events see GPU
time only, but host time inside a call still counts wherever it leaves the GPU idle, which on small
shapes is most of it. On the CPU, `time.perf_counter` stands in for the events.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# progress(rounds_done, rounds): called after each round (the CLI drives a progress bar with it).
ProgressCallback = Callable[[int, int], None]


def _summary(samples_ms: list[float]) -> dict:
    return {
        "median_ms": float(np.median(samples_ms)),
        "p10_ms": float(np.percentile(samples_ms, 10)),
        "p90_ms": float(np.percentile(samples_ms, 90)),
        "calls": len(samples_ms),
    }


def _round_cuda(fn: Callable[[], Any], calls: int, device: torch.device) -> list:
    stream = torch.cuda.current_stream(device)
    # Created before the loop so that creating them never lands between a start and an end record.
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)]
    for start, end in events:
        start.record(stream)
        fn()
        end.record(stream)
    return events


def _round_cpu(fn: Callable[[], Any], calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def time_contenders(contenders: dict[str, Callable[[], Any]], *, warmup: int = 20, rounds: int = 3,
                    calls: int = 100, device, progress: ProgressCallback | None = None,
                    keep_samples: bool = False) -> dict[str, dict]:
    """Times zero-argument callables (closures over one fixed input) the way the harness does.

    Each contender gets `warmup` untimed calls, then `rounds` rounds of `calls` timed calls each;
    the contender order is reversed every other round. Returns, per contender,
    {"median_ms", "p10_ms", "p90_ms", "calls"} over all timed calls (and "samples_ms", every call's
    time in the order taken, with keep_samples).
    """
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    if on_cuda:
        torch.cuda.synchronize(device)

    samples_ms: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        order = names if round_index % 2 == 0 else names[::-1]
        if on_cuda:
            pending = [(name, _round_cuda(contenders[name], calls, device)) for name in order]
            torch.cuda.synchronize(device)
            for name, events in pending:
                samples_ms[name].extend(start.elapsed_time(end) for start, end in events)
        else:
            for name in order:
                samples_ms[name].extend(_round_cpu(contenders[name], calls))
        if progress is not None:
            progress(round_index + 1, rounds)
    return {name: dict(_summary(samples_ms[name]), **({"samples_ms": samples_ms[name]} if keep_samples else {}))
            for name in names}


def loop_host_us(fn: Callable[[], Any], *, calls: int = 20, rounds: int = 15, device=None,
                 warmup: int = 5) -> dict:
    """The host's pace in the harness's own loop: from an idle GPU, `calls` calls back to back, each
    between the harness's two event records, no sync inside; perf_counter over the loop / calls. This is
    the interval at which the host hands the GPU work: below the GPU's time per call, the GPU never
    waits for the host (the events then measure the GPU alone). A loop is kept short enough that the
    launch queue never fills (a full queue would hold the host back to the GPU's pace). Unlike the
    drained single-call time (interleaved_host_overhead_us), it leaves out what the first launch after
    an idle period costs once per loop, not per call. Returns {"median_us", "p10_us", "p90_us"} over
    the rounds."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(rounds):
        if on_cuda:
            stream = torch.cuda.current_stream(device)
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(calls)]
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for begin, end in events:
                begin.record(stream)
                fn()
                end.record(stream)
            per_call.append((time.perf_counter() - start) * 1e6 / calls)
            torch.cuda.synchronize(device)
        else:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - start) * 1e6 / calls)
    return {"median_us": statistics.median(per_call), "p10_us": float(np.percentile(per_call, 10)),
            "p90_us": float(np.percentile(per_call, 90))}


def interleaved_host_overhead_us(contenders: dict[str, Callable[[], Any]], calls: int, *, device=None,
                                 warmup: int = 5) -> dict[str, dict]:
    """Median host time, in microseconds, of issuing one call of each contender: `perf_counter` around
    the call, no sync inside it. On a CUDA device the GPU is drained before each call (outside the timed
    span), so a full launch queue never makes the host wait and the number is the issue cost alone.

    The contenders' samples are interleaved: sample i of every contender is taken before sample i + 1 of
    any, so a drift of the host's pace during the run
    (another process, clocks, the allocator's state) lands on all of them alike and their difference is
    the difference of their calls. The order within each turn is a fresh (seeded) shuffle: a fixed cyclic
    order gives every contender the same predecessor, and a predecessor's after-effects then land on one
    contender only (on the H200, shape 7's bridge call, a direct kernel launch, took 80.7 us in the slot
    after the JAX-direct call and 57.8 us, the same code path, in another slot).
    Returns {name: {"median_us", "p10_us", "p90_us"}}.
    """
    on_cuda = device is not None and torch.device(device).type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)
    names = list(contenders)
    for name in names:
        for _ in range(warmup):
            contenders[name]()
    samples_us: dict[str, list[float]] = {name: [] for name in names}
    shuffler = random.Random(0)
    for _ in range(calls):
        order = names[:]
        shuffler.shuffle(order)
        for name in order:
            sync()
            start = time.perf_counter()
            contenders[name]()
            samples_us[name].append((time.perf_counter() - start) * 1e6)
    sync()
    return {name: {"median_us": statistics.median(s), "p10_us": float(np.percentile(s, 10)),
                   "p90_us": float(np.percentile(s, 90))} for name, s in samples_us.items()}


def host_us(fn: Callable[[], Any], calls: int = 300, warmup: int = 30, drained: bool = False) -> dict:
    """Host microseconds per call of fn (perf_counter, no sync inside the span). Back to back (default),
    a GPU-bound call's host time shows the GPU's pace once jax's queue is full; drained=True syncs the
    GPU before each sample, so each call is timed from an idle GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        if drained:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return {"median_us": statistics.median(samples), "p90_us": float(np.percentile(samples, 90)),
            "p10_us": float(np.percentile(samples, 10))}
