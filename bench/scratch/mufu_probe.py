"""What bounds the head_dim-64 attention kernel at issue 3's main case? Timing probes (session 15).

    PYTHONPATH=. python3 bench/scratch/mufu_probe.py OUT_DIR [ROUNDS]

Builds, each timed at B=1 H=16 S=100000 hd=64 causal fp16 in ROUNDS alternating rounds (median of 5
timings of back-to-back calls each; TFLOP/s counted as bench_attention_mgpu does):
- default: the kernel as users get it;
- no_pingpong: `MgpuBlockSizes(pingpong=False)`, the consumers' GEMM phases not ordered by the token
  ring (checked against the reference before timing: a real variant);
- exp2_as_fmul (DIAGNOSTIC, wrong outputs): the default build with every `jnp.exp2` in the kernel's module
  replaced by one multiply, so the softmax issues the same number of instructions but none on the
  MUFU. If the MUFU's 16 exp2 per clock and SM (which at head_dim 64 match the tensor cores' 4096
  FLOP per clock) bound the kernel, this build is much faster; if it is about as fast, the bound is
  elsewhere (tensor cores, the GEMM/softmax hand-off).
- exp2_removed (DIAGNOSTIC, wrong outputs): exp2 replaced by the identity: no MUFU and 64 fewer
  instructions per thread and block.
The diagnostic builds patch the module's `jnp` while they are traced and compiled, then restore it.
Writes OUT_DIR/mufu-probe-<date>-<gpu>.json and prints a table.
"""
from __future__ import annotations

import datetime
import importlib
import json
import pathlib
import statistics
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_attention_mgpu import _reference_rows, _worst_ratio
from bench.jax_timing import stream_ms_per_call
from bench.report import slug

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
B, H, S, HD = 1, 16, 100_000, 64


def _patched_jnp(exp2):
    shim = types.ModuleType("jnp_probe")
    shim.__dict__.update({name: getattr(jnp, name) for name in dir(jnp) if not name.startswith("__")})
    shim.exp2 = exp2
    return shim


def compile_build(args, *, exp2=None, **kwargs):
    fn = lambda q, k, v: fm.flash_attention_mgpu(q, k, v, causal=True, **kwargs)  # noqa: E731
    original = fm.jnp
    try:
        if exp2 is not None:
            fm.jnp = _patched_jnp(exp2)
        fm.flash_attention_mgpu.clear_cache()
        return jax.jit(fn).lower(*args).compile()
    finally:
        fm.jnp = original
        fm.flash_attention_mgpu.clear_cache()


def check_rows(compiled, q, k, v, rows=64):
    """Worst |err| / tol over the first and last `rows` query rows, with bench_attention_mgpu's
    reference rows and rule."""
    picked = np.r_[0:rows, S - rows:S]
    ratio, _ = _worst_ratio(compiled(q, k, v)[:, picked], _reference_rows(q, k, v, picked, causal=True))
    return float(ratio)


def main(out_dir: str, rounds: str = "3") -> int:
    rounds = int(rounds)
    device = jax.devices()[0]
    keys = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(key, (B, S, H, HD), jnp.float32).astype(jnp.float16) for key in keys)
    builds = {
        "default": compile_build((q, k, v)),
        "no_pingpong": compile_build((q, k, v), block_sizes=fm.MgpuBlockSizes(128, 4, 3, pingpong=False)),
        "exp2_as_fmul": compile_build((q, k, v), exp2=lambda x: x * 0.9990234375),
        "exp2_removed": compile_build((q, k, v), exp2=lambda x: x),
    }
    checks = {}
    for name in ("default", "no_pingpong"):
        checks[name] = check_rows(builds[name], q, k, v)
        print(f"check {name}: worst err/tol {checks[name]:.3f}", flush=True)
    flops = fm.attention_flops(B, S, H, HD, causal=True)
    results = {name: [] for name in builds}
    for r in range(rounds):
        order = list(builds) if r % 2 == 0 else list(builds)[::-1]
        for name in order:
            jax.block_until_ready(builds[name](q, k, v))
            ms, calls = stream_ms_per_call(builds[name], (q, k, v), min_seconds=0.05, repeats=5)
            results[name].append(flops / (ms * 1e-3) / 1e12)
            print(f"round {r} {name:14s} {ms:8.3f} ms {results[name][-1]:7.1f} TFLOP/s", flush=True)
    summary = {name: statistics.median(values) for name, values in results.items()}
    payload = dict(gpu=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                   command=f"PYTHONPATH=. python3 bench/scratch/mufu_probe.py OUT {rounds}",
                   case=dict(B=B, H=H, S=S, head_dim=HD, causal=True, dtype="float16"),
                   checks_worst_err_over_tol=checks, tflops_rounds=results, tflops_median=summary,
                   note="exp2_as_fmul and exp2_removed are diagnostics with wrong outputs (module docstring)")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"mufu-probe-{payload['date']}-{slug(device.device_kind)}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\n{'build':16s} {'TFLOP/s median':>15s}  rounds")
    for name, value in summary.items():
        print(f"{name:16s} {value:15.1f}  {[round(x, 1) for x in results[name]]}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
