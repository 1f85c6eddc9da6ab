"""What one jitted call costs the host on this machine, by number of array arguments and of kernels.

A bridge call that runs a jax program pays jax's dispatch, and that grows with what the program takes
and launches. This tool separates the two, and checks one way to take fewer arguments:

  args N      a program taking N small arrays (all kept, one output): host us per call
  kernels K   a program of K dependent [n, n] GEMMs (K cuBLAS launches, one argument)
  stacked     L GEMMs on slices W[l] of one [L, n, n] argument, against L separate [n, n] arguments:
              host us, stream ms, and the copy kernels XLA made for the slices (from the compiled HLO)

Host us: the dispatch alone, the median of `--calls` calls; stream ms: calls queued back to back, one
wait at the end.

    PYTHONPATH=. python3 -m bench.dispatch_cost [--calls 300] [--size 256] [--out DIR]

Writes dispatch-cost-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

from bench.device_branch import time_program
from bench.paths import result_file, run_header

ARG_COUNTS = (1, 8, 16, 32, 64, 128)
KERNEL_COUNTS = (1, 8, 16, 32, 64)
STACKED_LAYERS = 8


def args_program():
    """One program for any number of array arguments (jax compiles it per count), all kept."""
    return jax.jit(lambda *arrays: arrays[0] + 1.0, keep_unused=True)


def kernels_program(k: int):
    def chain(x, w):
        for _ in range(k):
            x = x @ w
        return x
    return jax.jit(chain)


def separate_program(layers: int):
    def run(x, *ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x
    return jax.jit(run)


def stacked_program(layers: int):
    def run(x, w):
        for i in range(layers):
            x = jnp.tanh(x @ w[i])
        return x
    return jax.jit(run)


def copy_kernels(run, *args) -> int:
    """Kernels in the compiled program whose root is a copy or slice (what a slice of an argument costs)."""
    text = run.lower(*args).compile().as_text()
    return len(re.findall(r"(?m)^\s*ROOT \S+ = \S+ (?:copy|slice|dynamic-slice)\(", text))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    small = [jnp.full((16,), float(i), jnp.float32) for i in range(max(ARG_COUNTS))]
    by_args = {n: time_program(args_program(), small[:n], args.calls) for n in ARG_COUNTS}
    n = args.size
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float16)
    w = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) / n ** 0.5).astype(jnp.float16)
    by_kernels = {k: time_program(kernels_program(k), (x, w), args.calls) for k in KERNEL_COUNTS}
    ws = [(jax.random.normal(jax.random.key(2 + i), (n, n), jnp.float32) / n ** 0.5).astype(jnp.float16)
          for i in range(STACKED_LAYERS)]
    stacked_w = jnp.stack(ws)
    separate = separate_program(STACKED_LAYERS)
    stacked = stacked_program(STACKED_LAYERS)
    same = bool(jnp.array_equal(separate(x, *ws), stacked(x, stacked_w)))
    slices = {
        "separate": {**time_program(separate, (x, *ws), args.calls), "copy_kernels": copy_kernels(separate, x, *ws)},
        "stacked": {**time_program(stacked, (x, stacked_w), args.calls),
                    "copy_kernels": copy_kernels(stacked, x, stacked_w)},
        "same_output": same, "layers": STACKED_LAYERS,
    }
    document = {"device": device.device_kind, **run_header("python -m bench.dispatch_cost " + " ".join(
        sys.argv[1:] if argv is None else argv)), "xla_flags": os.environ.get("XLA_FLAGS", ""), "size": n,
        "calls": args.calls, "args": {str(k): v for k, v in by_args.items()},
        "kernels": {str(k): v for k, v in by_kernels.items()}, "stacked_slices": slices}
    path = result_file("dispatch-cost", device.device_kind, args.out)
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
    for k, r in by_args.items():
        print(f"args {k:4d}     host {r['host_us']:7.1f} us  stream {r['stream_ms'] * 1e3:7.1f} us")
    for k, r in by_kernels.items():
        print(f"kernels {k:4d}  host {r['host_us']:7.1f} us  stream {r['stream_ms'] * 1e3:7.1f} us")
    for name in ("separate", "stacked"):
        r = slices[name]
        print(f"{name:9s} host {r['host_us']:7.1f} us  stream {r['stream_ms'] * 1e3:7.1f} us  "
              f"copy kernels {r['copy_kernels']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
