"""Hardware counters for the Hopper attention kernel's builds, under Nsight Compute (session 18).

    ncu --clock-control none --profile-from-start off --set full -o OUT/attn \\
        python3 bench/scratch/ncu_attention.py CASE BUILD [BUILD ...] [--calls=N]

CASE is B,H,S,head_dim,causal (e.g. 1,1,100000,64,0); each BUILD (default, or MgpuBlockSizes
fields set on it: `persistent`, `num_compute_wgs=2+q_in_registers`) is compiled, then called twice (or N times,
back to back): a warm-up and the call to read (ncu profiles both; read the second of each pair).
With --calls=N and ncu's `--launch-skip N-1 --launch-count 1` and a one-pass metric list, the
profiled call is the last of N back-to-back calls: the clock and cycles of a kernel that runs at the
power cap, as in a timing loop. The kernels launch in the order
the builds are named, and only they run between cuProfilerStart and cuProfilerStop (the inputs' random
generation is left out of the report). Prints each build's block sizes, so the report's kernels can be told apart.

Why: the persistent build loses 4-5% per key block against the default with the same main-loop SASS,
clocks and power, and (session 18, persistent-why-...-l2.json) also when one head's K/V sit in L2;
the counters (stall reasons, issue activity, L2 and shared-memory traffic) say where.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
import sys

import jax
import jax.numpy as jnp

from bench.bench_attention_mgpu import _random_qkv

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")


def build_blocks(name: str, head_dim: int, seq_len: int):
    """"default", or MgpuBlockSizes fields set on it, `+`-joined: a bare name sets a bool field True,
    `name=N` an int field, or a bool one (0 or 1): e.g. num_compute_wgs=2+q_in_registers, kv_multicast=0
    (variant_power.py takes the same)."""
    default = fm.default_block_sizes(head_dim, seq_len)
    if name == "default":
        return default
    fields = {}
    for part in name.split("+"):
        field, _, value = part.partition("=")
        fields[field] = int(value) if value else True
        if isinstance(getattr(default, field), bool):
            fields[field] = bool(fields[field])
    return dataclasses.replace(default, **fields)


def profiler(start: bool) -> None:
    """cuProfilerStart/Stop on JAX's context (the device's primary context), made current if it is not."""
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        device = ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
        assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
        assert cuda.cuCtxSetCurrent(ctx) == 0
    result = cuda.cuProfilerStart() if start else cuda.cuProfilerStop()
    assert result == 0, f"cuProfiler{'Start' if start else 'Stop'} returned {result}"


def main(argv):
    calls = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--calls=")), 2)
    argv = [a for a in argv if not a.startswith("--calls=")]
    b, h, s, hd, causal = (int(x) for x in argv[0].split(","))
    q, k, v = jax.block_until_ready(_random_qkv(s, (b, s, h, hd), jnp.float16))
    builds = {}
    for name in argv[1:]:
        blocks = build_blocks(name, hd, s)
        fn = jax.jit(lambda q, k, v, bl=blocks: fm.flash_attention_mgpu(q, k, v, causal=bool(causal), block_sizes=bl))
        builds[name] = fn.lower(q, k, v).compile()
        print(f"{name}: {blocks}", flush=True)
    profiler(True)
    for compiled in builds.values():
        for _ in range(calls):
            out = compiled(q, k, v)
        jax.block_until_ready(out)
    profiler(False)


if __name__ == "__main__":
    main(sys.argv[1:])
