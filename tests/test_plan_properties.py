"""Property tests of the pure planning layer and the bridge's launch checks: for any valid model and call
(hypothesis draws them, far beyond the suites' shapes), on any GPU generation the planner knows, planning,
the measured planner's candidate list and the bridge's question "do I launch this plan's kernels myself?"
answer without raising. A crash here is a crash on a user's first call (the Mosaic launch check once
divided by 128 // S for S > 128)."""

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ttj_jax as T
from ttj_jax import planner
from ttj_jax.device import DeviceFacts

DEVICES = {
    "sm_90": DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=140 * 2**30, compute_capability="9.0"),
    "sm_80": DeviceFacts(platform="gpu", device_kind="NVIDIA A100", memory_bytes=40 * 2**30, compute_capability="8.0"),
    "sm_89": DeviceFacts(platform="gpu", device_kind="NVIDIA L4", memory_bytes=24 * 2**30, compute_capability="8.9"),
    "cpu": planner.CPU,
}


@st.composite
def calls(draw):
    num_heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    head_dim = draw(st.sampled_from([8, 16, 24, 32, 64, 80, 128, 256]))
    d_model = num_heads * head_dim
    config = T.Config(batch_size=draw(st.integers(1, 128)), seq_len=draw(st.integers(1, 8192)),
                      d_model=d_model, num_heads=num_heads,
                      ffn_dim=draw(st.sampled_from([d_model, 2 * d_model, 4 * d_model, 128])),
                      num_layers=draw(st.integers(1, 16)), causal=draw(st.booleans()))
    inputs = T.InputFacts(batch_size=config.batch_size, seq_len=config.seq_len,
                          dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"])),
                          mask_kind=draw(st.sampled_from(list(T.MaskKind))),
                          caller=draw(st.sampled_from(["jax", "torch"])))
    return config, inputs, draw(st.sampled_from(sorted(DEVICES)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(calls())
def test_planning_never_raises_and_the_candidates_start_with_the_rules_plan(call):
    config, inputs, device = call
    facts = DEVICES[device]
    rules = T.plan(config, inputs, facts)
    found = planner.candidates(config, inputs, facts)
    assert found[0] == rules and all(isinstance(p, T.Plan) for p in found)
    if device != "sm_90":
        assert all(p.stack != "fused_mgpu" for p in found)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(calls())
def test_the_bridges_launch_checks_answer_for_any_call(monkeypatch_module, call):
    """bridge.direct.launch_reason for every stack, and self_launched_stacks, on a CUDA device whose
    Mosaic and Triton launches are available: a reason or None, never an exception."""
    from bridge import direct
    config, inputs, _ = call
    cuda = torch.device("cuda", 0)
    for stack in ("fused_mgpu", "rows", "fused", "layers"):
        reason = direct.launch_reason(stack, config, inputs.batch_size, inputs.seq_len, cuda)
        assert reason is None or isinstance(reason, str)
    launched = direct.self_launched_stacks(config, inputs.batch_size, inputs.seq_len, cuda)
    assert isinstance(launched, tuple)
    T.InputFacts(batch_size=inputs.batch_size, seq_len=inputs.seq_len, dtype=inputs.dtype,
                 caller="torch", self_launched=launched)   # what the bridge hands the planner validates


@pytest.fixture(scope="module")
def monkeypatch_module():
    """The launches' device checks answering "available" for the whole module (hypothesis runs one test
    function many times; a function-scoped monkeypatch would not reset between its examples)."""
    from bridge import mosaic_launch, settings, triton_launch
    mp = pytest.MonkeyPatch()
    mp.setattr(mosaic_launch, "unavailable_reason", lambda device: None)
    mp.setattr(triton_launch, "unavailable_reason", lambda device, stack: None)
    mp.setenv(settings.TRITON_LAUNCH_ENV, "all")
    yield types.SimpleNamespace()
    mp.undo()


@st.composite
def small_calls(draw):
    num_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    config = T.Config(batch_size=draw(st.integers(1, 3)), seq_len=draw(st.integers(1, 40)),
                      d_model=num_heads * head_dim, num_heads=num_heads,
                      ffn_dim=draw(st.sampled_from([16, 64])), num_layers=draw(st.integers(1, 2)),
                      causal=draw(st.booleans()))
    return config, draw(st.sampled_from(["none", "all_true", "prefix", "random"])), draw(st.integers(0, 2**16))


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(small_calls())
def test_the_pytorch_module_takes_any_small_call(call):
    """The bridge's module end to end on the CPU for drawn models and masks (the harness flow: the
    reference's weights copied in, its own inputs): its first call plans, builds and runs, and the output
    meets the harness rule against the reference."""
    from conftest import make_mask, random_input, torch_reference

    import bridge
    from bench.baseline import BaselineTransformer, TransformerConfig, check_close, copy_model_weights
    config, kind, seed = call
    torch.manual_seed(seed)
    base = BaselineTransformer(TransformerConfig(**vars(config))).eval()
    ours = bridge.TTJTransformer(TransformerConfig(**vars(config))).eval()
    copy_model_weights(base, ours, strict=True)
    x = random_input(config, seed)
    mask = make_mask(kind, config.batch_size, config.seq_len, seed)
    if mask is not None:
        x = x.masked_fill(~mask[:, :, None], 0.0)
    with torch.no_grad():
        y = ours(x, mask)
    failed, worst = check_close(y, torch_reference(base, x, mask))
    assert failed == 0, f"{failed} elements fail the harness rule (worst {worst:.2f}) for {config}, mask {kind}"
