"""What a branch decided on the device costs inside one jitted program, on this machine.

Several designs decide per call from the inputs' contents (is every token of the mask valid? is the
input small enough for the fp16 GEMMs to fail the harness rule?). Reading the contents on the host costs
a host sync; deciding on the device puts a `lax.cond` into the program. This tool times, for one
program of `--layers` GEMM+tanh layers on an [n, n] input:

  plain    the program alone
  cond     lax.cond(all(mask), program, program') : a device predicate picks one of two programs
  both     both programs computed and one selected (what a branch-free design would pay)
  host     the host reads all(mask) first (bool(...)), then dispatches the program

each as stream time per call (calls queued back to back, one wait at the end) and as host time per
call (the dispatch alone). A branch that makes the host wait for the device shows as host time close
to the stream time. XLA_FLAGS set before starting (command buffers, for one) apply as usual.

    PYTHONPATH=. python3 -m bench.device_branch [--size 1024] [--layers 8] [--calls 200] [--out DIR]

Writes device-branch-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bench.paths import result_file, run_header


def build(layers: int):
    def stack(x, w, sign):
        for _ in range(layers):
            x = jnp.tanh(x @ w) * sign
        return x

    plain = jax.jit(lambda x, w, m: stack(x, w, 1.0))
    cond = jax.jit(lambda x, w, m: jax.lax.cond(jnp.all(m), lambda a: stack(a, w, 1.0),
                                                lambda a: stack(a, w, -1.0), x))
    both = jax.jit(lambda x, w, m: jnp.where(jnp.all(m), stack(x, w, 1.0), stack(x, w, -1.0)))
    return {"plain": plain, "cond": cond, "both": both}


def time_program(run, args, calls: int, repeats: int = 3) -> dict:
    """Median over repeats of (stream ms per call, host us per call)."""
    jax.block_until_ready(run(*args))
    stream, host = [], []
    for _ in range(repeats):
        jax.block_until_ready(run(*args))
        dispatch = []
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            t = time.perf_counter()
            out = run(*args)
            dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(out)
        stream.append((time.perf_counter() - start) / calls * 1e3)
        host.append(statistics.median(dispatch) * 1e6)
    return {"stream_ms": statistics.median(stream), "host_us": statistics.median(host)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (args.size, args.size), jnp.float32)
    w = jax.random.normal(keys[1], (args.size, args.size), jnp.float32) / args.size ** 0.5
    mask = jnp.ones((args.size,), bool)
    programs = build(args.layers)
    results = {name: time_program(run, (x, w, mask), args.calls) for name, run in programs.items()}

    def host_read(x, w, m):
        return programs["plain"](x, w, m) if bool(jnp.all(m)) else programs["both"](x, w, m)
    results["host"] = time_program(host_read, (x, w, mask), args.calls)
    document = {"device": device.device_kind, **run_header("python -m bench.device_branch " + " ".join(
        sys.argv[1:] if argv is None else argv)), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "size": args.size, "layers": args.layers, "calls": args.calls, "results": results}
    path = result_file("device-branch", device.device_kind, args.out)
    with open(path, "w") as f:
        json.dump(document, f, indent=1)
    for name, r in results.items():
        print(f"{name:6s} stream {r['stream_ms']:.4f} ms/call  host {r['host_us']:.1f} us/call")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
