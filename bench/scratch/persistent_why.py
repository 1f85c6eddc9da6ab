"""Why is the persistent kernel (MgpuBlockSizes.persistent) slower on long sequences? (session 16)

    PYTHONPATH=. python3 bench/scratch/persistent_why.py OUT_DIR [ROUNDS]

At B=1 H=16 S=100000 head_dim 64 the default and the persistent build, causal and non-causal, timed in
ROUNDS alternating rounds (median of 5 timings of back-to-back calls). Non-causal tiles all cost the
same, so the persistent kernel's static schedule is balanced there by construction (each of the 132
blocks runs 63 or 64 equal tiles): if it still loses there, the cost is per key block (its code), not
the schedule; if it loses only under causal, the static schedule is the suspect.
Writes OUT_DIR/persistent-why-<date>-<gpu>.json.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import json
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp

from bench.bench_attention_mgpu import _random_qkv
from bench.jax_timing import stream_ms_per_call
from bench.report import slug

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
B, H, S, HD = 1, 16, 100_000, 64


def main(argv):
    out_dir = pathlib.Path(argv[0])
    rounds = int(argv[1]) if len(argv) > 1 else 3
    default = fm.default_block_sizes(HD, S)
    builds = {}
    q, k, v = _random_qkv(S, (B, S, H, HD), jnp.float16)
    for causal in (True, False):
        for name, blocks in (("default", default), ("persistent", dataclasses.replace(default, persistent=True))):
            fn = jax.jit(lambda q, k, v, c=causal, b=blocks: fm.flash_attention_mgpu(q, k, v, causal=c, block_sizes=b))
            compiled = fn.lower(q, k, v).compile()
            jax.block_until_ready(compiled(q, k, v))
            builds[(causal, name)] = compiled
    samples = {key: [] for key in builds}
    for r in range(rounds):
        for key in (list(builds) if r % 2 == 0 else list(reversed(builds))):
            ms, _ = stream_ms_per_call(builds[key], (q, k, v), min_seconds=0.3, repeats=5)
            samples[key].append(ms)
    rows = []
    for (causal, name), ms in samples.items():
        median = statistics.median(ms)
        rows.append(dict(causal=causal, build=name, ms=median, ms_rounds=ms,
                         tflops=fm.attention_flops(B, S, H, HD, causal) / (median * 1e9)))
    device = jax.devices()[0]
    result = dict(gpu=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  command="PYTHONPATH=. python3 bench/scratch/persistent_why.py OUT " + str(rounds),
                  case=dict(B=B, H=H, S=S, head_dim=HD), rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"persistent-why-{result['date']}-{slug(device.device_kind)}.json"
    path.write_text(json.dumps(result, indent=1))
    for r in rows:
        print(f"{'causal' if r['causal'] else 'full':6s} {r['build']:10s} {r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s "
              f"rounds {['%.3f' % x for x in r['ms_rounds']]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
