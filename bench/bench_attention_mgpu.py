"""Check and time the Mosaic GPU flash-attention kernel (ttj_jax/kernels/flash_attention_mgpu.py) on an H200.

    PYTHONPATH=. python3 bench/bench_attention_mgpu.py [--quick] [--check] [--out DIR]
        [--sweep | --lowering | --overlap | --hd32 | --multicast | --multicast_lengths | --key_mask
         | --key_mask_timing | --key_mask_clean]
        [--budget-s 420]

In order (most important first): head_dim 64 checks, the main timing case, the other head_dim checks,
the block-size variants (each checked, then timed at the main case), the other timing cases.

1. Correctness: the kernel's output against `flash_attention_reference` computed in fp32, for
   head_dim 32, 64, 128, 256, causal and not, S in {1, 113, 128, 1000} (whole outputs), and, at
   head_dim 64, S = 100000 (rows at the start, middle and end, against all the keys they may see).
   Pass rule: the harness's, |out - ref| <= max(0.002, 0.02 |ref|) elementwise, finite
   (ttj_jax.numerics.harness_check); the worst err/tol is recorded. Also: one bf16 case, one case run
   twice (the outputs must be bit-identical), each variant at S=1000.
2. Timing, fp16 causal, TFLOP/s = 2 B H S^2 hd / time (the causal half of 4 B H S^2 hd): our Mosaic
   kernel (its default and block-size variants at the main case), cuDNN
   (`jax.nn.dot_product_attention(implementation="cudnn")`), our generic Pallas kernel, and jax's
   bundled Mosaic kernel (which needs S to be a multiple of 128: it runs at S rounded up, its FLOPs
   counted at its own S). Main case B=1 H=16 S=100000 hd=64 (target >= 500 TFLOP/s), then
   B=64 H=4 S=1024 at hd 32 (the Mosaic kernel has no head_dim 32: skipped) and hd 64, and S=16384 at
   hd 128 and 256. Timing: compile apart, one warm-up call, then the median of 5 timings of N
   back-to-back calls (N chosen so one timing lasts >= 50 ms).

Every step runs inside try/except (a failure is recorded, never fatal) and under a watchdog: a step
that takes longer than --step-timeout-s (a hung kernel) ends the run, after writing what was measured.
Steps that would start after --budget-s are skipped, so the run stays under 8 minutes. Writes
<out>/attention-mgpu-<date>-<gpu>.json after every step and prints a table last. Exit status 1 if a
check failed, 3 on a watchdog timeout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import pathlib
import sys
import threading
import time

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.jax_timing import stream_ms_per_call  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import describe_error, slug  # noqa: E402
from ttj_jax.kernels import flash_attention, flash_attention_reference  # noqa: E402
from ttj_jax.kernels import flash_attention_mgpu_config as mgpu_config  # noqa: E402
from ttj_jax.numerics import HARNESS_ATOL, HARNESS_RTOL, harness_check  # noqa: E402

# The module, not the function of the same name that ttj_jax.kernels exports.
mgpu = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")

Blocks = mgpu.MgpuBlockSizes
ATOL, RTOL = HARNESS_ATOL, HARNESS_RTOL   # the harness's rule
CHECK_SEQ_LENS = (1, 113, 128, 1000)
LONG_SEQ_LEN = 100_000
LONG_CHECK_ROWS = 64               # rows checked at the start, middle and end of the long case
MAIN_CASE = (1, 16, LONG_SEQ_LEN, 64)
OTHER_TIMING_CASES = [(64, 4, 1024, 32), (64, 4, 1024, 64), (1, 16, 16384, 128), (1, 16, 16384, 256)]
# Variants timed at the main case next to the default (and checked at S=1000 and at the main case).
MAIN_VARIANTS = [
    dict(block_sizes=Blocks(128, 4, 2)),
    dict(block_sizes=Blocks(128, 4, 2), lowering_semantics="lane"),
    dict(block_sizes=Blocks(128, 4, 3), lowering_semantics="warpgroup"),
    dict(block_sizes=Blocks(256, 2, 2)),
    dict(block_sizes=Blocks(192, 3, 2)),
]
MIN_TIMING_S, TIMING_REPEATS = 0.05, 5
# --sweep: tilings around the measured defaults, each
# checked at S=1000 then timed at its case; then the defaults at the lengths that set MIN_SEQ_LEN.
SWEEP = [
    ((1, 16, LONG_SEQ_LEN, 64), [dict(block_sizes=Blocks(128, 3, 3)), dict(block_sizes=Blocks(128, 5, 3)),
                                 dict(block_sizes=Blocks(64, 4, 3)), dict(block_sizes=Blocks(64, 8, 3)),
                                 dict(block_sizes=Blocks(192, 3, 3)),
                                 dict(block_sizes=Blocks(128, 4, 3), lowering_semantics="lane")]),
    ((1, 16, 16384, 128), [dict(block_sizes=Blocks(128, 2, 3)), dict(block_sizes=Blocks(64, 4, 3)),
                           dict(block_sizes=Blocks(64, 4, 2))]),
]
# --lowering: shape 14's attention call (a chunk of 8 sequences) and the main case: the default against the
# warpgroup lowering, and the lane lowering with the stage counts around the default, checked, then timed
# next to cuDNN at both cases.
LOWERING_CASES = [(8, 16, LONG_SEQ_LEN, 64), MAIN_CASE]
LOWERING_VARIANTS = [dict(lowering_semantics="warpgroup"),
                     dict(lowering_semantics="lane", block_sizes=Blocks(128, 3, 3)),
                     dict(lowering_semantics="lane", block_sizes=Blocks(128, 5, 3))]
# --overlap: FA3's intra-warpgroup overlap (MgpuBlockSizes.overlap_softmax): three consumers at head_dim 64
# (FA3's head_dim-64 tiling), two at 64 and 128; each checked, then timed at its case next to the default
# and cuDNN.
OVERLAP_VARIANTS = {
    64: [dict(block_sizes=Blocks(128, 4, 3, overlap_softmax=True)),
         dict(block_sizes=Blocks(128, 4, 3, overlap_softmax=True),
              lowering_semantics="warpgroup"),
         dict(block_sizes=Blocks(128, 3, 3, overlap_softmax=True)),
         dict(block_sizes=Blocks(128, 4, 2, overlap_softmax=True))],
    128: [dict(block_sizes=Blocks(128, 2, 2, overlap_softmax=True)),
          dict(block_sizes=Blocks(128, 3, 2, overlap_softmax=True))],
}
OVERLAP_CASES = {64: MAIN_CASE, 128: (1, 16, 16384, 128)}
# --hd32: head_dim 32 on the Hopper kernel (64-byte swizzle). Checked like the others,
# then its default and tilings timed next to our generic kernel and cuDNN in alternating rounds at
# shape 13's attention call (B=64, H=4, S=1024: the generic kernel serves it) and a longer one.
HD32_VARIANTS = [dict(block_sizes=Blocks(128, 4, 2)), dict(block_sizes=Blocks(256, 2, 2)),
                 dict(block_sizes=Blocks(64, 4, 3)), dict(block_sizes=Blocks(192, 3, 3)),
                 dict(block_sizes=Blocks(128, 4, 3), lowering_semantics="warpgroup")]
HD32_CASES = [(64, 4, 1024, 32), (4, 16, 8192, 32)]
HD32_ROUNDS = 3
THRESHOLD_CASES = [(64, 4, 1024, 64), (4, 16, 4096, 64), (4, 16, 8192, 64), (4, 16, 4096, 128)]


def log(message: str):
    print(message, flush=True)


class Run:
    """Results so far, written to JSON after every step; a watchdog that ends a hung run."""

    def __init__(self, path: pathlib.Path, header: dict, step_timeout_s: float, budget_s: float):
        self.path, self.header = path, header
        self.checks, self.timings = [], []
        self.extra = {}   # more top-level entries of the JSON (a study's summary)
        self.step_timeout_s, self.budget_s = step_timeout_s, budget_s
        self.started = time.perf_counter()
        self._step, self._deadline = None, None
        threading.Thread(target=self._watch, daemon=True).start()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s

    def begin(self, name: str):
        self._step, self._deadline = name, time.perf_counter() + self.step_timeout_s

    def end(self):
        self._step = self._deadline = None
        self.write()

    def write(self, **extra):
        payload = dict(self.header, elapsed_s=round(self.elapsed(), 1), checks=self.checks,
                       timings=self.timings, **self.extra, **extra)
        self.path.write_text(json.dumps(payload, indent=1, default=str) + "\n")

    def _watch(self):
        while True:
            time.sleep(1.0)
            deadline, step = self._deadline, self._step
            if deadline is not None and time.perf_counter() > deadline:
                log(f"WATCHDOG: '{step}' ran over {self.step_timeout_s:.0f} s (hung kernel?); ending the run")
                self.write(timed_out_step=step)
                log(f"wrote {self.path}")
                os._exit(3)


def _random_qkv(seed, shape, dtype):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)


def _worst_ratio(out, ref):
    """The harness rule (ttj_jax.numerics.harness_check): worst |out - ref| / max(ATOL, RTOL |ref|), inf
    where a value is not finite, and max |out - ref|."""
    _, ratio, err = harness_check(out, ref)
    return ratio, err


def _reference_rows(q, k, v, rows, *, causal: bool, key_mask=None):
    """fp32 attention output for query rows `rows` only (each against every key it may see; with
    key_mask, bool [B, S], only valid keys, and zeros for a row with none)."""
    q_rows = q[:, rows].astype(jnp.float32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_rows, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
    allowed = jnp.ones((1, 1, len(rows), k.shape[1]), bool)
    if causal:
        allowed = allowed & (jnp.asarray(rows)[:, None] >= jnp.arange(k.shape[1])[None, :])[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    probs = jnp.where(allowed.any(axis=-1, keepdims=True), jax.nn.softmax(scores, axis=-1), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _key_mask(seed: int, batch: int, seq_len: int, kind: str):
    """bool [B, S]: "holes" (30% of keys invalid at random, the first 7 of sequence 0 invalid so its first
    rows see no key under causal attention, the last sequence all invalid when B > 1), "prefix" (the
    harness's padding 0.3: lengths in [0.7 S, S]) or "all" (all valid)."""
    rng = np.random.default_rng(seed)
    if kind == "all":
        return jnp.ones((batch, seq_len), bool)
    if kind == "prefix":
        lengths = rng.integers(round(0.7 * seq_len), seq_len + 1, batch)
        return jnp.asarray(np.arange(seq_len)[None, :] < lengths[:, None])
    mask = rng.random((batch, seq_len)) >= 0.3
    mask[0, :7] = False
    if batch > 1:
        mask[-1] = False
    return jnp.asarray(mask)


def _check(run: Run, batch, heads, seq_len, head_dim, causal, *, dtype=jnp.float16, kernel_kwargs=None,
           repeat: bool = False, key_mask: str | None = None, fused: bool = False):
    """key_mask: None, or a `_key_mask` kind given to the kernel (its key-masked build); fused: q, k and v
    read out of one [B, S, 3, H, hd] array (flash_attention_mgpu_fused_qkv)."""
    kernel_kwargs = kernel_kwargs or {}
    label = " ".join(part for part in (
        f"check{' fused' if fused else ''} B={batch} H={heads} S={seq_len} hd={head_dim} "
        f"{'causal' if causal else 'full'} {jnp.dtype(dtype).name}",
        _kwargs_text(kernel_kwargs), f"key mask {key_mask}" if key_mask else "") if part)
    record = dict(name=label, B=batch, H=heads, S=seq_len, head_dim=head_dim, causal=causal,
                  dtype=jnp.dtype(dtype).name, variant=_kwargs_json(kernel_kwargs), key_mask=key_mask, fused=fused,
                  passed=False)
    if run.over_budget():
        record.update(passed=None, error=f"skipped: time budget of {run.budget_s:.0f} s spent")
        run.checks.append(record)
        log(f"  skip {label}: time budget spent")
        return None
    run.begin(label)
    try:
        q, k, v = _random_qkv(seq_len * 7 + head_dim, (batch, seq_len, heads, head_dim), dtype)
        mask = None if key_mask is None else _key_mask(seq_len, batch, seq_len, key_mask)
        if fused:
            fn = jax.jit(lambda q, k, v, m: mgpu.flash_attention_mgpu_fused_qkv(
                jnp.stack((q, k, v), axis=2), causal=causal, key_mask=m, **kernel_kwargs))
        else:
            fn = jax.jit(lambda q, k, v, m: mgpu.flash_attention_mgpu(q, k, v, causal=causal, key_mask=m, **kernel_kwargs))
        start = time.perf_counter()
        compiled = fn.lower(q, k, v, mask).compile()
        record["compile_s"] = round(time.perf_counter() - start, 2)
        out = jax.block_until_ready(compiled(q, k, v, mask))
        if seq_len <= 4096 and mask is None:
            ref = flash_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
            ratio, err = _worst_ratio(out, ref)
        elif seq_len <= 4096:
            ref = _reference_rows(q, k, v, np.arange(seq_len), causal=causal, key_mask=mask)
            ratio, err = _worst_ratio(out, ref)
        else:
            middle = seq_len // 2
            rows = np.concatenate([np.arange(LONG_CHECK_ROWS), np.arange(middle, middle + LONG_CHECK_ROWS),
                                   np.arange(seq_len - LONG_CHECK_ROWS, seq_len)])
            ratio, err = _worst_ratio(out[:, rows], _reference_rows(q, k, v, rows, causal=causal, key_mask=mask))
            record["rows_checked"] = "first, middle and last 64"
        record.update(worst_err_over_tol=float(ratio), max_abs_err=float(err),
                      finite=bool(jnp.isfinite(out.astype(jnp.float32)).all()))
        record["passed"] = record["worst_err_over_tol"] <= 1.0 and record["finite"]
        if repeat:
            again = jax.block_until_ready(compiled(q, k, v, mask))
            record["bit_identical_rerun"] = bool(jnp.array_equal(out, again))
            record["passed"] &= record["bit_identical_rerun"]
        log(f"  {'ok  ' if record['passed'] else 'FAIL'} {label}: err/tol={record['worst_err_over_tol']:.3f} "
            f"max|err|={record['max_abs_err']:.2e} (compile {record['compile_s']:.1f} s)")
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        record["error"] = describe_error(exc)
        log(f"  FAIL {label}: ERROR {record['error'][:400]}")
    run.checks.append(record)
    run.end()
    return record["passed"]


def _kwargs_text(kwargs) -> str:
    parts = []
    if "block_sizes" in kwargs:
        b = kwargs["block_sizes"]
        parts.append(f"kv{b.block_kv} s{b.num_stages} wg{b.num_compute_wgs}{' ovl' if b.overlap_softmax else ''}"
                     + (" multicast" if b.kv_multicast else "") + ("" if b.pingpong else " no-pingpong")
                     + (" warp-producer" if b.warp_producer else ""))
    if "lowering_semantics" in kwargs:
        parts.append(kwargs["lowering_semantics"])
    if kwargs.get("key_mask"):
        parts.append(f"key mask {kwargs['key_mask']}")
    if kwargs.get("clean_blocks"):
        parts.append("clean-block bounds")
    return " ".join(parts)


def _kwargs_json(kwargs) -> dict:
    return {key: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
            for key, value in kwargs.items()}


def _contenders(seq_len, head_dim, variants, baselines: bool):
    """(name, fn, kwargs, seq_len it runs at, reason it is skipped or None)."""
    supported = head_dim in mgpu.SUPPORTED_HEAD_DIMS
    skip = None if supported else f"skipped: head_dim {head_dim} not in {mgpu.SUPPORTED_HEAD_DIMS}"
    contenders = []
    for kwargs in variants:
        contenders.append(("ttj_mgpu", lambda q, k, v, kw=kwargs: mgpu.flash_attention_mgpu(
            q, k, v, causal=True, **kw), kwargs, seq_len, skip))
    if not baselines:
        return contenders
    contenders.append(("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn"), {}, seq_len, None))
    contenders.append(("ttj_generic", lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="generic"),
                       {}, seq_len, None))

    def jax_mosaic(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: PLC0415
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
        return attention_mgpu.attention(q, k, v, config)   # applies no softmax scale: same work
    mosaic_len = -(-seq_len // 128) * 128
    contenders.append(("jax_mosaic", jax_mosaic, {}, mosaic_len,
                       None if head_dim % 64 == 0 else f"skipped: head_dim {head_dim} not a multiple of 64"))
    return contenders


def _time_case(run: Run, batch, heads, seq_len, head_dim, variants, baselines: bool = True,
               round_index: int | None = None):
    log(f"timing B={batch} H={heads} S={seq_len} hd={head_dim} causal fp16 ({run.elapsed():.0f} s so far):")
    inputs = {}
    for name, fn, kwargs, run_len, skip in _contenders(seq_len, head_dim, variants, baselines):
        record = dict(B=batch, H=heads, S=run_len, head_dim=head_dim, causal=True, contender=name,
                      variant=_kwargs_json(kwargs), ms=None, tflops=None)
        if round_index is not None:
            record["round"] = round_index
        text = f"{name} {_kwargs_text(kwargs)}".strip()
        if skip is None and run.over_budget():
            skip = f"skipped: time budget of {run.budget_s:.0f} s spent"
        if skip:
            record["error"] = skip
            run.timings.append(record)
            log(f"  {text}: {skip}")
            continue
        if run_len not in inputs:
            inputs[run_len] = _random_qkv(run_len + head_dim, (batch, run_len, heads, head_dim), jnp.float16)
        _time_into(run, record, text, fn, inputs[run_len],
                   mgpu.attention_flops(batch, run_len, heads, head_dim, causal=True))


def _time_into(run: Run, record: dict, text: str, fn, args, flops: float) -> None:
    """fn(*args) compiled apart, warmed up, then timed (the median of TIMING_REPEATS stream timings) into
    record (compile_s, ms, calls_per_timing, tflops), or its error; the record joins run.timings."""
    run.begin(f"time {text} B={record['B']} H={record['H']} S={record['S']} hd={record['head_dim']}")
    try:
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        record["compile_s"] = round(time.perf_counter() - start, 2)
        jax.block_until_ready(compiled(*args))   # warm-up
        record["ms"], record["calls_per_timing"] = stream_ms_per_call(
            compiled, args, min_seconds=MIN_TIMING_S, repeats=TIMING_REPEATS)
        record["tflops"] = flops / (record["ms"] * 1e-3) / 1e12
        log(f"  {text}: {record['ms']:.3f} ms  {record['tflops']:.1f} TFLOP/s (compile {record['compile_s']:.1f} s)")
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        record["error"] = describe_error(exc)
        log(f"  {text}: ERROR {record['error'][:400]}")
    run.timings.append(record)
    run.end()


def _print_table(run: Run):
    log("")
    log(f"{'case':30s} {'contender':12s} {'variant':26s} {'ms':>9s} {'TFLOP/s':>8s} {'vs cudnn':>8s}")
    cudnn = {(r["B"], r["H"], r["S"], r["head_dim"]): r["ms"] for r in run.timings
             if r["contender"] == "cudnn" and r["ms"]}
    for r in run.timings:
        case = f"B={r['B']} H={r['H']} S={r['S']} hd={r['head_dim']}"
        variant = _kwargs_text({k: (Blocks(**v) if k == "block_sizes" else v) for k, v in r["variant"].items()})
        if r["ms"] is None:
            log(f"{case:30s} {r['contender']:12s} {variant:26s} {(r.get('error') or '')[:70]}")
            continue
        base = cudnn.get((r["B"], r["H"], r["S"], r["head_dim"]))
        ratio = f"{base / r['ms']:.2f}x" if base else ""
        log(f"{case:30s} {r['contender']:12s} {variant:26s} {r['ms']:9.3f} {r['tflops']:8.1f} {ratio:>8s}")
    _print_check_summary(run)


def _print_check_summary(run: Run):
    failed = [c["name"] for c in run.checks if c["passed"] is False]
    skipped = sum(c["passed"] is None for c in run.checks)
    log(f"checks: {sum(c['passed'] is True for c in run.checks)}/{len(run.checks)} passed, {skipped} skipped"
        + (f"; FAILED: {failed}" if failed else ""))


def sweep(run: Run) -> None:
    """--sweep: more tilings (checked, then timed next to the default and cuDNN), then the thresholds."""
    for case, variants in SWEEP:
        head_dim = case[3]
        _time_case(run, *case, variants=[{}])
        for kwargs in variants:
            passed = [_check(run, 2, 3, 1000, head_dim, causal, kernel_kwargs=kwargs) for causal in (True, False)]
            if all(passed):
                _time_case(run, *case, variants=[kwargs], baselines=False)
    for case in THRESHOLD_CASES:
        _time_case(run, *case, variants=[{}])


def lowering_study(run: Run, variants=LOWERING_VARIANTS, cases=LOWERING_CASES) -> None:
    """--lowering: each LOWERING_VARIANTS entry checked (S=1000, causal and not; S=100000 rows), then all
    timed at each of LOWERING_CASES next to the default and cuDNN."""
    passing = [{}]
    for kwargs in variants:
        checks = [_check(run, 2, 3, 1000, 64, causal, kernel_kwargs=kwargs) for causal in (True, False)]
        checks.append(_check(run, 2, 2, LONG_SEQ_LEN, 64, True, kernel_kwargs=kwargs))
        if all(checks):
            passing.append(kwargs)
    for case in cases:
        _time_case(run, *case, variants=passing)


def overlap_study(run: Run) -> None:
    """--overlap: each OVERLAP_VARIANTS entry checked at its head_dim (S=1000, causal and not; at 64 also
    rows of S=100000), then the passing ones timed at OVERLAP_CASES next to the default and cuDNN."""
    for head_dim, variants in OVERLAP_VARIANTS.items():
        passing = [{}]
        for kwargs in variants:
            checks = [_check(run, 2, 3, 1000, head_dim, causal, kernel_kwargs=kwargs) for causal in (True, False)]
            if head_dim == 64:
                checks.append(_check(run, 2, 2, LONG_SEQ_LEN, 64, True, kernel_kwargs=kwargs))
            if all(checks):
                passing.append(kwargs)
        _time_case(run, *OVERLAP_CASES[head_dim], variants=passing)


def _time_in_rounds(run: Run, cases, variants, rounds: int, baselines=lambda round_index: round_index == 0):
    """Each round times every case with the variants, in alternating order (forward in even rounds,
    backward in odd ones), tagged with the round for _medians_over_rounds; baselines(round) says
    whether cuDNN and the other kernels are timed beside them in that round."""
    for round_index in range(rounds):
        order = variants if round_index % 2 == 0 else variants[::-1]
        for case in cases:
            _time_case(run, *case, variants=order, baselines=baselines(round_index), round_index=round_index)


def _medians_over_rounds(run: Run, key: str) -> None:
    """Each (case, contender, variant)'s median TFLOP/s over the timings tagged with a round, into
    run.extra[key] and the log."""
    groups = {}
    for r in run.timings:
        if r.get("round") is not None and r["tflops"]:
            group = (r["B"], r["H"], r["S"], r["head_dim"], r["contender"], json.dumps(r["variant"], sort_keys=True))
            groups.setdefault(group, []).append(r["tflops"])
    medians = run.extra.setdefault(key, [])
    log("")
    log("median over rounds:")
    for (b, h, s, hd, contender, variant), values in groups.items():
        median = float(np.median(values))
        medians.append(dict(B=b, H=h, S=s, head_dim=hd, contender=contender, variant=json.loads(variant),
                            tflops_median=median, tflops_rounds=values))
        text = _kwargs_text({k: (Blocks(**v) if k == "block_sizes" else v) for k, v in json.loads(variant).items()})
        log(f"  B={b} H={h} S={s} hd={hd} {contender:12s} {text:34s} {median:7.1f} TFLOP/s  "
            f"rounds {[f'{x:.1f}' for x in values]}")


def hd32_study(run: Run) -> None:
    """--hd32: head_dim 32's default checked at every CHECK_SEQ_LENS length (causal and not), in bf16
    and at S=100000 (rows), each HD32_VARIANTS entry at S=1000; then the passing builds, our generic
    kernel and cuDNN timed at HD32_CASES in HD32_ROUNDS alternating rounds."""
    for causal in (True, False):
        for seq_len in CHECK_SEQ_LENS:
            _check(run, 2, 3, seq_len, 32, causal, repeat=(seq_len == 1000 and causal))
    _check(run, 2, 3, 1000, 32, True, dtype=jnp.bfloat16)
    _check(run, 1, 2, LONG_SEQ_LEN, 32, True)
    passing = [{}]
    for kwargs in HD32_VARIANTS:
        if all([_check(run, 2, 3, 1000, 32, causal, kernel_kwargs=kwargs) for causal in (True, False)]):
            passing.append(kwargs)
    _time_in_rounds(run, HD32_CASES, passing, HD32_ROUNDS, baselines=lambda round_index: True)
    _medians_over_rounds(run, "medians_over_rounds")


def _multicast_variant(seq_len: int, head_dim: int, on: bool = True) -> dict:
    """The tiling this length defaults to, without multicast (and with the ping-pong ring), or with
    multicast as the defaults take it (mgpu_config.with_kv_multicast: at head_dim 64 without the ring, since
    MULTICAST_WITHOUT_PINGPONG)."""
    plain = mgpu_config.default_block_sizes(head_dim, seq_len, kv_multicast=False)
    return dict(block_sizes=mgpu_config.with_kv_multicast(plain, head_dim) if on else plain)


def _time_multicast_on_and_off(run: Run, cases, passing: dict) -> None:
    """Each ((B, H, S, head_dim), rounds) of `cases` whose head_dim passed its checks: the default tiling
    without and with kv_multicast, in alternating rounds (no other contenders), then the medians."""
    for (batch, heads, seq_len, head_dim), rounds in cases:
        if passing[head_dim]:
            _time_in_rounds(run, [(batch, heads, seq_len, head_dim)],
                            [_multicast_variant(seq_len, head_dim, on=False), _multicast_variant(seq_len, head_dim)],
                            rounds, baselines=lambda round_index: False)
    _medians_over_rounds(run, "medians_over_rounds")


# kv_multicast's checks: lengths whose query-tile counts are odd and even at every head_dim (block_q 192 at
# head_dim 32/64, 128 at 128 and 256), so that pairs with a member past the last tile and full pairs
# both run, causal (the upper tile's extra blocks) and not.
MULTICAST_CHECK_SEQ_LENS = (113, 1000, 1200, 2000)
MULTICAST_CASES = [(MAIN_CASE, 5), ((8, 16, LONG_SEQ_LEN, 64), 2), ((1, 16, 16384, 128), 3)]


def multicast_study(run: Run) -> None:
    """--multicast: MgpuBlockSizes(kv_multicast=True), K/V blocks shared by 2-block clusters through TMA
    multicast, on each head_dim's default tiling: checked at
    MULTICAST_CHECK_SEQ_LENS causal and not (one repeat bit-identical), at S=100000 head_dim 64 (rows),
    then timed against the same tiling without it at MULTICAST_CASES in alternating rounds (fp16
    causal, as every timing here)."""
    passing = {}
    for head_dim in (64, 128, 32, 256):
        checks = [_check(run, 2, 3, seq_len, head_dim, causal, kernel_kwargs=_multicast_variant(seq_len, head_dim),
                         repeat=(seq_len == 1200 and causal))
                  for seq_len in MULTICAST_CHECK_SEQ_LENS for causal in (True, False)]
        if head_dim == 64:
            checks += [_check(run, 1, 2, LONG_SEQ_LEN, 64, causal, kernel_kwargs=_multicast_variant(LONG_SEQ_LEN, 64))
                       for causal in (True, False)]
        passing[head_dim] = all(checks)
    _time_multicast_on_and_off(run, MULTICAST_CASES, passing)


# Where kv_multicast starts to pay, fp16 causal, with and without it, in alternating rounds: each head_dim's
# MULTICAST_MIN_SEQ_LEN is its shortest case here that won.
MULTICAST_LENGTH_CASES = [((4, 16, 16384, 64), 3), ((2, 16, 32768, 64), 3), ((4, 16, 4096, 128), 3),
                          ((2, 16, 8192, 128), 3), ((1, 16, 16384, 256), 3)]


def multicast_lengths_study(run: Run) -> None:
    """--multicast_lengths: kv_multicast against the same tiling without it at MULTICAST_LENGTH_CASES
    (the lengths that set its thresholds), checked first at S=1200 and 2000 on each head_dim there."""
    passing = {}
    for head_dim in sorted({case[3] for case, _ in MULTICAST_LENGTH_CASES}):
        passing[head_dim] = all(_check(run, 2, 3, seq_len, head_dim, causal,
                                       kernel_kwargs=_multicast_variant(seq_len, head_dim))
                                for seq_len in (1200, 2000) for causal in (True, False))
    _time_multicast_on_and_off(run, MULTICAST_LENGTH_CASES, passing)


# --key_mask: the key-masked build (flash_attention_mgpu(key_mask=...)), checked with masks with holes (rows
# with no valid key, a sequence with none) at every head_dim, causal and not, the fused-layout entry at shape
# 8's call, and rows of S=100000; then timed against the same kernel without a mask, with an all-True and
# the harness's padding mask, and against the generic kernel with that mask, where flash_attention would
# send a masked call (KEY_MASK_DISPATCH decides on these numbers).
KEY_MASK_CHECKS = [(2, 3, seq_len, head_dim, causal) for head_dim in (64, 128, 32, 256) for seq_len in (113, 1000)
                   for causal in (True, False)]
KEY_MASK_CASES = [(1, 16, 16384, 64), (4, 16, 4096, 128), (64, 4, 1024, 64), MAIN_CASE]


def _time_key_masks(run: Run, batch, heads, seq_len, head_dim, clean: bool = False) -> None:
    """One case, fp16 causal: the Mosaic kernel without a mask and with three (clean: also its build with
    clean-block bounds, `ttj_mgpu_clean`), the generic kernel with the padding mask."""
    log(f"timing key masks B={batch} H={heads} S={seq_len} hd={head_dim} ({run.elapsed():.0f} s so far):")
    q, k, v = _random_qkv(seq_len + head_dim, (batch, seq_len, heads, head_dim), jnp.float16)
    masks = {kind: _key_mask(seq_len, batch, seq_len, kind) for kind in ("all", "prefix", "holes")}
    contenders = [("ttj_mgpu", None), ("ttj_mgpu", "all"), ("ttj_mgpu", "prefix"), ("ttj_mgpu", "holes")]
    if clean:
        contenders += [("ttj_mgpu_clean", "all"), ("ttj_mgpu_clean", "prefix"), ("ttj_mgpu_clean", "holes")]
    contenders.append(("ttj_generic", "prefix"))
    for name, kind in contenders:
        record = dict(B=batch, H=heads, S=seq_len, head_dim=head_dim, causal=True, contender=name,
                      variant={"key_mask": kind}, ms=None, tflops=None)
        text = f"{name} key mask {kind}"
        if run.over_budget():
            record["error"] = f"skipped: time budget of {run.budget_s:.0f} s spent"
            run.timings.append(record)
            continue

        def fn(q, k, v, m=None, name=name):
            if name == "ttj_generic":
                return flash_attention(q, k, v, causal=True, key_mask=m, implementation="generic")
            return mgpu.flash_attention_mgpu(q, k, v, causal=True, key_mask=m,
                                             clean_blocks=name == "ttj_mgpu_clean")
        _time_into(run, record, text, fn, (q, k, v) if kind is None else (q, k, v, masks[kind]),
                   mgpu.attention_flops(batch, seq_len, heads, head_dim, causal=True))


def key_mask_study(run: Run) -> None:
    """--key_mask: KEY_MASK_CHECKS with a mask with holes, one repeat bit-identical, the fused entry, rows of
    S=100000 with the padding mask; if all pass, KEY_MASK_CASES timed (`_time_key_masks`)."""
    passed = [_check(run, *case, key_mask="holes", repeat=case[2] == 1000 and case[4]) for case in KEY_MASK_CHECKS]
    passed.append(_check(run, 64, 4, 128, 256, True, key_mask="holes", fused=True))   # shape 8's call
    passed.append(_check(run, 1, 2, LONG_SEQ_LEN, 64, True, key_mask="prefix"))
    if all(passed):
        for case in KEY_MASK_CASES:
            _time_key_masks(run, *case)


def key_mask_clean_study(run: Run) -> None:
    """--key_mask_clean: the build with clean-block bounds (clean_blocks=True) checked with padding masks
    and masks with holes at every head_dim, causal and not, the fused entry at shape 8's call and rows of
    S=100000; if all pass, KEY_MASK_CASES timed with and without the bounds."""
    clean = {"clean_blocks": True}
    passed = [_check(run, *case, key_mask=kind, kernel_kwargs=clean, repeat=kind == "holes" and case[4])
              for case in KEY_MASK_CHECKS if case[2] == 1000 for kind in ("prefix", "holes")]
    passed.append(_check(run, 64, 4, 128, 256, True, key_mask="prefix", kernel_kwargs=clean, fused=True))
    passed.append(_check(run, 1, 2, LONG_SEQ_LEN, 64, True, key_mask="prefix", kernel_kwargs=clean))
    if all(passed):
        for case in KEY_MASK_CASES:
            _time_key_masks(run, *case, clean=True)


def key_mask_timing_study(run: Run) -> None:
    """--key_mask_timing: the key-masked build's S=100000 rows check, then KEY_MASK_CASES timed, without
    --key_mask's short checks (for a GPU where they have passed)."""
    if _check(run, 1, 2, LONG_SEQ_LEN, 64, True, key_mask="prefix"):
        for case in KEY_MASK_CASES:
            _time_key_masks(run, *case)


# The studies run alone (one --NAME flag each): name -> (function of the run, --help text). Each writes
# attention-mgpu-<date>-<gpu>-<name>.json.
STUDIES = {
    "sweep": (lambda run: sweep(run), "only the tiling sweep and the threshold cases"),
    "lowering": (lambda run: lowering_study(run),
                 "only the lowerings and stage counts, at shape 14's attention call and the main case"),
    "overlap": (lambda run: overlap_study(run), "only the softmax overlap variants (OVERLAP_VARIANTS)"),
    "hd32": (lambda run: hd32_study(run),
             "only head_dim 32 on the Hopper kernel: checks, then HD32_VARIANTS at HD32_CASES"),
    "multicast": (lambda run: multicast_study(run), "only K/V multicast to 2-block clusters "
                  "(MgpuBlockSizes.kv_multicast): checks, then MULTICAST_CASES in alternating rounds"),
    "multicast_lengths": (lambda run: multicast_lengths_study(run), "only kv_multicast at the lengths that "
                          "set its thresholds (MULTICAST_LENGTH_CASES), with and without it, in alternating rounds"),
    "key_mask_clean": (lambda run: key_mask_clean_study(run), "only the key-masked build with clean-block "
                       "bounds: checks with padding masks and holes, then timed beside the build without"),
    "key_mask_timing": (lambda run: key_mask_timing_study(run), "only the key-masked build's long-sequence "
                        "check and its timings (--key_mask without its short checks)"),
    "key_mask": (lambda run: key_mask_study(run), "only the key-masked build: checks with masks, then "
                 "KEY_MASK_CASES against the mask-free build and the generic kernel"),
}


def gpu_check_and_time(out_dir: str | None = None, *, quick: bool = False, check_only: bool = False,
                       budget_s: float = 420.0, step_timeout_s: float = 90.0, study: str | None = None) -> int:
    """Checks the Mosaic kernel on the GPU, times it, writes JSON, prints a table; study: one of STUDIES
    alone instead. Returns an exit status."""
    if study is not None and study not in STUDIES:
        raise ValueError(f"study={study!r} must be one of {sorted(STUDIES)}")
    device = jax.devices()[0]
    if device.platform != "gpu":
        log(f"bench_attention_mgpu needs a GPU (found {device.platform})")
        return 2
    gpu_name = getattr(device, "device_kind", device.platform)
    date = datetime.date.today().isoformat()
    out = pathlib.Path(out_dir or default_out_dir())
    out.mkdir(parents=True, exist_ok=True)
    suffix = f"-{study}" if study else "-check" if check_only else "-quick" if quick else ""
    import jaxlib  # noqa: PLC0415
    header = {"gpu": gpu_name, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "date": date, "quick": quick, "check_only": check_only, "pass_rule": f"|err| <= max(atol {ATOL}, rtol {RTOL} |ref|), finite"}
    run = Run(out / f"attention-mgpu-{date}-{slug(gpu_name)}{suffix}.json", header, step_timeout_s, budget_s)
    log(f"device: {gpu_name}, jax {jax.__version__}; writing {run.path}")

    if study:
        STUDIES[study][0](run)
        _print_table(run)
        run.write()
        log(f"wrote {run.path} ({run.elapsed():.0f} s)")
        return 1 if any(c["passed"] is False for c in run.checks) else 0
    # Most important first: the main case's kernel (head_dim 64), its timing, then the rest.
    seq_lens = CHECK_SEQ_LENS[-2:] if quick else CHECK_SEQ_LENS
    log("correctness, default block sizes, head_dim 64:")
    for causal in (True, False):
        for seq_len in seq_lens:
            _check(run, 2, 3, seq_len, 64, causal, repeat=(seq_len == 1000 and causal))
    for causal in (True, False):
        _check(run, 1, 2, LONG_SEQ_LEN, 64, causal)
    if not check_only:
        _time_case(run, *MAIN_CASE, variants=[{}])
    log("correctness, default block sizes, head_dim 32, 128 and 256, bf16:")
    for head_dim in (32, 128, 256):
        for causal in (True, False):
            for seq_len in seq_lens:
                _check(run, 2, 3, seq_len, head_dim, causal)
    _check(run, 2, 3, 1000, 64, True, dtype=jnp.bfloat16)
    log("block-size variants at the main case:")
    for kwargs in MAIN_VARIANTS:
        passed = [_check(run, 2, 3, 1000, MAIN_CASE[3], causal, kernel_kwargs=kwargs) for causal in (True, False)]
        if not check_only and all(passed):
            _time_case(run, *MAIN_CASE, variants=[kwargs], baselines=False)
    if not check_only:
        for batch, heads, seq_len, head_dim in OTHER_TIMING_CASES:
            _time_case(run, batch, heads, seq_len, head_dim, variants=[{}])
        _print_table(run)
    else:
        _print_check_summary(run)
    run.write()
    log(f"wrote {run.path} ({run.elapsed():.0f} s)")
    return 1 if any(c["passed"] is False for c in run.checks) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer correctness lengths")
    parser.add_argument("--check", action="store_true", help="correctness only, no timing")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: results/ at the repository root)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="start no optional step after this")
    parser.add_argument("--step-timeout-s", type=float, default=90.0, help="watchdog limit per step")
    studies = parser.add_mutually_exclusive_group()
    for name, (_, text) in STUDIES.items():
        studies.add_argument(f"--{name}", action="store_true", help=text)
    args = parser.parse_args(argv)
    study = next((name for name in STUDIES if getattr(args, name)), None)
    return gpu_check_and_time(args.out, quick=args.quick, check_only=args.check, budget_s=args.budget_s,
                              step_timeout_s=args.step_timeout_s, study=study)


if __name__ == "__main__":
    sys.exit(main())
