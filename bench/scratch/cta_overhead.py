"""How much does each CUDA block (one query tile) of the head_dim-64 attention kernel cost beyond its
KV-block iterations? Decides whether a persistent kernel (tiles looped inside long-lived blocks, the
K/V ring never drained between tiles) is worth building for issue 3 (session 16).

    PYTHONPATH=. python3 bench/scratch/cta_overhead.py OUT_DIR [ROUNDS]

Times the default kernel at B=1, H=16, head_dim 64, fp16, causal at S in {12500, 25000, 50000, 100000}
and non-causal at S in {25000, 50000, 100000}, in ROUNDS alternating rounds (median of 5 timings of
back-to-back calls). Each case has N blocks (query tiles x heads) and sum_blocks KV-block iterations
(per tile: the blocks its last consumer visits). Fits, by least squares over the cases,
    132 SMs x time = u x sum_blocks + c x N
u: us per KV block and tile (all consumers), c: us per tile beyond its blocks (launch, Q load, ring
fill, the unoverlapped first Q @ K^T and last P @ V, normalization, store). Also the same fit with the
GPU's list schedule simulated (heaviest tiles first, as the kernel orders them). A persistent kernel
could save at most about c x N / 132 per call, of which the share at the main case is printed. The
cleanest estimate is pair_fit: the causal and non-causal cases at one S solved exactly (same tiles).
`--refit FILE` recomputes it for a written file.
Writes OUT_DIR/cta-overhead-<date>-<gpu>.json.
"""
from __future__ import annotations

import datetime
import heapq
import importlib
import json
import math
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_attention_mgpu import _random_qkv
from bench.jax_timing import stream_ms_per_call
from bench.report import slug

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
B, H, HD = 1, 16, 64
CASES = [(12500, True), (25000, True), (50000, True), (100000, True), (25000, False), (50000, False),
         (100000, False)]


def tile_blocks(seq_len, causal, blocks):
    nt = math.ceil(seq_len / blocks.block_q)
    per_head = [fm.kv_block_range(t * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv, causal)[1]
                for t in reversed(range(nt))]   # heaviest first, the kernel's launch order
    return per_head * (B * H)


def list_schedule(sizes, sms, u, c):
    heap = [0.0] * sms
    for s in sizes:
        heapq.heappush(heap, heapq.heappop(heap) + s * u + c)
    return max(heap)


def pair_estimate(rows, sms):
    """u and c from the causal and non-causal cases at the same S (same tiles, twice the blocks): the two
    equations of the linear model solved exactly, without the shorter cases' wave tails. Also the tiles'
    share of the causal case's time, the most that a persistent kernel could recover there."""
    out = {}
    for seq_len in sorted({r["S"] for r in rows}):
        pair = {r["causal"]: r for r in rows if r["S"] == seq_len}
        if set(pair) != {True, False}:
            continue
        c_row, n_row = pair[True], pair[False]
        u = sms * (n_row["ms"] - c_row["ms"]) * 1e3 / (n_row["sum_blocks"] - c_row["sum_blocks"])
        tile_us = (sms * c_row["ms"] * 1e3 - u * c_row["sum_blocks"]) / c_row["tiles"]
        out[str(seq_len)] = dict(us_per_block=u, us_per_tile=tile_us,
                                 causal_tile_share=tile_us * c_row["tiles"] / (sms * c_row["ms"] * 1e3))
    return out


def main(argv):
    if argv and argv[0] == "--refit":   # recompute the pair estimate of a written file, in place
        path = pathlib.Path(argv[1])
        result = json.loads(path.read_text())
        result["pair_fit"] = pair_estimate(result["cases"], result["sms"])
        path.write_text(json.dumps(result, indent=1))
        print(json.dumps(result["pair_fit"], indent=1))
        return
    out_dir = pathlib.Path(argv[0])
    rounds = int(argv[1]) if len(argv) > 1 else 3
    device = jax.devices()[0]
    sms = getattr(device, "core_count", 132)
    blocks = fm.resolve_block_sizes(100000, HD, 2, None)
    builds = {}
    for seq_len, causal in CASES:
        q, k, v = _random_qkv(seq_len, (B, seq_len, H, HD), jnp.float16)
        fn = jax.jit(lambda q, k, v, causal=causal: fm.flash_attention_mgpu(q, k, v, causal=causal))
        compiled = fn.lower(q, k, v).compile()
        jax.block_until_ready(compiled(q, k, v))
        builds[(seq_len, causal)] = (compiled, (q, k, v))
    samples = {key: [] for key in builds}
    for r in range(rounds):
        for key in (list(builds) if r % 2 == 0 else list(reversed(builds))):
            compiled, args = builds[key]
            ms, _ = stream_ms_per_call(compiled, args, min_seconds=0.3, repeats=5)
            samples[key].append(ms)
    rows = []
    for (seq_len, causal), ms in samples.items():
        sizes = tile_blocks(seq_len, causal, blocks)
        rows.append(dict(S=seq_len, causal=causal, ms=statistics.median(ms), ms_rounds=ms, tiles=len(sizes),
                         sum_blocks=int(sum(sizes)),
                         tflops=fm.attention_flops(B, seq_len, H, HD, causal) / (statistics.median(ms) * 1e9)))
    a = np.array([[r["sum_blocks"], r["tiles"]] for r in rows], float)
    t = np.array([r["ms"] * 1e3 * sms for r in rows])
    (u, c), *_ = np.linalg.lstsq(a, t, rcond=None)
    # the same with the list schedule: makespan(u, c) = u x makespan(1, c / u), so for each ratio c / u
    # the best u is a one-variable least squares (relative errors)
    measured = np.array([r["ms"] * 1e3 for r in rows])
    sched = []
    for ratio in np.linspace(0.0, 8.0, 33):
        unit = np.array([list_schedule(tile_blocks(r["S"], r["causal"], blocks), sms, 1.0, ratio) for r in rows])
        x = unit / measured
        u_try = float(np.sum(x) / np.sum(x * x))   # minimizes sum (u unit / measured - 1)^2
        err = float(np.sqrt(np.mean((u_try * x - 1) ** 2)))
        sched.append((err, u_try, float(ratio * u_try)))
    sched.sort()
    err_s, u_s, c_s = sched[0]
    main_row = next(r for r in rows if r["S"] == 100000 and r["causal"])
    share = c * main_row["tiles"] / sms / (main_row["ms"] * 1e3)
    share_s = c_s * main_row["tiles"] / sms / (main_row["ms"] * 1e3)
    result = dict(gpu=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  command="PYTHONPATH=. python3 bench/scratch/cta_overhead.py OUT " + str(rounds),
                  blocks=str(blocks), sms=sms, cases=rows,
                  linear_fit=dict(us_per_block=float(u), us_per_tile=float(c), main_case_tile_share=float(share)),
                  schedule_fit=dict(us_per_block=u_s, us_per_tile=c_s, rms_rel_err=err_s,
                                    main_case_tile_share=float(share_s)),
                  pair_fit=pair_estimate(rows, sms))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"cta-overhead-{result['date']}-{slug(device.device_kind)}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{'S':>7} {'causal':>6} {'ms':>9} {'TFLOP/s':>8} {'tiles':>6} {'blocks':>9}")
    for r in rows:
        print(f"{r['S']:7d} {str(r['causal']):>6} {r['ms']:9.3f} {r['tflops']:8.1f} {r['tiles']:6d} {r['sum_blocks']:9d}")
    print(f"linear fit: {u:.4f} us per KV block, {c:.2f} us per tile: tiles' share of the main case {share:.2%}")
    print(f"list-schedule fit: {u_s:.4f} us per block, {c_s:.2f} us per tile (rms rel err {err_s:.4f}): share {share_s:.2%}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
