"""Check and time MgpuBlockSizes variants against the default at the head_dim-64 main case, with the clock
and power each ran at (session 18).

    PYTHONPATH=. python3 bench/scratch/variant_power.py OUT_DIR [ROUNDS] VARIANT [VARIANT ...] [--causal-only]
        [--case=B,H,S,HEAD_DIM]

Each VARIANT gives one build: the default for head_dim 64 at S=100000 with MgpuBlockSizes fields set,
`+`-joined: a bare name sets a bool field True, `name=N` an int field or a bool one as 0/1 (e.g.
q_in_registers, num_compute_wgs=2, num_compute_wgs=2+q_in_registers, kv_multicast=0; parsed by
ncu_attention.build_blocks). Per build, causal and non-causal at B=1 H=16 S=100000: its output's
first 2048 rows against the fp32 reference (harness rule; --case: another case than the main one,
the default then being that case's), then ROUNDS alternating rounds of timings
(median of 5 timings of back-to-back calls, >= 0.3 s each), with nvidia-smi's clock and power over each
build's timings (bench/gpu_power.py), and (since session 18's first run) the energy per call from
NVML's energy counter over ~0.6 s of back-to-back calls after each timing. Writes
OUT_DIR/variant-power-<date>-<gpu>.json.

Why: the kernel runs at the H200's 700 W cap (docs/power.md; docs/results-log.md, "Attention kernels", sessions 17-18), so a variant
can win by spending less energy per FLOP at the same cycle count: compare TFLOP/s at the cap, and use
ncu (bench/scratch/ncu_attention.py) for the cycles.
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

from bench.bench_attention_mgpu import _random_qkv, _reference_rows
from bench.gpu_power import joules_per_call, nvml_energy_reader, sampling
from bench.jax_timing import stream_ms_per_call
from bench.report import slug, write_json
from bench.scratch.ncu_attention import build_blocks
from ttj_jax.numerics import harness_check

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
MAIN_B, MAIN_H, MAIN_S, MAIN_HD = 1, 16, 100_000, 64
CHECK_ROWS = 2048   # at B * H = 16; fewer at larger B * H (the fp32 reference holds B H rows S scores)


def main(argv):
    out_dir = pathlib.Path(argv[0])
    rounds = int(argv[1]) if len(argv) > 1 and argv[1].isdigit() else 3
    names = [a for a in argv[1:] if not a.isdigit() and not a.startswith("--")]
    cases = [a.removeprefix("--case=") for a in argv[1:] if a.startswith("--case=")]
    B, H, S, HD = (int(x) for x in cases[-1].split(",")) if cases else (MAIN_B, MAIN_H, MAIN_S, MAIN_HD)
    default = fm.default_block_sizes(HD, S)
    check_rows = max(128, CHECK_ROWS * 16 // (B * H))

    variants = {"default": default, **{n: build_blocks(n, HD, S) for n in names}}
    q, k, v = jax.block_until_ready(_random_qkv(S, (B, S, H, HD), jnp.float16))
    builds, checks = {}, []
    for causal in ((True,) if "--causal-only" in argv else (True, False)):
        ref = _reference_rows(q, k, v, jnp.arange(check_rows), causal=causal)
        for name, blocks in variants.items():
            fn = jax.jit(lambda q, k, v, c=causal, bl=blocks: fm.flash_attention_mgpu(q, k, v, causal=c, block_sizes=bl))
            compiled = fn.lower(q, k, v).compile()
            out = compiled(q, k, v)
            failed, worst, _ = harness_check(out[:, :check_rows].astype(jnp.float32), ref)
            checks.append(dict(build=name, causal=causal, rows=check_rows, failed=int(failed), worst_err_over_tol=float(worst)))
            print(f"check {name:16s} causal={causal}: failed {int(failed)}, worst err/tol {float(worst):.3f}", flush=True)
            builds[(causal, name)] = compiled
    samples = {key: [] for key in builds}
    spans = {key: [] for key in builds}
    energy = {key: [] for key in builds}
    read_energy = nvml_energy_reader()
    with sampling(True) as power:
        for r in range(rounds):
            for key in (list(builds) if r % 2 == 0 else list(reversed(builds))):
                start = time.perf_counter()
                ms, _ = stream_ms_per_call(builds[key], (q, k, v), min_seconds=0.3, repeats=5)
                samples[key].append(ms)
                spans[key].append((start, time.perf_counter()))
                joules = joules_per_call(builds[key], (q, k, v), max(5, round(600 / ms)), read_energy)
                if joules is not None:
                    energy[key].append(joules)
        states = {key: power.windows(spans[key]) if power else None for key in builds}
    rows = []
    for (causal, name), ms in samples.items():
        median = statistics.median(ms)
        rows.append(dict(B=B, H=H, S=S, head_dim=HD, causal=causal, build=name, ms=median, ms_rounds=ms,
                         tflops=fm.attention_flops(B, S, H, HD, causal) / (median * 1e9),
                         gpu_state=states[(causal, name)], energy=energy[(causal, name)],
                         joules_per_call=(statistics.median(e["joules_per_call"] for e in energy[(causal, name)])
                                          if energy[(causal, name)] else None)))
    device = jax.devices()[0]
    result = dict(gpu=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  command="PYTHONPATH=. python3 bench/scratch/variant_power.py OUT " + " ".join(argv[1:]),
                  checks=checks, rows=rows)
    suffix = f"-b{B}-h{H}-s{S}-hd{HD}" if cases else ""
    path = write_json(result, out_dir, f"variant-power-{result['date']}-{slug(device.device_kind)}{suffix}")
    for r in rows:
        st = r["gpu_state"] or {}
        print(f"{'causal' if r['causal'] else 'full':6s} {r['build']:16s} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s "
              f"{st.get('sm_clock_mhz')} MHz {st.get('power_w')} W {r['joules_per_call']} J/call "
              f"rounds {['%.3f' % x for x in r['ms_rounds']]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
