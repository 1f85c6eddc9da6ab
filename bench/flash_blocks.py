"""Block sizes of our generic (Triton-lowered) flash-attention kernel, swept per attention call.

    python -m bench.flash_blocks [--cases B,H,S,HD,causal|full,mask|none ...] [--variants bq,bk,w,s ...]
                                 [--min-seconds 0.1] [--out DIR] [--smoke]

Each case is one fused-qkv attention call ([B, S, 3, H, HD] fp16, `flash_attention_fused_qkv` with
implementation="generic"), by default the calls the general suite's configurations make that the
dispatch rule sends to this kernel on Hopper (head_dim 32 and 64 below the Mosaic kernel's lengths), at
the harness's padded key mask where a case says "mask". Every variant's output is checked against the
fp32 reference first (a wrong tiling is never timed), then timed as a median of back-to-back calls. The
default tiling (`default_block_sizes`) is always one of the variants, so each row shows what the table
gives against the best found; variants that clamp to the same tiling at a short S run once. One jitted
program makes --per-dispatch calls (default 8), each on its own inputs, so a short call's time is the
GPU's, not the host's dispatch (with 1, calls under ~60 us are host-bound and tilings do not separate). Writes
`<out>/flash-blocks-<date>-<gpu>.json` after every case (a timeout keeps what was done) and prints a
table last; the table in ttj_jax/kernels/flash_attention.py is updated from these files. --smoke: two
tiny cases and two variants in interpret mode, to test this script on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.gpu_power import sampling
from bench.jax_timing import stream_ms_per_call
from bench.paths import result_file, run_header
from bench.report import describe_error, write_json
from ttj_jax.kernels import BlockSizes, flash_attention_fused_qkv, flash_attention_reference
from ttj_jax.kernels.flash_attention import resolve_block_sizes

# (B, H, S, head_dim, causal, masked): the general suite's calls that reach this kernel on Hopper, plus
# the lengths between them, so each (head_dim, S) bucket of the table has at least one measurement.
DEFAULT_CASES = [
    (64, 4, 32, 32, False, True), (64, 8, 128, 32, False, True), (16, 4, 256, 32, True, True),
    (8, 16, 1024, 32, True, True), (8, 16, 1024, 32, False, True),
    (64, 4, 64, 64, False, True), (64, 8, 77, 64, True, True), (64, 4, 128, 64, False, True),
    (64, 6, 197, 64, False, True), (32, 12, 512, 64, False, True), (32, 12, 512, 64, False, False),
    (16, 12, 512, 64, True, True), (4, 16, 2048, 64, True, True), (4, 16, 2048, 64, False, False),
]
DEFAULT_VARIANTS = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
                    (64, 128, 4, 3), (128, 32, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2), (32, 64, 4, 2),
                    (128, 128, 8, 2)]
SMOKE_CASES = [(2, 2, 40, 32, True, True), (2, 2, 24, 64, False, False)]
SMOKE_VARIANTS = [(16, 16, 4, 2), (32, 16, 4, 2)]
KEEP_FRACTION = 0.7   # a masked case keeps between 100% and 70% of its keys per sequence (padding 0.3)


def parse_case(text: str) -> tuple:
    parts = text.split(",")
    if len(parts) != 6 or parts[4] not in ("causal", "full") or parts[5] not in ("mask", "none"):
        raise argparse.ArgumentTypeError(f"case {text!r} must read B,H,S,HD,causal|full,mask|none")
    b, h, s, hd = (int(p) for p in parts[:4])
    return (b, h, s, hd, parts[4] == "causal", parts[5] == "mask")


def parse_variant(text: str) -> tuple:
    try:
        values = tuple(int(p) for p in text.split(","))
        BlockSizes(*values)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"variant {text!r}: {exc}") from None
    return values


def case_inputs(case: tuple, seed: int = 0):
    b, h, s, hd, _, masked = case
    qkv = jax.random.normal(jax.random.PRNGKey(seed), (b, s, 3, h, hd), jnp.float32).astype(jnp.float16)
    if not masked:
        return qkv, None
    lengths = np.linspace(s, max(1, int(s * KEEP_FRACTION)), b).astype(np.int32)
    return qkv, jnp.asarray(np.arange(s)[None, :] < lengths[:, None])


def reference(qkv, key_mask, causal: bool):
    q, k, v = (qkv[:, :, i].astype(jnp.float32) for i in range(3))
    return flash_attention_reference(q, k, v, causal=causal, key_mask=key_mask)


def run_case(case: tuple, variants: list, *, interpret: bool, min_seconds: float, per_dispatch: int = 1,
             power=None) -> dict:
    """Every variant of one case checked, then timed. per_dispatch > 1: one jitted program makes that many
    calls, each on its own inputs (distinct, so none is merged away), and the time per call is the
    program's over per_dispatch: the host's dispatch is paid once per program, not once per call. With a
    running PowerSampler (bench/gpu_power.py), each row's "gpu_state" is the SM clock and power while it ran."""
    b, h, s, hd, causal, masked = case
    inputs = [case_inputs(case, seed) for seed in range(per_dispatch)]
    qkvs, masks = [qkv for qkv, _ in inputs], [mask for _, mask in inputs]
    want = np.asarray(reference(qkvs[0], masks[0], causal))
    # Tilings as the kernel runs them (blocks clamped to a short S), each once.
    default = resolve_block_sizes(s, hd, None, causal)
    chosen = list(dict.fromkeys([resolve_block_sizes(s, hd, BlockSizes(*v)) for v in variants] + [default]))
    rows = []
    for blocks in chosen:
        label = f"{blocks.block_q}x{blocks.block_k} w{blocks.num_warps} s{blocks.num_stages}"
        row = {"block_sizes": [blocks.block_q, blocks.block_k, blocks.num_warps, blocks.num_stages],
               "default": blocks == default, "label": label}
        try:
            def calls(xs, ms, blocks=blocks):
                return [flash_attention_fused_qkv(x, causal=causal, key_mask=m, block_sizes=blocks,
                                                  interpret=interpret, implementation="generic")
                        for x, m in zip(xs, ms)]
            fn = jax.jit(calls)
            got = np.asarray(fn(qkvs, masks)[0]).astype(np.float32)
            row["max_abs_err"] = float(np.max(np.abs(got - want)))
            if not row["max_abs_err"] <= 2e-2:
                raise AssertionError(f"max |err| {row['max_abs_err']:.3g} against the fp32 reference")
            start = time.perf_counter()
            ms, dispatches = stream_ms_per_call(fn, (qkvs, masks), min_seconds=min_seconds, repeats=5)
            row.update(ms=ms / per_dispatch, calls=dispatches * per_dispatch,
                       gpu_state=power.window(start, time.perf_counter()) if power else None)
        except Exception as exc:  # a tiling Triton cannot build is recorded, never fatal
            row["error"] = describe_error(exc)
        rows.append(row)
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    default_row = next(r for r in rows if r["default"])
    return {"case": {"batch": b, "heads": h, "seq_len": s, "head_dim": hd, "causal": causal,
                     "key_mask": masked},
            "calls_per_dispatch": per_dispatch, "rows": rows, "best": best and best["label"],
            "default_over_best": (default_row["ms"] / best["ms"]) if best and "ms" in default_row else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", type=parse_case, default=None)
    p.add_argument("--variants", nargs="+", type=parse_variant, default=None)
    p.add_argument("--min-seconds", type=float, default=0.1, help="least length of one timing")
    p.add_argument("--per-dispatch", type=int, default=8,
                   help="calls per jitted program, each on its own inputs (1: one dispatch per call)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.per_dispatch < 1:
        p.error(f"--per-dispatch {args.per_dispatch} must be at least 1")
    cases = args.cases or (SMOKE_CASES if args.smoke else DEFAULT_CASES)
    variants = args.variants or (SMOKE_VARIANTS if args.smoke else DEFAULT_VARIANTS)
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        p.error(f"needs a GPU (found {device.platform}); --smoke runs tiny cases in interpret mode")
    name = "smoke" if args.smoke else device.device_kind
    path = result_file("flash-blocks", name, args.out)
    document = {**run_header("python -m bench.flash_blocks " + " ".join(sys.argv[1:] if argv is None else argv)),
                "device": device.device_kind, "cases": []}
    with sampling(not args.smoke) as power:
        for i, case in enumerate(cases, 1):
            start = time.perf_counter()
            record = run_case(case, variants, interpret=args.smoke, power=power,
                              min_seconds=0.0 if args.smoke else args.min_seconds,
                              per_dispatch=2 if args.smoke else args.per_dispatch)
            record["wall_s"] = time.perf_counter() - start
            document["cases"].append(record)   # the JSON rewritten after each case: a timeout keeps what was done
            write_json(document, os.path.dirname(path), os.path.basename(path).removesuffix(".json"))
            print(f"[{i}/{len(cases)}] {case}: best {record['best']}, default/best "
                  f"{record['default_over_best'] or float('nan'):.2f} ({record['wall_s']:.0f} s)", flush=True)
    print_table(document)
    print(f"wrote {path}")
    return 1 if any(r.get("error") and "max |err|" in r["error"] for c in document["cases"] for r in c["rows"]) else 0


def print_table(document: dict) -> None:
    print(f"\n{'case (B,H,S,hd,causal,mask)':34s} {'default':>16s} {'us':>7s} {'best':>16s} {'us':>7s}")
    for record in document["cases"]:
        c = record["case"]
        label = f"{c['batch']},{c['heads']},{c['seq_len']},{c['head_dim']},{c['causal']:d},{c['key_mask']:d}"
        by_label = {r["label"]: r for r in record["rows"]}
        d = next(r for r in record["rows"] if r["default"])
        b = by_label.get(record["best"] or "", {})
        print(f"{label:34s} {d['label']:>16s} {d.get('ms', float('nan')) * 1e3:7.1f} "
              f"{record['best'] or '-':>16s} {b.get('ms', float('nan')) * 1e3:7.1f}")


if __name__ == "__main__":
    sys.exit(main())
