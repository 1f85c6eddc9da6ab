"""The attention backward on the GPU: ttj's flash backward kernels (kernels/flash_attention_bwd.py, and the
Hopper kernel of kernels/flash_attention_mgpu_bwd.py: the `mgpu-s*` variants) against cuDNN's backward
through `jax.nn.dot_product_attention(..., implementation="cudnn")`, side by side.

    PYTHONPATH=. python3 -m bench.bench_attention_bwd [--cases 1x16x16384x64] [--variants all|default]
                                                      [--pad-ratio 0.3] [--out DIR]
    (the Hopper kernel: --variants default,mgpu-s2,mgpu-s2-overlap-dq2,...: MGPU_VARIANTS; sm_90 only)

For each case ([B, H, S, head_dim], causal, fp16 inputs) both forwards run once, then each backward alone
is timed: cuDNN's as the vjp function jax.vjp returns (a pytree, passed into a jitted call), ours as
`flash_attention_bwd` from our forward's o and log-sum-exp. Timing: the median over repeats of N
back-to-back calls (bench/jax_timing.py). TFLOP/s counts the backward's five matmuls, 2.5x the
forward's FLOPs, halved for causal attention. Every tile variant of ours is checked against cuDNN's
gradients (relative L2 per tensor <= 1e-2) and, on a small case, against the fp32 reference.
Writes attention-bwd-<date>-<gpu>.json (after every step, so a run cut short keeps what it measured) and
prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.jax_timing import stream_ms_per_call
from bench.paths import run_header
from ttj_jax.kernels.attention_common import attention_reference
from ttj_jax.kernels.flash_attention import flash_attention
from ttj_jax.kernels.flash_attention_bwd import DEFAULT_BLOCKS, BwdBlocks, flash_attention_bwd
from ttj_jax.kernels.flash_attention_mgpu_bwd import MgpuBwdConfig, flash_attention_mgpu_bwd

MAX_REL_L2 = 1e-2
VARIANTS = {
    "default": DEFAULT_BLOCKS,
    "64x64-s3": BwdBlocks(64, 64, 64, 64, 4, 3),
    "64x64-w4-s1": BwdBlocks(64, 64, 64, 64, 4, 1),
    "64x64-w8-s2": BwdBlocks(64, 64, 64, 64, 8, 2),
    "32x64-w4-s2": BwdBlocks(32, 64, 64, 32, 4, 2),
    "64x128-w4-s2": BwdBlocks(64, 128, 128, 64, 4, 2),
    "128x64-w4-s2": BwdBlocks(128, 64, 64, 128, 4, 2),
    "32x128-w4-s3": BwdBlocks(32, 128, 128, 32, 4, 3),
    "32x128-w4-s5": BwdBlocks(32, 128, 128, 32, 4, 5),
    "32x128-w8-s2": BwdBlocks(32, 128, 128, 32, 8, 2),
    "64x128-w8-s2": BwdBlocks(64, 128, 128, 64, 8, 2),
    "64x128-w8-s3": BwdBlocks(64, 128, 128, 64, 8, 3),
    "128x128-w8-s2": BwdBlocks(128, 128, 128, 128, 8, 2),
    # smaller tiles for head_dim 128 and 256, where a 64-key block's dk and dv accumulators alone take
    # 64 x hd x 2 fp32 values over 4 warps' registers
    "32x32-w4-s2": BwdBlocks(32, 32, 32, 32, 4, 2),
    "32x32-w8-s2": BwdBlocks(32, 32, 32, 32, 8, 2),
    "64x32-w8-s2": BwdBlocks(64, 32, 32, 64, 8, 2),
    "32x64-w8-s2": BwdBlocks(32, 64, 64, 32, 8, 2),
}
# The Hopper kernel (sm_90 only): its options (MgpuBwdConfig); not in "all".
MGPU_VARIANTS = {
    "mgpu-s2": MgpuBwdConfig(),
    "mgpu-s2-overlap": MgpuBwdConfig(overlap=True),
    "mgpu-s2-overlap-dq2": MgpuBwdConfig(overlap=True, dq_buffers=2),
    "mgpu-s3-overlap-dq2": MgpuBwdConfig(num_stages=3, overlap=True, dq_buffers=2),
    "mgpu-s3": MgpuBwdConfig(num_stages=3),
    "mgpu-q128": MgpuBwdConfig(block_q=128),
    "mgpu-q128-overlap": MgpuBwdConfig(block_q=128, overlap=True),
    "mgpu-s2-og": MgpuBwdConfig(overlap_grads=True),
    "mgpu-s2-r240": MgpuBwdConfig(registers=240),
    "mgpu-s2-og-r240": MgpuBwdConfig(overlap_grads=True, registers=240),
    "mgpu-q128-og": MgpuBwdConfig(block_q=128, overlap_grads=True),
    "mgpu-q128-r240": MgpuBwdConfig(block_q=128, registers=240),
    "mgpu-q128-og-r240": MgpuBwdConfig(block_q=128, overlap_grads=True, registers=240),
    "mgpu-s2-eager": MgpuBwdConfig(eager_ds=True),
    "mgpu-q128-eager": MgpuBwdConfig(block_q=128, eager_ds=True),
    "mgpu-q128-og-eager": MgpuBwdConfig(block_q=128, overlap_grads=True, eager_ds=True),
    "mgpu-q128-unsplit": MgpuBwdConfig(block_q=128, dq_split=False),
    "mgpu-q128-unsplit-dq2": MgpuBwdConfig(block_q=128, dq_split=False, dq_buffers=2),
}


def backward_fn(name: str, causal: bool, key_mask=None):
    """The backward of variant `name`: (q, k, v, o, lse, do) -> (dq, dk, dv), and its settings."""
    if name in MGPU_VARIANTS:
        config = MGPU_VARIANTS[name]
        return (lambda q, k, v, o, lse, do: flash_attention_mgpu_bwd(
            q, k, v, o, lse, do, causal=causal, key_mask=key_mask, config=config)), dataclasses.asdict(config)
    blocks = VARIANTS[name]
    return (lambda q, k, v, o, lse, do: flash_attention_bwd(q, k, v, o, lse, do, causal=causal, key_mask=key_mask,
                                                            blocks=blocks)), blocks._asdict()


def padding_mask(batch: int, seq_len: int, ratio: float):
    """Prefix masks over the harness's range of lengths, [round(S (1 - ratio)), S], spread evenly instead of
    drawn at random (bench/baseline.make_inputs): sequence b keeps its first S - round(ratio * S * b /
    max(B - 1, 1)) keys, the first sequence unpadded, the last padded by `ratio`. None for ratio 0."""
    if not ratio:
        return None
    keep = [seq_len - round(ratio * seq_len * b / max(batch - 1, 1)) for b in range(batch)]
    return jnp.arange(seq_len)[None, :] < jnp.asarray(keep)[:, None]


def backward_tflops(batch, heads, seq_len, head_dim, causal, ms):
    flops = 2.5 * 4 * batch * heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
    return flops / (ms * 1e-3) / 1e12


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(batch, heads, seq_len, head_dim, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    shape = (batch, seq_len, heads, head_dim)
    return [jax.random.normal(key, shape, jnp.float32).astype(jnp.float16) for key in keys]


@functools.cache
def _reference_case(causal: bool, pad_ratio: float):
    """The small case (B=2, H=4, S=1000, hd 64): inputs, key mask, our forward's o and lse, and the fp32
    reference's gradients (computed once per causal and padding, shared by every variant)."""
    q, k, v, do = _inputs(2, 4, 1000, 64, seed=1)
    key_mask = padding_mask(2, 1000, pad_ratio)
    o, lse = flash_attention(q, k, v, causal=causal, implementation="generic", return_lse=True, key_mask=key_mask)
    f = lambda a, b, c: attention_reference(a, b, c, causal=causal, key_mask=key_mask)   # noqa: E731
    _, pull = jax.vjp(f, *(t.astype(jnp.float32) for t in (q, k, v)))
    return (q, k, v, o, lse, do), key_mask, pull(do.astype(jnp.float32))


def reference_check(name: str, causal: bool, pad_ratio: float = 0.0) -> dict:
    """Our gradients against jax.vjp of the fp32 reference on the small case (_reference_case)."""
    inputs, key_mask, want = _reference_case(causal, pad_ratio)
    ours = jax.jit(backward_fn(name, causal, key_mask)[0])(*inputs)
    return {name: _rel(a, b) for name, a, b in zip(("dq", "dk", "dv"), ours, want)}


def run_case(case, causal: bool, variants: dict, min_seconds: float, repeats: int, pad_ratio: float = 0.0) -> dict:
    batch, heads, seq_len, head_dim = case
    q, k, v, do = _inputs(batch, heads, seq_len, head_dim)
    key_mask = padding_mask(batch, seq_len, pad_ratio)
    out: dict = {"case": {"batch": batch, "heads": heads, "seq_len": seq_len, "head_dim": head_dim,
                          "causal": causal, "dtype": "float16", "pad_ratio": pad_ratio}}

    def cudnn(a, b, c):
        if key_mask is None:
            return jax.nn.dot_product_attention(a, b, c, is_causal=causal, implementation="cudnn")
        return jax.nn.dot_product_attention(a, b, c, is_causal=causal, implementation="cudnn",
                                            key_value_seq_lengths=key_mask.sum(axis=1, dtype=jnp.int32))

    try:
        _, pull = jax.vjp(cudnn, q, k, v)
        run_pull = jax.jit(lambda pull, g: pull(g))
        want = jax.block_until_ready(run_pull(pull, do))
        ms, calls = stream_ms_per_call(run_pull, (pull, do), min_seconds=min_seconds, repeats=repeats)
        out["cudnn"] = {"ms": ms, "calls": calls, "tflops": backward_tflops(*case, causal, ms)}
    except Exception as exc:   # recorded, not fatal
        want = None
        out["cudnn"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    print(f"  cudnn: {out['cudnn']}", flush=True)

    o, lse = jax.block_until_ready(flash_attention(q, k, v, causal=causal, implementation="generic",
                                                   return_lse=True, key_mask=key_mask))
    out["ttj"] = {}
    for name in variants:
        backward, settings = backward_fn(name, causal, key_mask)
        entry: dict = {"blocks": settings}
        try:
            fn = jax.jit(backward)
            start = time.perf_counter()
            got = jax.block_until_ready(fn(q, k, v, o, lse, do))
            entry["compile_s"] = time.perf_counter() - start
            if want is not None:
                entry["rel_l2_vs_cudnn"] = {n: _rel(a, b) for n, a, b in zip(("dq", "dk", "dv"), got, want)}
            entry["finite"] = bool(all(np.isfinite(np.asarray(g, np.float32)).all() for g in got))
            ms, calls = stream_ms_per_call(fn, (q, k, v, o, lse, do), min_seconds=min_seconds, repeats=repeats)
            entry.update(ms=ms, calls=calls, tflops=backward_tflops(*case, causal, ms))
            if "ms" in out["cudnn"]:
                entry["speedup_vs_cudnn"] = out["cudnn"]["ms"] / ms
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:400]
        print(f"  ttj {name}: { {k: v for k, v in entry.items() if k != 'blocks'} }", flush=True)
        out["ttj"][name] = entry
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="1x16x16384x64", help="BxHxSxHD, comma-separated")
    p.add_argument("--variants", default="all", help="'all', or names of VARIANTS, comma-separated")
    p.add_argument("--non-causal", action="store_true", help="also time non-causal attention")
    p.add_argument("--pad-ratio", type=float, default=0.0,
                   help="prefix key masks over the harness's range of lengths, spread evenly (the first "
                        "sequence whole, the last padded by this ratio); cuDNN gets the same as "
                        "key_value_seq_lengths")
    p.add_argument("--min-seconds", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    known = {**VARIANTS, **MGPU_VARIANTS}
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {list(known)}")
    variants = {n: known[n] for n in names}
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    gpu = jax.devices()[0].device_kind
    record = {"gpu": gpu, **run_header("python -m bench.bench_attention_bwd " + " ".join(
                  argv if argv is not None else sys.argv[1:])),
              "reference_check": {}, "cases": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"attention-bwd-{record['date']}-{gpu.lower().replace(' ', '-')}.json")

    def save():   # after every step: a run cut short keeps what it measured
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    for case in cases:   # timings first: a run cut short keeps them (each checked against cuDNN)
        for causal in ((True, False) if args.non_causal else (True,)):
            print(f"case {case} causal={causal}", flush=True)
            record["cases"].append(run_case(case, causal, variants, args.min_seconds, args.repeats, args.pad_ratio))
            save()
    for name in variants:
        try:
            record["reference_check"][name] = {c: reference_check(name, c == "causal", args.pad_ratio)
                                               for c in ("causal", "non-causal")}
        except Exception as exc:   # recorded; counted as a failure below
            record["reference_check"][name] = {"error": {"error": float("inf")}}
            print(f"reference check {name} raised {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        print(f"reference check {name}: {record['reference_check'][name]}", flush=True)
        save()
    bad = 0
    print(f"\n{'case':<28} {'contender':<16} {'ms':>8} {'TFLOP/s':>8} {'x cuDNN':>8} {'worst relL2':>11}")
    for c in record["cases"]:
        label = "x".join(str(c["case"][k]) for k in ("batch", "heads", "seq_len", "head_dim"))
        label += " causal" if c["case"]["causal"] else ""
        cu = c["cudnn"]
        print(f"{label:<28} {'cudnn':<16} {cu.get('ms', float('nan')):>8.3f} {cu.get('tflops', float('nan')):>8.1f}")
        for name, e in c["ttj"].items():
            worst = max((e.get("rel_l2_vs_cudnn") or {"-": float("nan")}).values())
            ok = "error" not in e and e.get("finite") and not worst > MAX_REL_L2
            bad += not ok
            print(f"{'':<28} {name:<16} {e.get('ms', float('nan')):>8.3f} {e.get('tflops', float('nan')):>8.1f} "
                  f"{e.get('speedup_vs_cudnn', float('nan')):>8.2f} {worst:>11.2e}{'' if ok else '  FAIL'}")
    worst_ref = max((v for r in record["reference_check"].values() for c in r.values() for v in c.values()),
                    default=float("inf"))
    print(f"worst relative L2 against the fp32 reference (small case): {worst_ref:.2e}; wrote {path}")
    return 1 if bad or worst_ref > MAX_REL_L2 else 0


if __name__ == "__main__":
    sys.exit(main())
