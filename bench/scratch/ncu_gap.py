"""Why does Nsight Compute time the attention kernel ~12% faster than a timing loop? (session 18)

    PYTHONPATH=. python3 bench/scratch/ncu_gap.py [CALLS] [--no-loop] [--gemm]

Under ncu (`--clock-control none`, one-pass metrics) the head_dim-64 main case (B=1 H=16 S=100000,
causal, default build) took 37.0-37.1 ms at 1.78 GHz (66.0 M SM cycles), also as the 40th and 102nd
of back-to-back calls; bench/scratch/persistent_why.py's timing loop (N calls, one block_until_ready)
took 41.9 ms at a reported 1.74-1.78 GHz in the same device session. This prints, for the same
compiled call: the loop's ms per call; then CALLS calls each closed by block_until_ready, each timed
by the wall clock (dispatch + kernel + sync). Run it plain, under CUDA_LAUNCH_BLOCKING=1, and under
`ncu --clock-control none --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second` (which
then also reports each kernel's GPU time): if the blocking calls take ~37 ms outside ncu too, the
loop's extra time is about back-to-back execution; if only under ncu, about ncu's environment.
--gemm times an fp16 8192^3 matmul (cuBLAS through XLA) instead: is the gap particular to this kernel?
Seen (bench/results/ncu-gap-2026-12-01-nvidia-h200.{json,log}): 41.6-42.8 ms plain, blocking or not,
CUDA_LAUNCH_BLOCKING or not; the same 66.0 M cycles under ncu at any clock; the GEMM alike. So plain runs
at the power cap get an effective ~1.55 GHz where nvidia-smi samples ~1.72 (docs/power.md).
"""
from __future__ import annotations

import importlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bench.bench_attention_mgpu import _random_qkv
from bench.jax_timing import stream_ms_per_call

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
B, H, S, HD = 1, 16, 100_000, 64


def main(argv):
    calls = int(argv[0]) if argv and argv[0].isdigit() else 10
    if "--gemm" in argv:
        n = 8192
        a, b = jax.block_until_ready(_random_qkv(n, (n, n), jnp.float16)[:2])
        args, flops = (a, b), 2.0 * n ** 3
        fn = jax.jit(lambda a, b: a @ b)
    else:
        args = jax.block_until_ready(_random_qkv(S, (B, S, H, HD), jnp.float16))
        fn = jax.jit(lambda q, k, v: fm.flash_attention_mgpu(q, k, v, causal=True))
        flops = fm.attention_flops(B, S, H, HD, True)
    compiled = fn.lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    walls = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        walls.append((time.perf_counter() - start) * 1e3)
    wall = statistics.median(walls)
    print(f"blocking calls: median {wall:.3f} ms ({flops / wall / 1e9:.1f} TFLOP/s), "
          f"all {['%.2f' % w for w in walls]}", flush=True)
    if "--no-loop" not in argv:
        ms, n = stream_ms_per_call(compiled, args, min_seconds=0.5, repeats=3)
        print(f"loop: {ms:.3f} ms per call over {n} calls ({flops / ms / 1e9:.1f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
