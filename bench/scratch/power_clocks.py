"""Is the attention kernel held back by the GPU's power limit? (session 17)

    PYTHONPATH=. python3 bench/scratch/power_clocks.py OUT_DIR [SECONDS] [--ramp] [--others]

At the head_dim-64 main case (B=1 H=16 S=100000, fp16), causal and not, the default build and the
persistent one (MgpuBlockSizes.persistent) each run back to back for SECONDS (default 4) while
`nvidia-smi` samples the SM clock, power draw, temperature and the active clock-event (throttle)
reasons every 50 ms; the rounds alternate the builds' order. Per build: TFLOP/s over the window, the
median SM clock and power of the samples taken while it ran, and which throttle reasons were active.

Why: the persistent build's loss is per key block and its main loop's code is the default's (session
17: persistent-why-...-tiles.json, persistent-sass-...tgz). If the GPU sits at its 700 W limit, a build
that keeps the SMs busier runs at a lower clock; and a power-bound default would mean the last percent
of issue 3 is energy per FLOP, not instruction count. Writes OUT_DIR/power-clocks-<date>-<gpu>.json.

--others adds cuDNN (jax.nn.dot_product_attention) and the default build on zero Q and K (the same
work on operands that toggle no bits: how much the data moves the clock under the power cap), causal.
--ramp adds: after 5 s idle, the default causal build for ~10 s as timings of 2 calls (~83 ms) each;
TFLOP/s and the SM clock per time bin since the start. How much of a short benchmark's number comes
from the clock the GPU has before its power limiter settles.
"""
from __future__ import annotations

import datetime
import importlib
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bench.bench_attention_mgpu import _random_qkv
from bench.gpu_power import PowerSampler
from bench.report import slug, write_json

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
B, H, S, HD = 1, 16, 100_000, 64
# a build's row where nvidia-smi gave no sample (PowerSampler.windows' keys)
NO_SAMPLES = dict(sm_clock_mhz=None, power_w=None, temperature_c=None, power_capped=None, reasons=[], samples=0)
RAMP_BINS = ((0.0, 0.25), (0.25, 0.5), (0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 10.0))


def measure_ramp(fn, args, seconds: float = 10.0):
    """After 5 s idle, 2-call timings for `seconds`: per RAMP_BINS bin (seconds since the start) the
    median TFLOP/s of the timings that ended in it and the median SM clock sampled in it."""
    timings = []
    with PowerSampler() as sampler:
        time.sleep(5.0)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            out = fn(*args)
            out = fn(*args)
            jax.block_until_ready(out)
            t1 = time.perf_counter()
            timings.append((t1 - start, 2 * fm.attention_flops(B, S, H, HD, True) / ((t1 - t0) * 1e12)))
        time.sleep(0.3)
    bins = []
    for lo, hi in RAMP_BINS:
        tf = [v for t, v in timings if lo <= t < hi]
        state = sampler.window(start + lo, start + hi) or {}
        bins.append(dict(seconds=[lo, hi], timings=len(tf), tflops=statistics.median(tf) if tf else None,
                         sm_clock_mhz=state.get("sm_clock_mhz"), power_w=state.get("power_w")))
    for b in bins:
        print(f"ramp {b['seconds'][0]:5.2f}-{b['seconds'][1]:5.2f} s: {b['tflops'] or 0:6.1f} TFLOP/s "
              f"{b['sm_clock_mhz'] or 0:6.0f} MHz {b['power_w'] or 0:6.1f} W ({b['timings']} timings)")
    return bins


def main(argv):
    flags = [a for a in argv if a.startswith("--")]
    argv = [a for a in argv if not a.startswith("--")]
    out_dir = pathlib.Path(argv[0])
    seconds = float(argv[1]) if len(argv) > 1 else 4.0
    builds, inputs = {}, {}   # (causal, name) -> compiled, its arguments
    cases = [(causal, name) for causal in (True, False) for name in ("default", "persistent")]
    if "--others" in flags:
        cases += [(True, "cudnn"), (True, "default, zero q k")]
    for causal, name in cases:
        qkv = _random_qkv(0, (B, S, H, HD), jnp.float16)
        if name.endswith("zero q k"):   # every score 0: the same work on operands that toggle no bits
            qkv = (jnp.zeros_like(qkv[0]), jnp.zeros_like(qkv[1]), qkv[2])
        if name == "cudnn":
            fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        else:
            blocks = fm.persistent_block_sizes(HD, S) if name == "persistent" else fm.default_block_sizes(HD, S)
            fn = jax.jit(lambda q, k, v, c=causal, bl=blocks: fm.flash_attention_mgpu(q, k, v, causal=c, block_sizes=bl))
        compiled = fn.lower(*qkv).compile()
        jax.block_until_ready(compiled(*qkv))
        builds[(causal, name)], inputs[(causal, name)] = compiled, qkv
    windows = []   # (key, start, end, calls)
    with PowerSampler() as sampler:
        time.sleep(1.0)
        for r in range(2):
            for key in (list(builds) if r % 2 == 0 else list(reversed(builds))):
                fn, args = builds[key], inputs[key]
                jax.block_until_ready(fn(*args))
                start, calls = time.perf_counter(), 0
                while time.perf_counter() - start < seconds:
                    for _ in range(4):
                        out = fn(*args)
                    calls += 4
                    jax.block_until_ready(out)
                windows.append((key, start, time.perf_counter(), calls))
                time.sleep(0.5)   # a gap between windows in the samples
    rows = []
    for key in builds:
        causal, name = key
        mine = [w for w in windows if w[0] == key]
        elapsed = sum(w[2] - w[1] for w in mine)
        calls = sum(w[3] for w in mine)
        # the samples inside its windows, each window's first 0.5 s skipped (clock settling)
        state = sampler.windows([(w[1] + 0.5, w[2]) for w in mine]) or NO_SAMPLES
        rows.append(dict(causal=causal, build=name, calls=calls, ms=elapsed / calls * 1e3,
                         tflops=fm.attention_flops(B, S, H, HD, causal) / (elapsed / calls * 1e12), **state))
    ramp = measure_ramp(builds[(True, "default")], inputs[(True, "default")]) if "--ramp" in flags else None
    device = jax.devices()[0]
    result = dict(ramp=ramp, gpu=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  command=f"PYTHONPATH=. python3 bench/scratch/power_clocks.py OUT {seconds:g}" + "".join(" " + f for f in flags),
                  rows=rows,
                  idle_samples=[s[1:] for s in sampler.samples[:5]])
    path = write_json(result, out_dir, f"power-clocks-{result['date']}-{slug(device.device_kind)}")
    print(f"{'case':8s} {'build':18s} {'TFLOP/s':>8s} {'MHz':>6s} {'W':>6s} {'C':>4s} samples reasons")
    for r in rows:
        print(f"{'causal' if r['causal'] else 'full':8s} {r['build']:18s} {r['tflops']:8.1f} {r['sm_clock_mhz'] or 0:6.0f} "
              f"{r['power_w'] or 0:6.1f} {r['temperature_c'] or 0:4.0f} {r['samples']:7d} {','.join(r['reasons'])}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
