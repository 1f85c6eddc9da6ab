"""The measured planner: for an input signature not seen on this device, time the candidate plans
(`planner.candidates`, the rules' plan first) on the device and run the fastest.

- What is timed: each candidate's compiled program on synthetic weights and input of the call's shape,
  dtype and mask kind (timing does not depend on values), back-to-back calls and one wait per round, the
  candidates in turn within each round, the fastest of the rounds: what a caller who issues calls back
  to back sees, host dispatch included.
- Correctness first: every candidate's output on that input is checked against an exact fp32 program
  (or the rules' plan, where the exact program's scores would not fit or it is still compiling when the
  candidates are done: its compile never lengthens the call) with the harness rule at half its
  tolerance; a candidate that misses is not chosen, whatever its time. The rules' plan and its scanned
  twin (the same arithmetic) are held to the rule itself, as the rules alone would run them.
- Bounded: the candidates compile side by side on several threads (`TTJ_AUTOTUNE_THREADS`, default up
  to 8) for at most `budget_s` (15 s by default) per signature; those not compiled by then are left
  unmeasured and said so (their compiles finish in the background, unused), the others are timed. The
  rules' plan is waited for past the budget: a call without measuring compiles it too.
- Persistent: the decision goes to the plan cache (plan_cache.py) under a key of the GPU, driver, jax,
  jaxlib and ttj-jax versions, the model and the input facts; jax's persistent compilation cache is
  turned on beside it, so a second process neither measures nor compiles again.
- Off (the rules alone) on the CPU, with `TTJ_AUTOTUNE=0`, or where the rules' plan has no alternative.
  One line on stderr says what is being measured (`TTJ_AUTOTUNE_QUIET=1` silences it).
- Not for the bridge's own launches: where the rules give a torch caller a stack the bridge launches
  without jax dispatch, jax-side timing would charge it jax's host cost, so the rules' plan stands.
- For a torch caller, a candidate is charged what the bridge's call of it costs: a plan whose kernels
  the caller launches itself (`planner.launched_by_caller`) its time as measured; a plan through jax at
  least its host time per call (measured: the issue of one call on an idle device) plus the bridge's own
  host time (BRIDGE_HOST_MS), since the harness sees the host wherever it is slower than the GPU.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import functools
import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ttj_jax import planner, stacks
from ttj_jax.config import Config
from ttj_jax.device import DeviceFacts, device_facts
from ttj_jax.masks import MaskKind
from ttj_jax.numerics import EXACT_FP32, get_policy, harness_check
from ttj_jax.params import init_params, prepare_weights
from ttj_jax.plan_cache import PlanCache, default_dir, enable_compilation_cache
from ttj_jax.planner import InputFacts, Plan
from ttj_jax.programs import executable, model_key

AUTOTUNE_ENV = "TTJ_AUTOTUNE"
QUIET_ENV = "TTJ_AUTOTUNE_QUIET"
THREADS_ENV = "TTJ_AUTOTUNE_THREADS"
BUDGET_S = 15.0
# Per candidate: warm-up calls, then rounds of back-to-back calls lasting about ROUND_S each.
WARMUP_CALLS = 3
ROUNDS = 5
ROUND_S = 0.02
MAX_CALLS_PER_ROUND = 200
# An alternative replaces the rules' plan only when at least this much faster (back-to-back calls move
# by ~1-2% between runs on the H200).
MIN_GAIN = 0.03
# A candidate is chosen only with every element within this share of the harness tolerance of the
# reference on the synthetic input, or within ACCURACY_SLACK times the rules' plan's own worst error on
# that input where that is larger (never beyond ACCURACY_CEILING): an alternative as accurate as the plan
# the rules would run anyway adds no risk the rules do not take. Deep models need it: at
# dec-l8-d256-hd128 (8 layers) the rules' plan measured 0.54 of the tolerance on one H100 and four
# alternatives of the same numerics were rejected at 0.53-0.56 (general-2026-12-05-h100-qkv3.json).
ACCURACY_MARGIN = 0.5
ACCURACY_SLACK = 1.1
ACCURACY_CEILING = 0.8
# The accuracy check compares the first REFERENCE_SEQUENCES sequences with an exact fp32 program while
# its explicit [B, H, S, S] scores take at most this much memory. (With a whole-batch exact program, the
# first signature of a model took 30-45 s to measure on the H200, the next ones of the same model 4-15 s.)
REFERENCE_SEQUENCES = 2
EXACT_REFERENCE_MAX_SCORE_BYTES = 1 << 30
REFERENCE_COMPILER_OPTIONS = (("xla_gpu_autotune_level", 0),)
NOT_COMPILED = "not measured: not compiled within the time budget"
# Past the budget, how long to wait for jobs still tracing (Python, holding the GIL) to reach their compile
# (which runs without it). Timing while a thread traces reads the GIL's switch interval, not the program:
# 5.65 ms for a 0.15 ms program at official shape 11 on the H200.
TRACING_GRACE_S = 5.0
# A torch caller's plan through jax costs, besides jax's dispatch, the bridge's own host time per call:
# the parameters' check, x's import, the output's export, the ordering of jax's work after torch's. A
# lower bound of what was measured: 45-110 us on the H200 host at shapes 11, 13 and 8
# (bench/results/bridge-pieces-2026-12-02-nvidia-h200.json), 72-135 us on an H100 host over five general
# configs (bridge_host_us - jax_host_us in bench/results/general-2026-12-05-h100-small.json).
BRIDGE_HOST_MS = 0.040
ISSUE_SAMPLES = 11   # single calls whose host time (median) is a plan's host time per call
# Bumped when the candidates or the timing change: older decisions then read as misses.
VERSION = 7


def enabled(device: DeviceFacts, autotune: bool | None = None) -> bool:
    """Whether to measure: `autotune` when given, else on for GPUs unless TTJ_AUTOTUNE=0."""
    if autotune is not None:
        return bool(autotune) and device.is_gpu
    return device.is_gpu and os.environ.get(AUTOTUNE_ENV, "1").strip() not in ("0", "false", "off", "no")


def cache_key(config: Config, inputs: InputFacts, device: DeviceFacts, jax_device,
              found: list[Plan] | None = None) -> dict:
    """What a decision depends on: the device and its software, the model, the input facts (a mask's kind
    only as far as it changes the masking work), the candidates, and for a torch caller how its
    candidates are charged (the stacks it launches itself, the bridge's host time)."""
    import jaxlib
    try:
        from importlib.metadata import version
        ours = version("ttj-jax")
    except Exception:   # run from a source tree without installing
        ours = "source"
    driver = getattr(getattr(jax_device, "client", None), "platform_version", "")
    mask = inputs.mask_kind.value if inputs.mask_kind not in (MaskKind.NONE, MaskKind.ALL_TRUE) else "none"
    key = {
        "device_kind": device.device_kind, "compute_capability": device.compute_capability,
        "memory_bytes": device.memory_bytes, "device_count": device.device_count, "driver": str(driver),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "ttj_jax": ours, "autotune": VERSION,
        "config": dataclasses.asdict(config),
        "inputs": {"batch_size": inputs.batch_size, "seq_len": inputs.seq_len, "dtype": inputs.dtype,
                   "mask": mask, "input_devices": inputs.input_devices},
        "candidates": [_label(p) for p in found] if found is not None else [],
    }
    if inputs.caller == "torch":   # charged as the bridge runs them (module docstring)
        key["charged_as"] = {"caller": "torch", "self_launched": sorted(inputs.self_launched),
                             "bridge_host_ms": BRIDGE_HOST_MS}
    return key


def _plan_record(chosen: Plan) -> dict:
    record = dataclasses.asdict(chosen)
    record["xla_options"] = [list(o) for o in chosen.xla_options]
    return record


def _plan_from_record(record: dict) -> Plan:
    fields = dict(record)
    fields["xla_options"] = tuple(tuple(o) for o in fields.get("xla_options", ()))
    return Plan(**fields)


def _say(message: str) -> None:
    if os.environ.get(QUIET_ENV, "").strip() not in ("1", "true", "yes"):
        print(f"ttj-jax: {message}", file=sys.stderr, flush=True)


def choose(config: Config, inputs: InputFacts, jax_device=None, *, cache: PlanCache | None = None,
           budget_s: float = BUDGET_S, autotune: bool | None = None) -> Plan:
    """The plan for this call: the fastest measured candidate (from the plan cache when decided before),
    or the rules' plan where measuring is off or there is nothing to choose between."""
    jax_device = jax_device if jax_device is not None else jax.devices()[0]
    device = device_facts(jax_device)
    rules = planner.plan(config, inputs, device)
    if not enabled(device, autotune):
        return rules
    launch = stacks.get(rules.stack).bridge_launch
    if inputs.caller == "torch" and launch is not None and launch(config, inputs.batch_size, inputs.seq_len) is None:
        return rules
    found = planner.candidates(config, inputs, device)
    if len(found) < 2:
        return rules
    cache = cache if cache is not None else _process_cache(default_dir())
    enable_compilation_cache(cache.directory)
    key = cache_key(config, inputs, device, jax_device, found)
    record = cache.get(key)
    if record is not None:
        try:
            chosen = _plan_from_record(record["plan"])
        except (KeyError, TypeError, ValueError):
            chosen = None
        if chosen is not None and chosen in found:
            return dataclasses.replace(chosen, reason=f"{chosen.reason}; {record.get('why', '')} (plan cache, "
                                                      f"measured {record.get('date', '?')})")
    chosen, why, times = measure(config, inputs, found, jax_device, budget_s=budget_s)
    cache.put(key, {"plan": _plan_record(chosen), "why": why, "times_ms": times,
                    "date": datetime.date.today().isoformat()})
    return dataclasses.replace(chosen, reason=f"{chosen.reason}; {why}")


@functools.cache
def _process_cache(directory) -> PlanCache:
    """One PlanCache per directory and process, so that a broken cache warns once, not per signature."""
    return PlanCache(directory)


def synthetic_call(config: Config, inputs: InputFacts, jax_device, seed: int = 0):
    """(params, x, mask) of the call's shape, dtype and mask kind on `jax_device`: PyTorch's default
    init, x ~ N(0, 1), a prefix or general mask with about a third of the keys invalid."""
    key = jax.random.PRNGKey(seed)
    with jax.default_device(jax_device):
        params = init_params(key, config)
        x = jax.random.normal(jax.random.fold_in(key, 1), (inputs.batch_size, inputs.seq_len, config.d_model),
                              jnp.float32).astype(inputs.dtype)
    mask = None
    if inputs.mask_kind in (MaskKind.PREFIX, MaskKind.GENERAL, MaskKind.UNKNOWN):
        rng = np.random.default_rng(seed)
        if inputs.mask_kind == MaskKind.PREFIX:
            lengths = rng.integers(max(1, (2 * inputs.seq_len) // 3), inputs.seq_len + 1, inputs.batch_size)
            host = np.arange(inputs.seq_len)[None, :] < lengths[:, None]
        else:
            host = rng.random((inputs.batch_size, inputs.seq_len)) < 0.7
        mask = jax.device_put(host, jax_device)
    elif inputs.mask_kind == MaskKind.ALL_TRUE:
        mask = jax.device_put(np.ones((inputs.batch_size, inputs.seq_len), bool), jax_device)
    return params, x, mask


def _runner(candidate: Plan, config: Config, params, prepared_by_dtype: dict):
    policy = get_policy(candidate.policy)
    dtype = policy.stored_weight_dtype.name
    if dtype not in prepared_by_dtype:
        prepared_by_dtype[dtype] = prepare_weights(params, policy)
    key_config = model_key(config)
    weights = stacks.kernel_weights(prepared_by_dtype[dtype], key_config, candidate)
    return executable(candidate, key_config), weights


def _time(fns: dict) -> dict[str, float]:
    """{label: ms per call} for each function: warm-up, then ROUNDS rounds of back-to-back calls (about
    ROUND_S each) taken in turn, one candidate after another in every round; the fastest round counts.
    Load that changes while timing (a compile past the budget still running, XLA's autotuning, another
    process) so reaches every candidate alike, not only the ones timed while it lasted."""
    calls = {}
    for label, fn in fns.items():
        for _ in range(WARMUP_CALLS):
            fn()
        start = time.perf_counter()
        jax.block_until_ready(fn())
        once = max(time.perf_counter() - start, 1e-6)
        calls[label] = int(min(MAX_CALLS_PER_ROUND, max(1, ROUND_S / once)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(ROUNDS):
        for label, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[label] - 1):
                fn()
            jax.block_until_ready(fn())
            best[label] = min(best[label], (time.perf_counter() - start) * 1e3 / calls[label])
    return best


def _issue_ms(fns: dict) -> dict[str, float]:
    """{label: host ms per call}: the median over ISSUE_SAMPLES calls of the time to issue one call
    (perf_counter around the call only), each on an idle device (the previous call waited for)."""
    issued = {}
    for label, fn in fns.items():
        samples = []
        for _ in range(ISSUE_SAMPLES):
            start = time.perf_counter()
            out = fn()
            samples.append(time.perf_counter() - start)
            jax.block_until_ready(out)
        issued[label] = float(np.median(samples)) * 1e3
    return issued


def _charged(measured: dict[str, float], accepted: dict, inputs: InputFacts) -> tuple[dict[str, float], str]:
    """({label: ms the caller is charged}, what changed, in words). A jax caller: the measured times. A
    torch caller: a plan through jax at least its host time per call plus BRIDGE_HOST_MS (the host paces
    a call whose host time exceeds its GPU time); a plan the caller launches itself as measured (an upper
    bound: the measured loop paid jax's dispatch where that paced it)."""
    if inputs.caller != "torch":
        return dict(measured), ""
    through_jax = {label: fn for label, (candidate, fn) in accepted.items()
                   if not planner.launched_by_caller(candidate, inputs)}
    issued = _issue_ms(through_jax)
    charged = {label: max(ms, issued[label] + BRIDGE_HOST_MS) if label in issued else ms
               for label, ms in measured.items()}
    raised = [f"{label} {measured[label]:.3f} to {charged[label]:.3f} ms" for label in charged
              if charged[label] > measured[label]]
    launched = [label for label in measured if label not in issued]
    note = (f"for a torch caller, plans through jax charged their host time per call plus {BRIDGE_HOST_MS * 1e3:.0f} us "
            f"of the bridge's where that exceeds their time ({'; '.join(raised) or 'none did'})"
            + (f", plans the bridge launches itself as measured ({'; '.join(launched)})" if launched else ""))
    return charged, note


def _accuracy_bound(candidate: Plan, rules: Plan, rules_worst: float | None = None) -> float:
    """The worst error (share of the harness tolerance) a candidate may show on the synthetic input: the
    rules' plan, and its scanned twin (the same products in the same order, one layer's body looped), are
    held to the harness rule itself, as the rules alone would run them; every other candidate to
    ACCURACY_MARGIN, or to ACCURACY_SLACK times the rules' plan's worst error against the same exact
    reference (`rules_worst`, None where it has none) where that is larger, at most ACCURACY_CEILING."""
    if dataclasses.replace(candidate, scan_layers=False) == rules:
        return 1.0
    if rules_worst is None:
        return ACCURACY_MARGIN
    return max(ACCURACY_MARGIN, min(ACCURACY_CEILING, rules_worst * ACCURACY_SLACK))


def measure(config: Config, inputs: InputFacts, found: list[Plan], jax_device, *,
            budget_s: float = BUDGET_S) -> tuple[Plan, str, dict]:
    """(the fastest accurate candidate, why in one sentence, {plan name: ms or a reason it has none}).
    The candidates and the reference compile side by side on `compile_threads()` threads (XLA's
    compilation runs outside the GIL), then each is checked, and those that pass are timed in turn
    (`_time`)."""
    started = time.perf_counter()
    _say(f"measuring {len(found)} plans for B={inputs.batch_size} S={inputs.seq_len} d={config.d_model} "
         f"H={config.num_heads} ffn={config.ffn_dim} L={config.num_layers} {inputs.dtype} on "
         f"{getattr(jax_device, 'device_kind', jax_device)} (at most {budget_s:.0f} s, once per signature)")
    params, x, mask = synthetic_call(config, inputs, jax_device)
    prepared_by_dtype: dict = {}
    times: dict[str, float | str] = {}
    runners = {}
    for candidate in found:
        try:
            run, weights = _runner(candidate, config, params, prepared_by_dtype)
            runners[_label(candidate)] = (run, weights, mask if candidate.mask_mode != "none" else None)
        except Exception as e:   # a candidate that does not build here is not chosen
            times[_label(candidate)] = _failed(e)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=compile_threads())
    past_budget = threading.Event()
    rules_label = _label(found[0])
    # the rules' plan never stops at the budget (a call without measuring compiles it too)
    rules_stage = _Stage(threading.Event()) if rules_label in runners else None
    # The others trace after the rules' plan: tracing holds the GIL, so jobs tracing side by side take
    # turns, and the rules' plan, the one the call waits for, got a share of it (27.9 s to compile beside
    # five others at general config enc-small-s128 on the H200).
    after = rules_stage.traced if rules_stage is not None else None
    stages = {label: rules_stage if label == rules_label else _Stage(past_budget, after) for label in runners}
    reference_stage = _Stage(threading.Event())   # submitted first, so begun first; small: never stopped
    try:
        reference_job = pool.submit(_reference, config, inputs, found[0], params, x, mask, reference_stage)
        compiled = {label: pool.submit(_compiled, run, weights, x, passed, stages[label])
                    for label, (run, weights, passed) in runners.items()}
        # Nothing is timed while compiles run: XLA's GEMM autotuning runs kernels on the same GPU, and the
        # compiles load the host. The budget bounds this wait; a candidate compiled in time is then timed
        # (a few rounds of ~20 ms), so one slow compile hides no other.
        concurrent.futures.wait(compiled.values(), timeout=max(budget_s - (time.perf_counter() - started), 0.0))
        # Past the budget: jobs not started never start, jobs still tracing stop before their compile.
        past_budget.set()
        rules_job = compiled.get(rules_label)
        for job in compiled.values():
            if job is not rules_job:
                job.cancel()
        if rules_job is not None and not rules_job.done():
            # The rules' plan is the call's own program: a call without measuring compiles it too, so
            # waiting for it adds nothing to what the call costs anyway, and the plan the rules trust is
            # never left out unmeasured (at general config enc-small-s128 on the H200 it was, and a plan
            # 30x slower in that moment's timing won).
            concurrent.futures.wait([rules_job])
        # No thread may trace while the candidates are timed, nor after the call returns: wait (a
        # little) for the tracing ones to finish; their compiles, if begun, run on without the GIL.
        grace_ends = time.perf_counter() + TRACING_GRACE_S
        begun = [stages[label] for label, job in compiled.items() if not job.cancelled()]
        for stage in (*begun, reference_stage):
            stage.traced.wait(timeout=max(grace_ends - time.perf_counter(), 0.0))
        compiled_at = time.perf_counter()
        rows = min(REFERENCE_SEQUENCES, inputs.batch_size)

        def rules_output():   # the rules' plan on x's first rows; None where its program did not compile
            if rules_job is None:   # it did not build: built here, raising as a call of it would
                run, weights = _runner(found[0], config, params, prepared_by_dtype)
                passed = mask if found[0].mask_mode != "none" else None
            else:
                try:
                    run = rules_job.result()
                except Exception:
                    return None
                _, weights, passed = runners[rules_label]
            return jax.block_until_ready(run(weights, x, passed))[:rows]
        reference, exact = _bounded_reference(reference_job, rules_output)
        referenced_at = time.perf_counter()
        accepted: dict[str, tuple[Plan, object]] = {}
        rules_worst = None   # the rules' plan's worst error against the exact reference (checked first)
        for candidate in found:
            label = _label(candidate)
            if label in times:
                continue
            job = compiled[label]
            if not job.done() or job.cancelled():
                times[label] = NOT_COMPILED
                continue
            try:
                run = job.result()
            except _Stopped:
                times[label] = NOT_COMPILED
                continue
            except Exception as e:
                times[label] = _failed(e)
                continue
            _, weights, passed = runners[label]
            try:
                out = jax.block_until_ready(run(weights, x, passed))
            except Exception as e:
                times[label] = _failed(e)
                continue
            worst = float(harness_check(out[:reference.shape[0]], reference)[1])
            if candidate is found[0] and exact:
                rules_worst = worst
            bound = _accuracy_bound(candidate, found[0], rules_worst)
            if worst > bound:
                times[label] = f"rejected: worst error {worst:.2f} of the tolerance (allowed {bound:.2f})"
                continue
            accepted[label] = (candidate, lambda run=run, weights=weights, passed=passed: run(weights, x, passed))
        measured, charge_note = _charged(_time({label: fn for label, (_, fn) in accepted.items()}), accepted, inputs)
        best: tuple[float, Plan] | None = None
        for label, (candidate, _) in accepted.items():   # in the candidates' order, the rules' plan first
            ms = times[label] = round(measured[label], 4)
            # the rules' plan (measured first) is left only for a clear gain, not for timing noise
            if best is None or ms < best[0] * (1 - MIN_GAIN if best[1] is found[0] else 1):
                best = (ms, candidate)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)   # a compile past the budget finishes unheeded
    if best is None:   # none measured: the rules' plan (a call that cannot build it raises its own error)
        return found[0], f"measuring failed; the rules' plan ({'; '.join(f'{k} {v}' for k, v in times.items())})", times
    ms, chosen = best
    others = "; ".join(f"{name} {value if isinstance(value, str) else f'{value:.3f} ms'}"
                       for name, value in times.items() if name != _label(chosen))
    checked = "exact fp32" if exact else "the rules' plan"
    if chosen is found[0]:
        why = (f"measured: the rules' plan kept, {ms:.3f} ms, no alternative {MIN_GAIN:.0%} faster (checked against "
               f"{checked}; {others})")
    else:
        why = (f"measured fastest of {len(found)} candidates on this device, {ms:.3f} ms (checked against "
               f"{checked}; {others})")
    ended = time.perf_counter()
    phases = (f"{ended - started:.1f} s: {compiled_at - started:.1f} s to the end of the compiles, the budget or the "
              f"rules' plan's compile, "
              f"{referenced_at - compiled_at:.1f} s more for the reference, {ended - referenced_at:.1f} s "
              "checking and timing")
    if charge_note:
        why = f"{why}; {charge_note}"
    why = f"{why}; decided in {phases}"
    _say(f"chose {_label(chosen)} ({ms:.3f} ms) in {phases}")
    return chosen, why, times


def _bounded_reference(reference_job, rules_output):
    """(reference output, whether it is exact fp32) without waiting past the compiles: the exact program's
    output (reference_job's: None where its scores would not fit) where it is ready, else the rules'
    plan's (rules_output(), compiled by now), so the exact program's own compile never lengthens the
    call. Waits for the exact program only where the rules' plan has no compiled program to stand in."""
    exact = reference_job.result() if reference_job.done() else None
    if exact is not None:
        return exact, True
    rules = rules_output()
    if rules is not None:
        return rules, False
    exact = reference_job.result()
    if exact is None:
        raise RuntimeError("measuring has no reference: the rules' plan did not compile and the exact "
                           "program's scores would not fit")
    return exact, True


def compile_threads() -> int:
    """Threads compiling the candidates side by side: TTJ_AUTOTUNE_THREADS, else up to 8 (one per
    candidate and the reference, at most the CPU count)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"{THREADS_ENV} must be a positive integer; got {value!r}") from None
    return max(1, min(8, os.cpu_count() or 1))


class _Stage:
    """Where a compile job stands: `traced` is set once its Python tracing (which holds the GIL) is over,
    whether it then compiles or not; `stop` set before its compile begins skips the compile; `after`,
    when given, is waited for before tracing begins."""

    def __init__(self, stop: threading.Event, after: threading.Event | None = None):
        self.stop = stop
        self.after = after       # tracing begins once this is set
        self.traced = threading.Event()


class _Stopped(Exception):
    """A compile skipped: the budget ended before it began."""


def _compiled(run, weights, x, mask, stage: _Stage | None = None):
    """run compiled for these arguments ahead of its first call (a jitted function), else run itself.
    The tracing holds the GIL, the compile runs without it; past `stage.stop` no compile begins."""
    lower = getattr(run, "lower", None)
    if stage is not None and stage.after is not None:
        stage.after.wait()
    if stage is not None and stage.stop.is_set():   # past the budget before its tracing began
        stage.traced.set()
        raise _Stopped(NOT_COMPILED)
    try:
        lowered = None if lower is None else lower(weights, x, mask)
    finally:
        if stage is not None:
            stage.traced.set()
    if lowered is None:
        return run
    if stage is not None and stage.stop.is_set():
        raise _Stopped(NOT_COMPILED)
    return lowered.compile()


def _failed(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _label(candidate: Plan) -> str:
    return candidate.name + ("+cublas" if candidate.xla_options else "")


def _reference(config, inputs, rules: Plan, params, x, mask, stage: _Stage | None = None):
    """The exact fp32 program's output on the first REFERENCE_SEQUENCES sequences (compiled without XLA's
    GEMM autotuning: it runs once), or None where its explicit scores would not fit (the rules' plan's
    output, which measure() has anyway, checks the others then)."""
    rows = min(REFERENCE_SEQUENCES, inputs.batch_size)
    if 4 * rows * config.num_heads * inputs.seq_len ** 2 > EXACT_REFERENCE_MAX_SCORE_BYTES:
        if stage is not None:
            stage.traced.set()
        return None
    exact = dataclasses.replace(rules, policy=EXACT_FP32.name, attention="xla", stack="layers",
                                xla_options=(), mask_mode="keys" if mask is not None else "none",
                                reason="reference")
    run = executable(exact, model_key(config), compiler_options=REFERENCE_COMPILER_OPTIONS)
    args = (params, x[:rows].astype(jnp.float32), None if mask is None else mask[:rows])
    return jax.block_until_ready(_compiled(run, *args, stage)(*args))


def exact_output(config: Config, plan: Plan, params, x, mask):
    """The exact fp32 program's output on the first REFERENCE_SEQUENCES sequences of x (params: the raw
    parameter tree), or None where its explicit scores would not fit. What a plan's output is checked
    against; the bridge checks its own launches of a plan's kernels with it too."""
    inputs = InputFacts(batch_size=x.shape[0], seq_len=x.shape[1], dtype=str(x.dtype),
                        mask_kind=MaskKind.NONE if mask is None else MaskKind.UNKNOWN, caller="jax")
    return _reference(config, inputs, plan, params, x, mask)


def warm(calls, *, caller: str = "torch", cache: PlanCache | None = None, jax_device=None,
         self_launched=None) -> list[Plan]:
    """Decides ahead of time: `calls` is an iterable of (config, batch_size, seq_len, dtype, mask_kind)
    (config a Config or anything Config.from_object takes); returns the plans chosen, one per call.
    self_launched: for a torch caller, a function (config, batch_size, seq_len) -> the stacks the caller
    launches itself (the bridge's `bridge.direct.self_launched_stacks` for its device), so that the
    decision is the one the bridge's own call looks up."""
    chosen = []
    for config, batch, seq_len, dtype, kind in calls:
        config = Config.from_object(config)
        launched = tuple(self_launched(config, batch, seq_len)) if self_launched is not None else ()
        facts = InputFacts(batch_size=batch, seq_len=seq_len, dtype=str(np.dtype(dtype)), mask_kind=MaskKind(kind),
                           caller=caller, self_launched=launched)
        chosen.append(choose(config, facts, jax_device, cache=cache))
    return chosen
