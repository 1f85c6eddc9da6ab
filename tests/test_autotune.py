"""The measured planner (autotune.py), its on-disk plan cache (plan_cache.py) and forced device facts
(device.py), on the CPU: the timing machinery runs on two cheap XLA plans, the GPU's candidates are
checked as a pure function, and the cache under every failure it must survive."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import stat
import time
import types
import warnings

import jax
import pytest

import ttj_jax as T
from ttj_jax import autotune, planner
from ttj_jax.device import FORCE_DEVICE_ENV, DeviceFacts, device_facts, forced_compute_capability
from ttj_jax.plan_cache import PlanCache, PlanCacheWarning

H200 = DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=140 * 2**30, compute_capability="9.0")
A100 = DeviceFacts(platform="gpu", device_kind="NVIDIA A100", memory_bytes=40 * 2**30, compute_capability="8.0")
L4 = DeviceFacts(platform="gpu", device_kind="NVIDIA L4", memory_bytes=24 * 2**30, compute_capability="8.9")
SMALL = T.Config(batch_size=2, seq_len=16, d_model=32, num_heads=2, ffn_dim=64, num_layers=2, causal=True)


def _facts(config, dtype="float32", kind=T.MaskKind.ALL_TRUE, caller="jax"):
    return T.InputFacts(batch_size=config.batch_size, seq_len=config.seq_len, dtype=dtype, mask_kind=kind,
                        caller=caller)


# ---- the plan cache ----

KEY = {"device_kind": "NVIDIA H200", "config": {"d_model": 128}, "inputs": {"batch_size": 64}}


def test_cache_round_trip_and_keys(tmp_path):
    cache = PlanCache(tmp_path)
    assert cache.get(KEY) is None
    assert cache.put(KEY, {"plan": {"stack": "rows"}, "times_ms": {"a": 1.0}})
    assert PlanCache(tmp_path).get(KEY) == {"plan": {"stack": "rows"}, "times_ms": {"a": 1.0}}
    other = {**KEY, "inputs": {"batch_size": 32}}
    assert PlanCache(tmp_path).get(other) is None   # every key field counts
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1


def test_cache_directory_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TTJ_CACHE_DIR", str(tmp_path / "from-env"))
    assert PlanCache().directory == tmp_path / "from-env"
    monkeypatch.delenv("TTJ_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert PlanCache().directory == tmp_path / "xdg" / "ttj-jax"
    assert PlanCache(tmp_path / "arg").directory == tmp_path / "arg"   # the argument wins


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]), json.dumps({"format": 999, "record": {}})])
def test_a_corrupt_cache_file_warns_once_and_reads_as_a_miss(tmp_path, content):
    cache = PlanCache(tmp_path)
    cache.put(KEY, {"plan": {}})
    cache.path_for(KEY).write_text(content)
    with pytest.warns(PlanCacheWarning, match="going on without it"):
        assert cache.get(KEY) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # once per cache: the second read is silent
        assert cache.get(KEY) is None
    assert cache.put(KEY, {"plan": {"stack": "fused"}}) and cache.get(KEY) == {"plan": {"stack": "fused"}}


def test_a_stale_file_under_the_same_name_is_a_miss(tmp_path):
    cache = PlanCache(tmp_path)
    cache.put(KEY, {"plan": {}})
    stored = json.loads(cache.path_for(KEY).read_text())
    stored["key"]["device_kind"] = "another GPU"
    cache.path_for(KEY).write_text(json.dumps(stored))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(KEY) is None


def test_an_unwritable_cache_directory_warns_and_never_raises(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")   # a directory under a regular file cannot be made, whoever asks (root too)
    cache = PlanCache(blocker / "cache")
    with pytest.warns(PlanCacheWarning, match="cannot write"):
        assert cache.put(KEY, {"plan": {}}) is False
    assert cache.get(KEY) is None


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_read_only_cache_directory_leaves_no_temporary_file(tmp_path):
    root = tmp_path / "ro"
    (root / "plans").mkdir(parents=True)
    (root / "plans").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(root / "plans", os.W_OK):   # root ignores the mode: make the rename fail instead
            PlanCache(root).path_for(KEY).mkdir()
        with pytest.warns(PlanCacheWarning, match="cannot write"):
            assert PlanCache(root).put(KEY, {"plan": {}}) is False
        assert not list((root / "plans").glob(".*.tmp"))
    finally:
        (root / "plans").chmod(stat.S_IRWXU)


def _writer(args):
    directory, worker = args
    cache = PlanCache(directory)
    for i in range(40):
        assert cache.put({"shared": True}, {"worker": worker, "i": i, "pad": "x" * 2000})
        assert cache.put({"worker": worker, "i": i}, {"worker": worker, "i": i})
        got = cache.get({"shared": True})
        assert got is not None and set(got) == {"worker", "i", "pad"}   # never a torn read
    return worker


def test_concurrent_writers_lose_nothing(tmp_path):
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert sorted(pool.map(_writer, [(str(tmp_path), w) for w in range(4)])) == [0, 1, 2, 3]
    cache = PlanCache(tmp_path)
    for worker in range(4):
        for i in range(40):
            assert cache.get({"worker": worker, "i": i}) == {"worker": worker, "i": i}
    assert cache.get({"shared": True})["worker"] in range(4)
    assert not list((tmp_path / "plans").glob(".*.tmp"))


# ---- forced device facts ----

def _fake_gpu(capability="9.0"):
    return types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200", compute_capability=capability,
                                 memory_stats=lambda: {"bytes_limit": 140 * 2**30})


def test_forced_device_facts(monkeypatch):
    monkeypatch.delenv(FORCE_DEVICE_ENV, raising=False)
    monkeypatch.setattr(jax, "devices", lambda *a: [_fake_gpu()])
    assert forced_compute_capability() is None and device_facts(_fake_gpu()).is_hopper
    monkeypatch.setenv(FORCE_DEVICE_ENV, "sm_80")
    facts = device_facts(_fake_gpu())
    assert facts.compute_capability == "8.0" and not facts.is_hopper and "planned as sm_80" in facts.device_kind
    monkeypatch.setenv(FORCE_DEVICE_ENV, "sm_89")
    assert device_facts(_fake_gpu()).compute_capability == "8.9"
    monkeypatch.setenv(FORCE_DEVICE_ENV, "sm_75x")
    with pytest.raises(ValueError, match="TTJ_FORCE_DEVICE"):
        device_facts(_fake_gpu())
    monkeypatch.setenv(FORCE_DEVICE_ENV, "sm_80")
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu", memory_stats=lambda: None)
    assert device_facts(cpu).compute_capability == ""   # a CPU is not forced


@pytest.mark.parametrize("facts", [A100, L4], ids=["sm_80", "sm_89"])
def test_without_hopper_no_plan_or_candidate_dispatches_a_hopper_only_kernel(facts):
    suites = {**T.OFFICIAL, **getattr(T.shapes, "GENERAL", {})}
    for sid, shape in suites.items():
        config = shape.config
        for kind in (T.MaskKind.ALL_TRUE, T.MaskKind.PREFIX):
            for caller in ("jax", "torch"):
                inputs = _facts(config, kind=kind, caller=caller)
                for candidate in planner.candidates(config, inputs, facts):
                    assert candidate.stack != "fused_mgpu", (sid, candidate.name)
                    assert "Hopper" not in candidate.reason and "sm_90" not in candidate.reason, (sid, candidate.reason)


def test_the_masked_mosaic_build_is_a_candidate_only_in_builds_that_have_run_on_a_gpu():
    """On Hopper, a torch call that needs key masking in a build that has run with a mask on a GPU (shape
    2's model, causal, with a mask with holes) has the Mosaic kernel's masked build as its plan; a JAX
    caller (no bridge launch) has it among the candidates timed beside the rules' plan; a build that has
    not run (the same model without causal attention, a padded mask) is no candidate: by request only."""
    shape_2 = T.OFFICIAL["2"].config
    noncausal = dataclasses.replace(shape_2, causal=False)
    for config, kind in ((shape_2, T.MaskKind.GENERAL), (noncausal, T.MaskKind.PREFIX)):
        for caller in ("jax", "torch"):
            plans = planner.candidates(config, _facts(config, kind=kind, caller=caller), H200)
            assert plans and plans[0].mask_mode == "keys"
            mosaic = [p for p in plans if p.stack == "fused_mgpu"]
            if config.causal:   # the rules' plan for a torch caller; timed beside the rules' plan for jax
                assert (plans[0].stack == "fused_mgpu") == (caller == "torch") and mosaic, [p.name for p in plans]
            else:
                assert not mosaic, [p.name for p in plans]
    assert planner.candidates(shape_2, _facts(shape_2, caller="torch"), H200)[0].stack == "fused_mgpu"


def test_the_bridge_does_not_launch_mosaic_kernels_under_forced_facts(monkeypatch):
    import torch

    from bridge import mosaic_launch
    monkeypatch.setenv(FORCE_DEVICE_ENV, "sm_80")
    assert "sm_90" in mosaic_launch.unavailable_reason(torch.device("cuda", 0))


def test_the_kernels_hopper_dispatch_follows_forced_facts(monkeypatch):
    from ttj_jax import device
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_fake_gpu()])
    assert device.default_device_is_hopper()
    monkeypatch.setenv(FORCE_DEVICE_ENV, "sm_80")
    assert not device.default_device_is_hopper()


# ---- candidates (pure) ----

def test_candidates_start_with_the_rules_plan_and_are_bounded():
    for shape in T.OFFICIAL.values():
        config = shape.config
        for facts in (H200, A100):
            for kind in (T.MaskKind.ALL_TRUE, T.MaskKind.PREFIX, T.MaskKind.GENERAL):
                inputs = _facts(config, kind=kind)
                found = planner.candidates(config, inputs, facts)
                assert found[0] == T.plan(config, inputs, facts)
                assert 1 <= len(found) <= planner.MAX_CANDIDATES
                assert len({(p.name, p.xla_options) for p in found}) == len(found)
                for p in found:
                    if p.attention == "cudnn":   # (a key mask as its bias: layers.cudnn_attention)
                        assert config.head_dim in planner.CUDNN_HEAD_DIMS
                    if p.attention == "xla":
                        assert 4 * config.batch_size * config.num_heads * config.seq_len ** 2 \
                            <= planner.XLA_ATTENTION_MAX_SCORE_BYTES
    assert planner.candidates(SMALL, _facts(SMALL), planner.CPU) == [T.plan(SMALL, _facts(SMALL))]


def test_candidates_include_the_gemm_bound_numerics_and_cudnn_for_a_bert_like_model():
    bert = T.Config(batch_size=32, seq_len=512, d_model=768, num_heads=12, ffn_dim=3072, num_layers=2, causal=False)
    found = planner.candidates(bert, _facts(bert), H200)
    names = {(p.attention, p.policy) for p in found}
    assert {("pallas", "mixed_fp16"), ("pallas", planner.GEMM_BOUND_POLICY), ("cudnn", "mixed_fp16")} <= names
    # and each attention's program in the peer's numerics, on cuBLAS
    peers = [p for p in found if p.policy == planner.PEER_NUMERICS_POLICY]
    assert {p.attention for p in peers} == {"pallas", "cudnn"}
    assert all(p.xla_options == planner.GEMM_BOUND_XLA_OPTIONS and p.qkv_gemms == 1 for p in peers)
    assert len(found) <= planner.MAX_CANDIDATES
    # beside cuDNN's GEMM-bound plan, its twin with q, k and v by three GEMMs, kept apart from XLA's merger
    [three] = [p for p in found if p.qkv_gemms == 3]
    assert (three.attention, three.policy, three.xla_options) == ("cudnn", planner.GEMM_BOUND_POLICY,
                                                                  planner.QKV_SPLIT_XLA_OPTIONS)
    assert autotune._plan_from_record(json.loads(json.dumps(autotune._plan_record(three)))) == three
    # a key-masked call (any mask, or one the device decides) has the same cuDNN plans, masking keys
    for kind in (T.MaskKind.GENERAL, T.MaskKind.UNKNOWN):
        masked = planner.candidates(bert, _facts(bert, kind=kind), H200)
        assert masked[0].attention == "pallas" and masked[0].mask_mode in planner.KEY_MASK_MODES
        cudnn = [p for p in masked if p.attention == "cudnn"]
        assert {(p.policy, p.qkv_gemms) for p in cudnn} >= {("mixed_fp16", 1), (planner.GEMM_BOUND_POLICY, 3)}
        assert all(p.mask_mode == masked[0].mask_mode for p in cudnn)


# ---- measuring (CPU: two XLA plans stand in for a GPU's candidates) ----

def _cpu_candidates(config, inputs, device):
    rules = T.plan(config, inputs, planner.CPU)
    return [rules, dataclasses.replace(rules, policy="exact_fp32", reason="exact")]


@pytest.fixture
def measuring_on_cpu(monkeypatch, tmp_path):
    """autotune.choose on the CPU as on a GPU: measuring enabled, CPU stand-ins for the candidates."""
    monkeypatch.setattr(autotune, "enabled", lambda device, autotune=None: autotune is not False)
    monkeypatch.setattr(planner, "candidates", _cpu_candidates)
    monkeypatch.setenv("TTJ_AUTOTUNE_QUIET", "1")
    monkeypatch.setattr(autotune, "enable_compilation_cache", lambda directory: None)
    return PlanCache(tmp_path)


def test_choose_measures_once_then_reads_the_cache(measuring_on_cpu, monkeypatch):
    cache = measuring_on_cpu
    inputs = _facts(SMALL)
    chosen = autotune.choose(SMALL, inputs, cache=cache)
    assert chosen in _cpu_candidates(SMALL, inputs, None)
    assert "measured" in chosen.explain() and " ms" in chosen.explain()
    # where the measuring's time went, for a first call that takes longer than the budget
    assert "to the end of the compiles, the budget or the rules" in chosen.explain() and "for the reference" in chosen.explain()
    [stored] = [json.loads(p.read_text()) for p in (cache.directory / "plans").glob("*.json")]
    assert set(stored["record"]["times_ms"]) == {autotune._label(p) for p in _cpu_candidates(SMALL, inputs, None)}
    assert all(isinstance(v, float) and v > 0 for v in stored["record"]["times_ms"].values())

    def no_measuring(*a, **k):
        raise AssertionError("measured again despite the cache")
    monkeypatch.setattr(autotune, "measure", no_measuring)
    again = autotune.choose(SMALL, inputs, cache=PlanCache(cache.directory))   # a second process's view
    assert dataclasses.replace(again, reason="") == dataclasses.replace(chosen, reason="")
    assert "plan cache" in again.explain()
    # another input signature is measured anew
    with pytest.raises(AssertionError, match="measured again"):
        autotune.choose(SMALL, _facts(SMALL, kind=T.MaskKind.PREFIX), cache=cache)


def test_choose_recovers_from_a_corrupt_cache(measuring_on_cpu):
    cache = measuring_on_cpu
    inputs = _facts(SMALL)
    autotune.choose(SMALL, inputs, cache=cache)
    for path in (cache.directory / "plans").glob("*.json"):
        path.write_text("garbage")
    with pytest.warns(PlanCacheWarning):
        chosen = autotune.choose(SMALL, inputs, cache=PlanCache(cache.directory))
    assert "measured" in chosen.explain() and "plan cache" not in chosen.explain()


def test_autotune_false_and_the_environment_keep_the_rules(measuring_on_cpu, monkeypatch):
    inputs = _facts(SMALL)
    assert autotune.choose(SMALL, inputs, cache=measuring_on_cpu, autotune=False) == T.plan(SMALL, inputs)
    monkeypatch.undo()
    monkeypatch.setenv("TTJ_AUTOTUNE", "0")
    assert not autotune.enabled(H200)
    monkeypatch.setenv("TTJ_AUTOTUNE", "1")
    assert autotune.enabled(H200) and not autotune.enabled(planner.CPU)


def test_an_inaccurate_candidate_is_never_chosen(measuring_on_cpu, monkeypatch):
    real_runner = autotune._runner

    def runner(candidate, config, params, prepared):
        run, weights = real_runner(candidate, config, params, prepared)
        if candidate.policy == "exact_fp32":   # the faster-looking candidate returns garbage
            return (lambda w, x, m: run(w, x, m) + 1.0), weights
        return run, weights
    monkeypatch.setattr(autotune, "_runner", runner)
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0])
    assert chosen == found[0]
    assert times[autotune._label(found[1])].startswith("rejected")


def test_the_rules_scanned_twin_is_held_to_the_rule_itself(measuring_on_cpu, monkeypatch):
    """Off by 0.7 of the tolerance (over the 0.5 margin, under the rule): the rules' plan's scanned twin,
    the same arithmetic, is timed as the rules' plan would be; another candidate is rejected."""
    rules = T.plan(SMALL, _facts(SMALL), planner.CPU)
    twin = dataclasses.replace(rules, scan_layers=True)
    other = dataclasses.replace(rules, policy="exact_fp32", reason="exact")
    assert autotune._accuracy_bound(twin, rules) == 1.0 == autotune._accuracy_bound(rules, rules)
    assert autotune._accuracy_bound(other, rules) == autotune.ACCURACY_MARGIN
    real_runner = autotune._runner

    def runner(candidate, config, params, prepared):
        run, weights = real_runner(candidate, config, params, prepared)
        if candidate in (twin, other):
            return (lambda w, x, m: run(w, x, m) + 0.7 * T.numerics.HARNESS_ATOL), weights
        return run, weights
    monkeypatch.setattr(autotune, "_runner", runner)
    _, _, times = autotune.measure(SMALL, _facts(SMALL), [rules, twin, other], jax.devices()[0])
    assert isinstance(times[autotune._label(twin)], float)
    rejected = times[autotune._label(other)]
    assert rejected.startswith("rejected: worst error ")
    # 0.7 of the tolerance against the rules' plan, about that against the exact reference
    assert autotune.ACCURACY_MARGIN < float(rejected.split()[3]) < 1.0


def test_an_alternative_as_accurate_as_the_rules_plan_is_not_rejected(measuring_on_cpu, monkeypatch):
    """Where the rules' plan itself is off by more than the 0.5 margin (deep models), an alternative within
    ACCURACY_SLACK of its worst error is timed (the old fixed margin rejected it), and nothing past
    ACCURACY_CEILING is allowed whatever the rules' plan shows."""
    rules = T.plan(SMALL, _facts(SMALL), planner.CPU)
    near = dataclasses.replace(rules, policy="exact_fp32", reason="exact")
    far = dataclasses.replace(rules, policy="tf32", reason="tf32")
    assert autotune._accuracy_bound(near, rules, 0.6) == pytest.approx(0.6 * autotune.ACCURACY_SLACK)
    assert autotune._accuracy_bound(near, rules, 0.2) == autotune.ACCURACY_MARGIN
    assert autotune._accuracy_bound(near, rules, 0.95) == autotune.ACCURACY_CEILING
    assert autotune._accuracy_bound(near, rules, None) == autotune.ACCURACY_MARGIN
    assert autotune._accuracy_bound(rules, rules, 0.2) == 1.0
    offsets = {rules: 0.6, near: 0.6, far: 0.9}   # near: exact arithmetic, off as much as the rules' plan
    real_runner = autotune._runner

    def runner(candidate, config, params, prepared):
        run, weights = real_runner(candidate, config, params, prepared)
        return (lambda w, x, m: run(w, x, m) + offsets[candidate] * T.numerics.HARNESS_ATOL), weights
    monkeypatch.setattr(autotune, "_runner", runner)
    _, _, times = autotune.measure(SMALL, _facts(SMALL), [rules, near, far], jax.devices()[0])
    assert isinstance(times[autotune._label(rules)], float)
    assert isinstance(times[autotune._label(near)], float), times
    assert times[autotune._label(far)].startswith("rejected: worst error "), times
    assert "(allowed " in times[autotune._label(far)]


def test_candidates_are_timed_in_turn_within_each_round(monkeypatch):
    """Each round times every candidate once, one after another, so a load that comes and goes while
    timing (a compile past the budget) reaches all of them, not only the first ones."""
    calls = []

    def fn(label):
        def run():
            calls.append(label)
            return jax.numpy.zeros(())
        return run
    monkeypatch.setattr(autotune, "ROUND_S", 0.0)   # one call per round
    times = autotune._time({"a": fn("a"), "b": fn("b"), "c": fn("c")})
    assert set(times) == {"a", "b", "c"} and all(t > 0 for t in times.values())
    calibration = autotune.WARMUP_CALLS + 1
    assert calls[:3 * calibration] == ["a"] * calibration + ["b"] * calibration + ["c"] * calibration
    assert calls[3 * calibration:] == ["a", "b", "c"] * autotune.ROUNDS


def _slowed(monkeypatch, found, slow_candidate=None, slow_reference=False, delay=6.0, tracing=False):
    """autotune's compiles of `slow_candidate` (and/or of the exact reference) made `delay` s slower: in
    their compile stage (without the GIL), or with tracing=True while they trace (holding it)."""
    real_compiled, real_runner, real_reference = autotune._compiled, autotune._runner, autotune._reference
    slow_run = [None]

    def compiled(run, weights, x, mask, stage=None):
        if slow_run[0] is not None and run is slow_run[0]:
            if stage is not None and not tracing:
                stage.traced.set()
            time.sleep(delay)
        return real_compiled(run, weights, x, mask, stage)

    def runner(candidate, config, params, prepared):
        run, weights = real_runner(candidate, config, params, prepared)
        if candidate == slow_candidate:
            slow_run[0] = run
        return run, weights

    def reference(*args):
        if slow_reference:
            time.sleep(delay)
        return real_reference(*args)
    monkeypatch.setattr(autotune, "_compiled", compiled)
    monkeypatch.setattr(autotune, "_runner", runner)
    monkeypatch.setattr(autotune, "_reference", reference)


def test_the_budget_bounds_the_wait_for_an_alternative(measuring_on_cpu, monkeypatch):
    """An alternative still compiling when the budget ends is left unmeasured; the rules' plan is timed,
    and the call does not wait for the slow compile."""
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    _slowed(monkeypatch, found, slow_candidate=found[1])
    start = time.perf_counter()
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0], budget_s=2.5)
    assert time.perf_counter() - start < 5.5
    assert times[autotune._label(found[1])] == autotune.NOT_COMPILED
    assert isinstance(times[autotune._label(found[0])], float) and chosen == found[0]


def test_the_rules_plan_is_waited_for_past_the_budget(measuring_on_cpu, monkeypatch):
    """The rules' plan, the program a call without measuring compiles anyway, is never left unmeasured:
    past the budget the measuring waits for its compile, then times it beside the alternative."""
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    _slowed(monkeypatch, found, slow_candidate=found[0], delay=4.0)
    start = time.perf_counter()
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0], budget_s=1.0)
    assert time.perf_counter() - start >= 4.0
    assert all(isinstance(times[autotune._label(c)], float) for c in found), times
    assert "the rules' plan's compile" in why


def test_no_candidate_traces_while_others_are_timed(measuring_on_cpu, monkeypatch):
    """A candidate still tracing (holding the GIL) when the budget ends is waited for, up to
    TRACING_GRACE_S, before anything is timed, and its compile never begins: timing beside a tracing
    thread reads the GIL's switch interval, not the program."""
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    _slowed(monkeypatch, found, slow_candidate=found[1], delay=2.0, tracing=True)
    start = time.perf_counter()
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0], budget_s=0.5)
    assert 2.0 <= time.perf_counter() - start < 2.0 + autotune.TRACING_GRACE_S
    assert times[autotune._label(found[1])] == autotune.NOT_COMPILED and chosen == found[0]


def test_the_rules_plan_traces_before_the_others(measuring_on_cpu, monkeypatch):
    """Tracing holds the GIL: the rules' plan, the program the call waits for, traces first and alone;
    the alternatives begin theirs once it is over."""
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    spans, real_runner = {}, autotune._runner

    class Traced:   # a jitted function whose tracing is slow and recorded
        def __init__(self, run, label):
            self.run, self.label = run, label

        def __call__(self, *args):
            return self.run(*args)

        def lower(self, *args):
            start = time.perf_counter()
            time.sleep(0.4)
            lowered = self.run.lower(*args)
            spans[self.label] = (start, time.perf_counter())
            return lowered
    monkeypatch.setattr(autotune, "_runner", lambda candidate, *rest: (
        lambda run, weights: (Traced(run, autotune._label(candidate)), weights))(*real_runner(candidate, *rest)))
    monkeypatch.setenv(autotune.THREADS_ENV, "4")
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0])
    rules, other = (spans[autotune._label(c)] for c in found)
    assert rules[1] <= other[0]
    assert all(isinstance(times[autotune._label(c)], float) for c in found), times


def test_the_rules_plan_queued_at_the_budget_still_compiles(measuring_on_cpu, monkeypatch):
    """One compile thread, its reference past the budget: the rules' plan, still queued then, is not
    cancelled with the alternatives; it compiles and is measured."""
    monkeypatch.setenv(autotune.THREADS_ENV, "1")
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    _slowed(monkeypatch, found, slow_reference=True, delay=2.0)
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0], budget_s=0.5)
    assert isinstance(times[autotune._label(found[0])], float), times
    assert times[autotune._label(found[1])] == autotune.NOT_COMPILED and chosen == found[0]


def test_without_an_exact_reference_the_rules_plan_checks_the_others_built_once(measuring_on_cpu, monkeypatch):
    """Where the exact program's scores would not fit, the rules' plan's own output, from its one compile,
    checks the others: it is not built a second time for the reference."""
    monkeypatch.setattr(autotune, "EXACT_REFERENCE_MAX_SCORE_BYTES", 0)
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    built, real_runner = [], autotune._runner

    def runner(candidate, *rest):
        built.append(candidate)
        return real_runner(candidate, *rest)
    monkeypatch.setattr(autotune, "_runner", runner)
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0])
    assert "checked against the rules' plan" in why
    assert built.count(found[0]) == 1
    assert all(isinstance(times[autotune._label(c)], float) for c in found), times


def test_a_slow_exact_reference_never_lengthens_the_call(measuring_on_cpu, monkeypatch):
    """The exact reference still compiling when the candidates are done: the rules' plan's output
    checks the others instead (said in explain), and the call does not wait for the reference."""
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    _slowed(monkeypatch, found, slow_reference=True, delay=8.0)
    start = time.perf_counter()
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0], budget_s=1.0)
    assert time.perf_counter() - start < 6.0
    assert "checked against the rules' plan" in why
    assert all(isinstance(times[autotune._label(c)], float) for c in found), times


def test_warm_decides_ahead_of_time(measuring_on_cpu):
    plans = autotune.warm([(SMALL, 2, 16, "float32", "all_true"), (SMALL, 4, 8, "float32", "prefix")],
                          cache=measuring_on_cpu)
    assert len(plans) == 2 and all("measured" in p.explain() for p in plans)
    assert len(list((measuring_on_cpu.directory / "plans").glob("*.json"))) == 2


def test_the_cache_key_names_device_software_model_and_inputs():
    key = autotune.cache_key(SMALL, _facts(SMALL), H200, jax.devices()[0])
    assert {"device_kind", "compute_capability", "driver", "jax", "jaxlib", "ttj_jax", "config", "inputs",
            "candidates"} <= set(key)
    none = autotune.cache_key(SMALL, _facts(SMALL, kind=T.MaskKind.NONE), H200, jax.devices()[0])
    assert none == key   # no mask and an all-True mask plan the same
    assert autotune.cache_key(SMALL, _facts(SMALL, dtype="float16"), H200, jax.devices()[0]) != key
    assert autotune.cache_key(SMALL, _facts(SMALL), A100, jax.devices()[0]) != key
    # a torch caller's plans through jax are charged the bridge's host time: its decisions are its own
    assert autotune.cache_key(SMALL, _facts(SMALL, caller="torch"), H200, jax.devices()[0]) != key
    found = planner.candidates(SMALL, _facts(SMALL), H200)
    assert autotune.cache_key(SMALL, _facts(SMALL), H200, jax.devices()[0], found) != key   # the candidates count


def test_ttj_bench_warm_decides_the_suites_plans_into_the_cache(measuring_on_cpu, monkeypatch, capsys):
    from bench import cli
    monkeypatch.setenv("TTJ_CACHE_DIR", str(measuring_on_cpu.directory))
    assert cli.main(["--warm", "--suite", "small", "--shapes", "cpu-2,cpu-12"]) == 0
    printed = capsys.readouterr().out
    lines = [line for line in printed.splitlines() if line.startswith(("cpu-2:", "cpu-12:"))]
    # one line per shape, each a measured decision ("not measured" may also appear, for candidates a
    # loaded machine did not compile within the budget)
    decided = ("measured fastest of", "measured: the rules' plan kept")
    assert len(lines) == 2 and all(any(d in line for d in decided) for line in lines), printed
    assert len(list((measuring_on_cpu.directory / "plans").glob("*.json"))) == 2
    assert cli.main(["--warm", "--suite", "small", "--shapes", "cpu-2"]) == 0
    assert "plan cache" in capsys.readouterr().out   # the second time, read back


def test_the_compilation_cache_is_left_to_a_user_who_set_one_or_opted_out(tmp_path, monkeypatch):
    from ttj_jax import plan_cache
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
        assert plan_cache.enable_compilation_cache(tmp_path) == str(tmp_path / "theirs")
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("TTJ_COMPILATION_CACHE", "0")
        assert plan_cache.enable_compilation_cache(tmp_path) is None and not (tmp_path / "xla").exists()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.mark.parametrize("threads", ["1", "4"])
def test_candidates_compile_side_by_side_on_the_threads_given(measuring_on_cpu, monkeypatch, threads):
    monkeypatch.setenv(autotune.THREADS_ENV, threads)
    spans, real, real_runner, candidate_runs = [], autotune._compiled, autotune._runner, []

    def runner(candidate, config, params, prepared):
        run, weights = real_runner(candidate, config, params, prepared)
        candidate_runs.append(run)
        return run, weights

    def slow_compile(run, weights, x, mask, stage=None):
        start = time.perf_counter()
        time.sleep(0.3)
        out = real(run, weights, x, mask, stage)
        if any(run is r for r in candidate_runs):   # the candidates', not the exact reference's
            spans.append((start, time.perf_counter()))
        return out
    monkeypatch.setattr(autotune, "_runner", runner)
    monkeypatch.setattr(autotune, "_compiled", slow_compile)
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0])
    assert all(isinstance(times[autotune._label(p)], float) for p in found)
    (a0, a1), (b0, b1) = sorted(spans)
    assert (b0 < a1) == (threads != "1")   # overlapping compiles only with more than one thread


def test_the_compile_threads_setting_is_checked(monkeypatch):
    monkeypatch.setenv(autotune.THREADS_ENV, "two")
    with pytest.raises(ValueError, match=autotune.THREADS_ENV):
        autotune.compile_threads()
    monkeypatch.setenv(autotune.THREADS_ENV, "0")
    assert autotune.compile_threads() == 1
    monkeypatch.delenv(autotune.THREADS_ENV)
    assert 1 <= autotune.compile_threads() <= 8


# ---- a torch caller's charges: the bridge's host time on plans through jax ----

def test_which_plans_a_torch_caller_launches_itself():
    rows = T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="none", stack="rows")
    mosaic = dataclasses.replace(rows, stack="fused_mgpu", attention="xla")
    layers = dataclasses.replace(rows, stack="layers")
    facts = T.InputFacts(64, 128, "float32", caller="torch", self_launched=("rows", "fused_mgpu"))
    assert planner.launched_by_caller(rows, facts) and planner.launched_by_caller(mosaic, facts)
    assert not planner.launched_by_caller(layers, facts)
    # a mask decided on the device is read by the kernels: still launched (tests/test_triton_launch.py
    # launches those programs)
    assert planner.launched_by_caller(dataclasses.replace(rows, mask_mode="device"), facts)
    assert planner.launched_by_caller(dataclasses.replace(mosaic, mask_mode="device"), facts)
    assert not planner.launched_by_caller(rows, T.InputFacts(64, 128, "float32", caller="torch"))
    with pytest.raises(ValueError, match="not stacks"):
        T.InputFacts(64, 128, "float32", caller="torch", self_launched=("cublas",))
    with pytest.raises(ValueError, match="torch caller"):
        T.InputFacts(64, 128, "float32", self_launched=("rows",))


def test_a_torch_caller_is_charged_the_bridges_host_time_on_plans_through_jax(measuring_on_cpu, monkeypatch):
    """Where issuing a plan through jax takes longer on the host than its measured time, a torch caller is
    charged that host time plus the bridge's own (BRIDGE_HOST_MS): the plan it launches itself then wins
    though it measured slower. A jax caller is charged the measured times; the two decisions are kept
    apart in the cache."""
    found = _cpu_candidates(SMALL, _facts(SMALL), None)
    rules, launched = found
    monkeypatch.setattr(planner, "launched_by_caller", lambda plan, inputs: inputs.caller == "torch" and plan == launched)
    monkeypatch.setattr(autotune, "_time", lambda fns: {label: (0.1 if label == autotune._label(rules) else 0.2)
                                                        for label in fns})
    issued = {}

    def issue_ms(fns):
        issued.update(fns)
        return {label: 0.5 for label in fns}
    monkeypatch.setattr(autotune, "_issue_ms", issue_ms)
    torch_facts = _facts(SMALL, caller="torch")
    chosen, why, times = autotune.measure(SMALL, torch_facts, found, jax.devices()[0])
    assert chosen == launched and set(issued) == {autotune._label(rules)}
    assert times[autotune._label(rules)] == pytest.approx(0.5 + autotune.BRIDGE_HOST_MS)
    assert times[autotune._label(launched)] == pytest.approx(0.2)
    assert "for a torch caller" in why and f"{autotune._label(rules)} 0.100 to 0.540 ms" in why
    # a plan through jax whose host time is below its measured time keeps its measured time
    monkeypatch.setattr(autotune, "_issue_ms", lambda fns: {label: 0.01 for label in fns})
    chosen, why, _ = autotune.measure(SMALL, torch_facts, found, jax.devices()[0])
    assert chosen == rules and "none did" in why
    # a jax caller: the measured times, no host charge
    chosen, why, times = autotune.measure(SMALL, _facts(SMALL), found, jax.devices()[0])
    assert chosen == rules and "torch caller" not in why and times[autotune._label(rules)] == pytest.approx(0.1)
    key = autotune.cache_key(SMALL, torch_facts, H200, jax.devices()[0], found)
    assert key["charged_as"] == {"caller": "torch", "self_launched": [], "bridge_host_ms": autotune.BRIDGE_HOST_MS}
    launching = dataclasses.replace(torch_facts, self_launched=("rows",))
    assert autotune.cache_key(SMALL, launching, H200, jax.devices()[0], found) != key
    assert "charged_as" not in autotune.cache_key(SMALL, _facts(SMALL), H200, jax.devices()[0], found)


def test_the_host_time_of_a_plan_is_the_median_issue_of_single_calls(monkeypatch):
    waits = []

    def fn():
        time.sleep(0.002)
        return jax.numpy.zeros(())
    monkeypatch.setattr(jax, "block_until_ready", lambda out: waits.append(out) or out)
    issued = autotune._issue_ms({"a": fn})
    assert 2.0 <= issued["a"] < 50.0 and len(waits) == autotune.ISSUE_SAMPLES   # each call waited for
