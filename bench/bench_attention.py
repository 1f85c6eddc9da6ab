"""Causal flash attention on the GPU: ttj's Pallas kernel against cuDNN, XLA and jax's bundled kernels.

    python bench/bench_attention.py [--quick] [--check] [--out DIR]

First a correctness sweep of ttj's kernel on the GPU (the Triton-lowered twin of
tests/test_flash_attention.py: odd S, every head_dim, masks, fp32/bf16 inputs, the fused-qkv layout,
determinism). Then, per case, ttj's output on the full case is checked against the fp32 reference on a
prefix (causal rows [:K] depend only on inputs [:K]) and on the last rows, and every contender is timed:
compile apart, warm-up, then the median of repeated timings of N back-to-back calls with N chosen so one
timing lasts >= 50 ms. Every contender runs inside try/except: a failure is recorded, never fatal.
Writes <out>/attention-<date>-<gpu>.json and prints a table last. Each timing also records the SM clock
and power draw it ran at ("gpu_state", from nvidia-smi where there is one: bench/gpu_power.py; on the
H200 the 700 W cap sets the clock, and the clock the TFLOP/s).

--check runs only the correctness parts (exit status 1 if one fails). --quick skips S=100000 and times
fewer block-size variants. --smoke runs tiny cases in interpret mode to test this script on a CPU.

--ragged runs only the check and timing of `flash_attention.UNPADDED_SEQUENCE` (sequences that are not a
block multiple read in place, no padded copy): per case of RAGGED_CASES (the fused-qkv entry the layers call,
fp16, with the harness's all-True key mask, as a bridge call passes it), the generic kernel with the
switch off (padded copies) and on, the two outputs compared element by element (exit status 1 unless they
agree within 1 fp16 ulp of the output scale and are finite), each call timed whole (its copies included).
Writes <out>/attention-ragged-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import pathlib
import sys
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.gpu_power import PowerSampler, sampling  # noqa: E402
from bench.jax_timing import stream_ms_per_call  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import describe_error, slug, write_json  # noqa: E402
from ttj_jax.kernels import (  # noqa: E402
    BlockSizes,
    flash_attention,
    flash_attention_fused_qkv,
    flash_attention_reference,  # noqa: E402
)
from ttj_jax.kernels.flash_attention import resolve_block_sizes, use_mosaic_kernel  # noqa: E402
from ttj_jax.kernels.flash_attention_mgpu import LOWERING_SEMANTICS as MGPU_LOWERINGS  # noqa: E402
from ttj_jax.kernels.flash_attention_mgpu import default_lowering_semantics, flash_attention_mgpu  # noqa: E402

# Timing cases, all causal fp16: (B, H, S, head_dim).
CASES = [(1, 16, 100_000, 64), (1, 16, 16384, 64), (64, 4, 1024, 32),
         (64, 4, 128, 8), (64, 4, 128, 32), (64, 4, 128, 128), (64, 4, 128, 256),
         (4, 16, 8192, 32)]   # the last: head_dim 32 on the Hopper kernel
SMOKE_CASES = [(1, 2, 100, 64), (2, 2, 40, 8)]
# --ragged: (B, H, S, head_dim, causal) shaped like the general suite's odd lengths (CLIP-text S=77, a
# ViT's 197 tokens, an encoder's 1000), plus a decoder's causal odd length.
RAGGED_CASES = [(64, 8, 77, 64, False), (64, 8, 77, 64, True), (64, 12, 197, 64, False), (8, 12, 1000, 64, False),
                (4, 8, 1000, 128, True), (64, 4, 100, 32, False)]
RAGGED_SMOKE_CASES = [(2, 2, 77, 64, False), (1, 2, 45, 32, True)]
CHECK_PREFIX_LEN = 4096    # rows of a big case checked against the reference on the prefix
CHECK_LAST_ROWS = 64       # and the last rows, which see the most keys
XLA_SCORES_LIMIT_BYTES = 8e9
MIN_TIMING_S = 0.05
IN_GRAPH_THRESHOLD_MS = 1.0   # calls shorter than this are timed IN_GRAPH_REPEATS at a time in one program
IN_GRAPH_REPEATS = 50
TIMING_REPEATS = 5
BUNDLED_SEQ_MULTIPLE = 256   # jax's bundled kernels: S a multiple of their query and key blocks
FP16_UNIT_ROUNDOFF = 2.0 ** -11
# Same pass rule as tests/test_flash_attention.py: |err| <= units * u * max|v|.
TOLERANCE_UNITS = {"float16": (2, 2.0 ** -11), "float32": (4, 2.0 ** -11), "bfloat16": (2, 2.0 ** -8)}

# Block-size variants timed per case next to the default (how the default table gets chosen).
VARIANTS_BY_HEAD_DIM = {
    8: [BlockSizes(64, 64, 4, 2), BlockSizes(128, 64, 4, 2), BlockSizes(32, 32, 2, 2), BlockSizes(128, 128, 4, 2)],
    32: [BlockSizes(128, 64, 4, 3), BlockSizes(64, 64, 4, 2), BlockSizes(128, 128, 8, 3), BlockSizes(64, 32, 4, 3)],
    64: [BlockSizes(128, 64, 4, 3), BlockSizes(128, 128, 8, 3), BlockSizes(64, 64, 4, 3), BlockSizes(128, 64, 8, 4)],
    128: [BlockSizes(128, 64, 8, 3), BlockSizes(64, 64, 4, 3), BlockSizes(128, 128, 8, 2), BlockSizes(64, 32, 4, 3)],
    256: [BlockSizes(64, 64, 8, 2), BlockSizes(64, 32, 4, 2), BlockSizes(32, 64, 4, 2), BlockSizes(128, 32, 8, 2)],
}


def log(message: str):
    print(message, flush=True)


def _random_qkv(seed, shape, dtype):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)


def _error_and_tolerance(out, ref, v):
    """Max |out - ref| and the pass tolerance (units * u * max|v|) for v's dtype."""
    units, unit_roundoff = TOLERANCE_UNITS[jnp.dtype(v.dtype).name]
    atol = units * unit_roundoff * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
    diff = jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))
    finite = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    return (float(jnp.max(diff)) if finite else math.inf), atol


_reference = jax.jit(flash_attention_reference, static_argnames=("causal", "sm_scale"))


@jax.jit
def _reference_last_rows(q_rows, k, v):
    """Causal attention for the last R query rows of a sequence, against all its keys, in fp32."""
    rows, seq_len, head_dim = q_rows.shape[1], k.shape[1], k.shape[-1]
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q_rows, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q32, k32, precision=jax.lax.Precision.HIGHEST) * head_dim ** -0.5
    query_pos = seq_len - rows + jnp.arange(rows)
    scores = jnp.where(jnp.arange(seq_len)[None, :] <= query_pos[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v32, precision=jax.lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------------------------------
# Correctness sweep (the GPU twin of the CI tests).

def _sweep_configs(smoke: bool):
    f16, f32, bf16 = jnp.float16, jnp.float32, jnp.bfloat16
    configs = [  # (S, head_dim, dtype, causal, masks)
        (1, 64, f16, True, None), (7, 8, f16, False, None), (33, 16, f16, True, "lengths"),
        (127, 32, f16, False, "mask"), (127, 64, f32, True, "both"), (129, 128, f16, False, None),
        (1000, 128, f16, True, None), (1000, 256, f16, False, "mask"), (255, 256, bf16, True, "lengths"),
        (300, 48, f32, False, "both"), (513, 64, f16, True, "mask"), (1000, 8, f16, True, "both"),
    ]
    return configs[:4] if smoke else configs


def run_sweep(interpret: bool, smoke: bool) -> list[dict]:
    checks = []
    batch, heads = 2, 2
    for index, (seq_len, head_dim, dtype, causal, masks) in enumerate(_sweep_configs(smoke)):
        name = f"sweep S={seq_len} hd={head_dim} {jnp.dtype(dtype).name} causal={causal} masks={masks}"
        record = {"name": name, "S": seq_len, "head_dim": head_dim, "dtype": jnp.dtype(dtype).name,
                  "causal": causal, "masks": masks}
        try:
            q, k, v = _random_qkv(index, (batch, seq_len, heads, head_dim), dtype)
            kwargs = {}
            if masks in ("lengths", "both"):
                kwargs["kv_lengths"] = jnp.asarray([0 if masks == "lengths" else seq_len // 3, seq_len // 2 + 1],
                                                   jnp.int32)
            if masks in ("mask", "both"):
                key_mask = np.random.default_rng(index).random((batch, seq_len)) < 0.6
                key_mask[0] = False  # a fully masked row must give zeros
                kwargs["key_mask"] = jnp.asarray(key_mask)
            out = flash_attention(q, k, v, causal=causal, interpret=interpret, **kwargs)
            ref = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal, **kwargs)
            err, atol = _error_and_tolerance(out, ref, v)
            record.update(max_abs_err=err, atol=atol, passed=err <= atol)
        except Exception as exc:  # noqa: BLE001 - a failure is a result here
            record.update(passed=False, error=describe_error(exc))
        checks.append(record)
        log(f"  {'ok  ' if record['passed'] else 'FAIL'} {name} err={record.get('max_abs_err')} "
            f"atol={record.get('atol')} {record.get('error', '')}")

    for seq_len, head_dim in ([(127, 64)] if smoke else [(127, 64), (1000, 32)]):
        record = {"name": f"fused qkv == separate S={seq_len} hd={head_dim}", "S": seq_len, "head_dim": head_dim}
        try:
            qkv = _random_qkv(99, (batch, seq_len, 3, heads, head_dim), jnp.float16)[0]
            lengths = jnp.asarray([seq_len, seq_len // 2], jnp.int32)
            fused = flash_attention_fused_qkv(qkv, causal=True, kv_lengths=lengths, interpret=interpret)
            separate = flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True,
                                       kv_lengths=lengths, interpret=interpret)
            diff = float(jnp.max(jnp.abs(fused.astype(jnp.float32) - separate.astype(jnp.float32))))
            record.update(max_abs_err=diff, bit_identical=bool(jnp.array_equal(fused, separate)),
                          passed=diff <= FP16_UNIT_ROUNDOFF * float(jnp.max(jnp.abs(qkv[:, :, 2]))))
        except Exception as exc:  # noqa: BLE001
            record.update(passed=False, error=describe_error(exc))
        checks.append(record)
        log(f"  {'ok  ' if record['passed'] else 'FAIL'} {record['name']} diff={record.get('max_abs_err')} "
            f"bit_identical={record.get('bit_identical')} {record.get('error', '')}")

    record = {"name": "two runs bit-identical"}
    try:
        q, k, v = _random_qkv(7, (batch, 257 if smoke else 1000, heads, 64), jnp.float16)
        first = flash_attention(q, k, v, causal=True, interpret=interpret)
        second = flash_attention(q, k, v, causal=True, interpret=interpret)
        record.update(passed=bool(jnp.array_equal(first, second)))
    except Exception as exc:  # noqa: BLE001
        record.update(passed=False, error=describe_error(exc))
    checks.append(record)
    log(f"  {'ok  ' if record['passed'] else 'FAIL'} {record['name']} {record.get('error', '')}")
    return checks


# ----------------------------------------------------------------------------------------------------
# Timing.

@dataclasses.dataclass
class Contender:
    name: str
    fn: object                       # (q, k, v) -> out
    block_sizes: BlockSizes | None = None
    skip_reason: str | None = None
    variant: str = ""                # which build of ttj's kernel: "default (mosaic_gpu)", "generic", ...
    seq_multiple: int = 1            # the kernel takes only S a multiple of this: timed at the next one up


def _contenders(batch, heads, seq_len, head_dim, *, quick: bool, interpret: bool) -> list[Contender]:
    """ttj first: `flash_attention` as users call it (no block sizes: the dispatcher picks the Hopper
    kernel on sm_90 where the module docstring says, else the generic one with its default blocks); on
    Hopper cases also the Hopper kernel with the other Mosaic GPU lowering; then the generic kernel's
    block-size variants (how its default table gets chosen); then the other contenders."""
    scale = head_dim ** -0.5
    hopper = use_mosaic_kernel(jnp.float16, seq_len, head_dim, masked=False, block_sizes=None,
                               interpret=interpret)
    contenders = [Contender("ttj", _ttj(None, interpret), None if hopper else resolve_block_sizes(
        seq_len, head_dim, None, causal=True), variant=f"default ({'mosaic_gpu' if hopper else 'generic'})")]
    if hopper:
        default = default_lowering_semantics(head_dim)
        other = next(semantics for semantics in MGPU_LOWERINGS if semantics != default)
        contenders.append(Contender("ttj", functools.partial(
            flash_attention_mgpu, causal=True, lowering_semantics=other), variant=f"mosaic_gpu {other}"))
    variants = [] if hopper else [resolve_block_sizes(seq_len, head_dim, None, causal=True)]  # the default, timed above
    for candidate in VARIANTS_BY_HEAD_DIM.get(head_dim, []):
        resolved = resolve_block_sizes(seq_len, head_dim, candidate, causal=True)  # as the kernel runs it
        if resolved not in variants:
            variants.append(resolved)
    variants = variants[:2] if quick else variants[:4]
    contenders += [Contender("ttj", _ttj(bs, interpret), bs, variant="generic")
                   for bs in variants if contenders[0].block_sizes != bs]
    # Under --smoke (CPU) the contenders below fail or run on the CPU: that tests the error handling.

    contenders.append(Contender("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")))
    scores_bytes = batch * heads * seq_len * seq_len * 4
    contenders.append(Contender(
        "xla", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
        skip_reason=(f"skipped: [B,H,S,S] fp32 scores would take {scores_bytes / 1e9:.1f} GB"
                     if scores_bytes > XLA_SCORES_LIMIT_BYTES else None)))

    def jax_triton(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as jax_attention
        return jax_attention.mha(q, k, v, None, scale, True)  # segment_ids, sm_scale, causal

    def jax_mosaic(q, k, v):
        # Note: this kernel applies no softmax scale; the work is the same, so the timing compares.
        from jax.experimental.pallas.ops.gpu import attention_mgpu
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        return attention_mgpu.attention(q, k, v, config)

    # jax's bundled kernels take only whole blocks: where S is not a multiple of their blocks they are timed
    # at the next multiple of BUNDLED_SEQ_MULTIPLE (zero-padded inputs, FLOPs counted at that length)
    contenders.append(Contender("jax_triton", jax_triton, seq_multiple=BUNDLED_SEQ_MULTIPLE))
    contenders.append(Contender("jax_mosaic", jax_mosaic, seq_multiple=BUNDLED_SEQ_MULTIPLE))
    return contenders


def _ttj(block_sizes, interpret):
    return lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=block_sizes, interpret=interpret)


def _repeated(fn, repeats, q, k, v):
    """`repeats` calls of fn inside one program, each depending on the previous one's output (through one
    element of q), so small cases are timed without the host's per-call dispatch cost."""
    def body(_, carry):
        q, _ = carry
        out = fn(q, k, v)
        return q.at[0, 0, 0, 0].set(out[0, 0, 0, 0].astype(q.dtype)), out
    return jax.lax.fori_loop(0, repeats, body, (q, jnp.zeros(q.shape, q.dtype)))[1]


def _measure(fn, compiled, args, power: PowerSampler | None = None) -> dict:
    """Time per call: directly when one call is long, else from `IN_GRAPH_REPEATS` calls in one program.
    With a running PowerSampler, "gpu_state" holds the SM clock and power draw sampled while the timings that
    give "ms" ran (bench/gpu_power.py says why: on the H200 the power cap sets the clock)."""
    jax.block_until_ready(compiled(*args))  # warm-up
    start = time.perf_counter()
    ms_dispatch, calls = stream_ms_per_call(compiled, args, min_seconds=MIN_TIMING_S, repeats=TIMING_REPEATS)
    timing = {"ms_per_dispatch": ms_dispatch, "calls_per_timing": calls, "in_graph_repeats": 1}
    if ms_dispatch >= IN_GRAPH_THRESHOLD_MS:
        return dict(timing, ms=ms_dispatch, gpu_state=power.window(start, time.perf_counter()) if power else None)
    looped = jax.jit(functools.partial(_repeated, fn, IN_GRAPH_REPEATS)).lower(*args).compile()
    jax.block_until_ready(looped(*args))  # warm-up
    start = time.perf_counter()
    ms_looped, calls = stream_ms_per_call(looped, args, min_seconds=MIN_TIMING_S, repeats=TIMING_REPEATS)
    return dict(timing, ms=ms_looped / IN_GRAPH_REPEATS, calls_per_timing=calls, in_graph_repeats=IN_GRAPH_REPEATS,
                gpu_state=power.window(start, time.perf_counter()) if power else None)


def _check_case_output(out, q, k, v, label: str, prefix_len: int) -> dict:
    """ttj's output on the full case against the fp32 reference on a prefix and on the last rows."""
    seq_len = q.shape[1]
    prefix = min(seq_len, prefix_len)
    ref = _reference(*(x[:, :prefix].astype(jnp.float32) for x in (q, k, v)), causal=True)
    err, atol = _error_and_tolerance(out[:, :prefix], ref, v)
    record = {"name": f"{label} rows [:{prefix}]", "max_abs_err": err, "atol": atol}
    if seq_len > prefix:
        rows = min(CHECK_LAST_ROWS, seq_len)
        tail_ref = _reference_last_rows(q[:, -rows:], k, v)
        tail_err, _ = _error_and_tolerance(out[:, -rows:], tail_ref, v)
        record.update(name=f"{label} rows [:{prefix}] and [-{rows}:]", max_abs_err=max(err, tail_err))
    record["passed"] = record["max_abs_err"] <= atol
    return record


def run_case(batch, heads, seq_len, head_dim, *, quick, check_only, interpret,
             power: PowerSampler | None = None) -> tuple[list, list]:
    results, checks = [], []
    q, k, v = _random_qkv(seq_len + head_dim, (batch, seq_len, heads, head_dim), jnp.float16)
    flops = 2 * batch * heads * seq_len * seq_len * head_dim  # causal: half of 4*B*H*S*S*hd
    shape = {"B": batch, "S": seq_len, "H": heads, "head_dim": head_dim, "causal": True}
    label = f"B={batch} H={heads} S={seq_len} hd={head_dim}"
    for contender in _contenders(batch, heads, seq_len, head_dim, quick=quick, interpret=interpret):
        if check_only and contender.name != "ttj":
            continue
        record = dict(shape, contender=contender.name, tflops=None, ms=None)
        if contender.variant:
            record["variant"] = contender.variant
        if contender.block_sizes is not None:
            record["block_sizes"] = dataclasses.asdict(contender.block_sizes)
        blocks_text = f" {_variant_text(record)}" if contender.variant else ""
        if contender.skip_reason:
            record["error"] = contender.skip_reason
            results.append(record)
            log(f"  {contender.name:10s}{blocks_text}: {contender.skip_reason}")
            continue
        args, case_flops = (q, k, v), flops
        if seq_len % contender.seq_multiple:
            run_len = seq_len + (-seq_len % contender.seq_multiple)
            args = tuple(jnp.pad(x, ((0, 0), (0, run_len - seq_len), (0, 0), (0, 0))) for x in (q, k, v))
            case_flops = flops * (run_len / seq_len) ** 2
            record["S_run"] = run_len
        try:
            start = time.perf_counter()
            compiled = jax.jit(contender.fn).lower(*args).compile()
            record["compile_s"] = round(time.perf_counter() - start, 3)
            if contender.name == "ttj":
                check = _check_case_output(compiled(q, k, v), q, k, v, f"{label} ttj{blocks_text}",
                                           prefix_len=64 if interpret else CHECK_PREFIX_LEN)
                check["variant"] = record["variant"]
                if "block_sizes" in record:
                    check["block_sizes"] = record["block_sizes"]
                checks.append(check)
                record["check_passed"] = check["passed"]
                log(f"  {'ok  ' if check['passed'] else 'FAIL'} {check['name']} "
                    f"err={check['max_abs_err']:.3g} atol={check['atol']:.3g}")
            if not check_only:
                record.update(_measure(contender.fn, compiled, args, power))
                record["tflops"] = case_flops / (record["ms"] * 1e-3) / 1e12
                log(f"  {contender.name:10s}{blocks_text}: {record['ms']:9.3f} ms  {record['tflops']:7.1f} TFLOP/s "
                    f"(x{record['in_graph_repeats']} in graph; {record['ms_per_dispatch']:.3f} ms per dispatch; "
                    f"compile {record['compile_s']:.1f} s{_gpu_text(record)})")
        except Exception as exc:  # noqa: BLE001 - one contender's failure must not end the run
            record["error"] = describe_error(exc)
            log(f"  {contender.name:10s}{blocks_text}: ERROR {record['error'][:300]}")
        results.append(record)
    return results, checks


def _gpu_text(record: dict) -> str:
    """'; 1770 MHz 690 W capped': the clock and power a timing ran at, where they were sampled."""
    gpu = record.get("gpu_state")
    if not gpu:
        return ""
    return f"; {gpu['sm_clock_mhz']:.0f} MHz {gpu['power_w']:.0f} W" + (" capped" if gpu["power_capped"] else "")


def _variant_text(record: dict) -> str:
    """'default (mosaic_gpu)', 'generic 128x64 w4 s3', ...: which build of ttj's kernel a record timed."""
    blocks = record.get("block_sizes")
    blocks = (f" {blocks['block_q']}x{blocks['block_k']} w{blocks['num_warps']} s{blocks['num_stages']}"
              if blocks else "")
    padded = f"at S={record['S_run']}" if "S_run" in record else ""
    return record.get("variant", "") + blocks + padded


def _print_table(results: list[dict]):
    log("")
    log(f"{'case':28s} {'contender':10s} {'variant':34s} {'ms':>10s} {'TFLOP/s':>8s} {'vs cudnn':>8s} {'MHz':>5s}")
    cudnn_ms = {(r["B"], r["H"], r["S"], r["head_dim"]): r["ms"] for r in results
                if r["contender"] == "cudnn" and r["ms"]}
    for r in results:
        key = (r["B"], r["H"], r["S"], r["head_dim"])
        case = f"B={r['B']} H={r['H']} S={r['S']} hd={r['head_dim']}"
        variant = _variant_text(r)
        if r["ms"] is None:
            log(f"{case:28s} {r['contender']:10s} {variant:34s} {(r.get('error') or '')[:60]}")
            continue
        ratio = f"{cudnn_ms[key] / r['ms']:.2f}x" if key in cudnn_ms else ""
        flag = "  CHECK FAILED" if r.get("check_passed") is False else ""
        clock = f"{r['gpu_state']['sm_clock_mhz']:5.0f}" if r.get("gpu_state") else ""
        log(f"{case:28s} {r['contender']:10s} {variant:34s} {r['ms']:10.3f} {r['tflops']:8.1f} {ratio:>8s} {clock:>5s}{flag}")


def run_ragged(interpret: bool, smoke: bool) -> tuple[list[dict], bool]:
    """--ragged (module docstring): (one record per case, whether every comparison passed)."""
    import importlib
    module = importlib.import_module("ttj_jax.kernels.flash_attention")   # the package exports the function
    shipped = module.UNPADDED_SEQUENCE
    records, passed = [], True
    for batch, heads, seq_len, head_dim, causal in (RAGGED_SMOKE_CASES if smoke else RAGGED_CASES):
        qkv = jnp.stack(_random_qkv(seq_len, (batch, seq_len, heads, head_dim), jnp.float16), axis=2)
        mask = jnp.ones((batch, seq_len), bool)
        record = {"B": batch, "H": heads, "S": seq_len, "head_dim": head_dim, "causal": causal}
        outputs = {}
        try:
            for name, unpadded in (("padded", False), ("unpadded", True)):
                module.UNPADDED_SEQUENCE = unpadded
                jax.clear_caches()   # the switch is read while tracing; a cached trace would not see it
                fn = jax.jit(lambda x, m: flash_attention_fused_qkv(x, causal=causal, key_mask=m, interpret=interpret,
                                                                    implementation="generic"))
                outputs[name] = np.asarray(jax.block_until_ready(fn(qkv, mask)).astype(jnp.float32))
                if not smoke:
                    record[f"{name}_us"] = stream_ms_per_call(fn, (qkv, mask), min_seconds=0.1, repeats=5)[0] * 1e3
        except Exception as e:  # noqa: BLE001 - recorded, the other cases still run
            record["error"] = describe_error(e)
        finally:
            module.UNPADDED_SEQUENCE = shipped
            jax.clear_caches()
        if len(outputs) == 2:
            scale = float(np.max(np.abs(outputs["padded"])))
            record["max_abs_diff"] = float(np.max(np.abs(outputs["unpadded"] - outputs["padded"])))
            record["finite"] = bool(np.isfinite(outputs["unpadded"]).all())
            record["passed"] = record["finite"] and record["max_abs_diff"] <= scale * 2.0 ** -10
        else:
            record["passed"] = False
        passed &= record["passed"]
        records.append(record)
        log(f"  {record}")
    return records, passed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="skip S=100000 and time fewer block-size variants")
    parser.add_argument("--check", action="store_true", help="correctness checks only, no timing")
    parser.add_argument("--out", default=default_out_dir(), help="folder for the JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny cases in interpret mode: tests this script on a CPU, numbers mean nothing")
    parser.add_argument("--ragged", action="store_true",
                        help="only the unpadded-sequence check and timing (flash_attention.UNPADDED_SEQUENCE)")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.smoke:
        log(f"bench_attention needs a GPU (found {device.platform}); use --smoke to test the script on a CPU")
        return 2
    interpret = args.smoke
    gpu_name = getattr(device, "device_kind", device.platform)
    log(f"device: {gpu_name}, jax {jax.__version__}")
    started = time.perf_counter()
    if args.ragged:
        records, passed = run_ragged(interpret, args.smoke)
        date = datetime.date.today().isoformat()
        command = "python bench/bench_attention.py " + " ".join(sys.argv[1:] if argv is None else argv)
        path = write_json({"gpu": gpu_name, "jax": jax.__version__, "date": date, "command": command,
                           "cases": records}, args.out,
                          f"attention-ragged-{date}-{slug(gpu_name)}" + ("-smoke" if args.smoke else ""))
        log(f"{'every case agrees' if passed else 'FAILED'}; wrote {path}")
        return 0 if passed else 1

    log("correctness sweep:")
    checks = run_sweep(interpret, args.smoke)
    cases = SMOKE_CASES if args.smoke else [c for c in CASES if not (args.quick and c[2] >= 100_000)]
    results = []
    with sampling() as power:   # the SM clock and power of every timing (None without nvidia-smi)
        for batch, heads, seq_len, head_dim in cases:
            log(f"case B={batch} H={heads} S={seq_len} head_dim={head_dim} causal fp16 "
                f"({time.perf_counter() - started:.0f} s so far):")
            case_results, case_checks = run_case(batch, heads, seq_len, head_dim, quick=args.quick,
                                                 check_only=args.check, interpret=interpret, power=power)
            results += case_results
            checks += case_checks

    date = datetime.date.today().isoformat()
    suffix = "-smoke" if args.smoke else ("-check" if args.check else "")
    payload = {"gpu": gpu_name, "jax": jax.__version__, "date": date, "quick": args.quick,
               "check_only": args.check, "cases": results, "checks": checks}
    path = write_json(payload, args.out, f"attention-{date}-{slug(gpu_name)}{suffix}")

    if not args.check:
        _print_table(results)
    failed = [c["name"] for c in checks if not c["passed"]]
    log(f"\nchecks: {len(checks) - len(failed)}/{len(checks)} passed" + (f"; FAILED: {failed}" if failed else ""))
    log(f"wrote {path} ({time.perf_counter() - started:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
