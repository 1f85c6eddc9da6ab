"""Timing JAX callables as a JAX user's loop sees them, shared by the kernel benchmarks."""

from __future__ import annotations

import statistics
import time

import jax


def synced_calls_ms(fn, calls: int):
    """fn() once (compile and first run: its output and seconds), then `calls` warm calls, each closed by
    block_until_ready: (output, first-call seconds, [ms per warm call]). For calls long enough that one
    call's dispatch does not matter (seconds of GPU work)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    first_s = time.perf_counter() - start
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return out, first_s, samples


def stream_ms_per_call(fn, args, *, min_seconds: float, repeats: int) -> tuple[float, int]:
    """Median ms per call over `repeats` timings of N back-to-back calls closed by one block_until_ready;
    N grows until one timing lasts at least `min_seconds`, so dispatch pipelining is what is timed.
    Returns (ms per call, N). Warm up (compile) before calling this."""
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            break
        calls = max(calls * 2, int(calls * 1.2 * min_seconds / max(elapsed, 1e-6)) + 1)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        timings.append((time.perf_counter() - start) / calls)
    return statistics.median(timings) * 1e3, calls


def drained_dispatch_us(fn, args, *, calls: int) -> float:
    """Median host microseconds of fn(*args) returning (its dispatch: argument checks, the executable's
    launches, output arrays), the device drained before each call, so no queue back-pressure is timed.
    Warm up (compile) before calling this."""
    samples = []
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
        start = time.perf_counter()
        out = fn(*args)
        samples.append((time.perf_counter() - start) * 1e6)
        jax.block_until_ready(out)
    return statistics.median(samples)
