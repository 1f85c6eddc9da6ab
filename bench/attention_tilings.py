"""The Hopper attention forward's tilings at head_dim 64 over a grid of (B, H, S, causal) shapes, in the three
forms the layers call: the training forward's (fused q/k/v, all-True key mask, with the log-sum-exp), the
bridge's inference forward's (fused, key-masked, as a harness call with its all-True mask tensor runs:
the mask decided on the device) and a JAX caller's mask-free one. Per shape: the generic kernel's training form (its
output and log-sum-exp are the reference), then each tiling of TILINGS in each form, checked against
the generic output (the harness's rule, numerics.harness_check: worst |err| / its tolerance) and log-sum-exp (max abs
difference), and timed as a stream of calls (bench.jax_timing.stream_ms_per_call). Which tiling wins
depends on the grid's wave count, not on S alone: this table is what a rule or a measured choice is fitted
to and checked against.

    PYTHONPATH=. python3 -m bench.attention_tilings [--budget-s 300] [--out DIR]

Shapes that would start after --budget-s are left out. sm_90 only. Writes <out>/attention-tilings-<date>-<gpu>.json
after every shape and prints one line per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

from bench.jax_timing import stream_ms_per_call
from bench.paths import result_file, run_header
from ttj_jax.kernels.flash_attention import flash_attention_fused_qkv, on_hopper
from ttj_jax.kernels.flash_attention_mgpu import MgpuBlockSizes, flash_attention_mgpu_fused_qkv
from ttj_jax.numerics import harness_check

TILINGS = {"default": None,
           "wg2 overlap": MgpuBlockSizes(128, 2, 2, overlap_softmax=True),
           "wg2": MgpuBlockSizes(128, 2, 2)}
SHAPES = [(1, 12, 1024, True), (1, 12, 2048, True), (1, 12, 4096, True), (1, 12, 8192, True),
          (1, 12, 16384, True), (4, 12, 4096, True), (8, 16, 2048, True), (1, 16, 32768, True),
          (32, 12, 512, False), (8, 12, 1024, False), (1, 12, 4096, False), (4, 12, 2048, False),
          (1, 16, 16384, False), (2, 16, 8192, True)]
HEAD_DIM = 64


def _timed(fn, *args):
    f = jax.jit(fn)
    out = jax.block_until_ready(f(*args))
    return stream_ms_per_call(f, args, min_seconds=0.08, repeats=3)[0] * 1e3, out


def measure_shape(batch: int, heads: int, seq_len: int, causal: bool) -> dict:
    qkv = jax.random.normal(jax.random.PRNGKey(seq_len + batch), (batch, seq_len, 3, heads, HEAD_DIM), jnp.float16)
    mask = jnp.ones((batch, seq_len), bool)
    record = {"B": batch, "H": heads, "S": seq_len, "causal": causal}
    record["generic_lse_mask_us"], (ref, ref_lse) = _timed(
        lambda x, m: flash_attention_fused_qkv(x, causal=causal, key_mask=m, implementation="generic",
                                               return_lse=True), qkv, mask)
    for name, blocks in TILINGS.items():
        for form in ("lse_mask", "mask", "plain"):
            key = f"{name}|{form}"
            try:
                if form == "lse_mask":
                    us, (out, lse) = _timed(lambda x, m, b=blocks: flash_attention_mgpu_fused_qkv(
                        x, causal=causal, key_mask=m, block_sizes=b, return_lse=True), qkv, mask)
                    record[f"{key}_lse_max_abs_diff"] = float(jnp.max(jnp.abs(lse - ref_lse)))
                elif form == "mask":
                    us, out = _timed(lambda x, m, b=blocks: flash_attention_mgpu_fused_qkv(
                        x, causal=causal, key_mask=m, block_sizes=b), qkv, mask)
                else:
                    us, out = _timed(lambda x, b=blocks: flash_attention_mgpu_fused_qkv(
                        x, causal=causal, block_sizes=b), qkv)
                record[f"{key}_us"] = round(us, 1)
                record[f"{key}_worst_err_over_tol"] = float(harness_check(out, ref)[1])
            except Exception as e:  # noqa: BLE001 - one tiling that does not build must not end the grid
                record[f"{key}_us"] = None
                record[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.attention_tilings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not on_hopper():
        print("bench.attention_tilings: the Hopper kernel needs an sm_90 GPU", file=sys.stderr)
        return 2
    gpu = jax.devices()[0].device_kind
    path = result_file("attention-tilings", gpu, args.out)
    document = {"device": gpu, **run_header("python3 -m bench.attention_tilings " + " ".join(
        sys.argv[1:] if argv is None else argv)), "head_dim": HEAD_DIM, "shapes": []}
    started = time.perf_counter()
    for batch, heads, seq_len, causal in SHAPES:
        if time.perf_counter() - started > args.budget_s:
            break
        record = measure_shape(batch, heads, seq_len, causal)
        document["shapes"].append(record)
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
        times = " ".join(f"{k.removesuffix('_us')}={v}" for k, v in record.items() if k.endswith("_us"))
        print(f"{batch}x{heads}x{seq_len}{' causal' if causal else ''}: {times}", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
