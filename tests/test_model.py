"""ttj_jax against the PyTorch reference (bench/baseline.py, written from docs/spec.md), on the CPU.

Tolerances:
- fp32 paths (jnp reference, exact_fp32 policy) vs the torch fp32 reference: 2e-5 absolute. Outputs
  are LayerNorm outputs of order 1; two fp32 implementations summing in different orders land ~1e-6
  apart, and 2e-5 leaves room for 4 layers of that without hiding a real error (those are >= 1e-3).
- mixed_fp16 policy: the harness rule itself (atol 0.002, rtol 0.02), zero failing elements.
"""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import MASK_KINDS, baseline_and_params, make_mask, random_input, to_jax, to_torch, torch_reference

import ttj_jax as T
from ttj_jax.compat import count_compilations

FP32_ATOL = 2e-5

# S in {1, 7, 33, 127}; H in {1, 2, 4, 16}; head_dim 8 to 256; causal and not.
CONFIGS = {
    "hd8-S1": T.Config(2, 1, 32, 4, 32, 1, True),
    "hd16-S7": T.Config(2, 7, 64, 4, 96, 2, True),
    "hd32-S33-noncausal": T.Config(2, 33, 128, 4, 128, 2, False),
    "hd64-S127": T.Config(1, 127, 128, 2, 64, 1, True),
    "hd128-H1-S33": T.Config(2, 33, 128, 1, 128, 1, True),
    "hd256-S33": T.Config(1, 33, 512, 2, 256, 1, True),
    "hd8-H16-S7-noncausal": T.Config(2, 7, 128, 16, 128, 1, False),
}


# On the CPU every config takes the same XLA path; these three add head_dim 64, 128 and 256 (which the GPU
# kernels treat apart) at ~15 more compiles, so they run in the slow tier.
SLOW_CONFIGS = ("hd64-S127", "hd128-H1-S33", "hd256-S33")


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CONFIGS
                                        else name for name in CONFIGS])
def model(request):
    config = CONFIGS[request.param]
    base, params = baseline_and_params(config, seed=len(request.param))
    return config, base, params


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_all_paths_match_torch_reference(model, mask_kind, harness_rule):
    config, base, params = model
    x = random_input(config, seed=7)
    mask = make_mask(mask_kind, config.batch_size, config.seq_len, seed=3)
    if mask is not None:
        x = x.masked_fill(~mask[:, :, None], 0.0)      # as the harness does for padded inputs
    ref = torch_reference(base, x, mask).numpy()
    assert np.isfinite(ref).all()
    jx, jm = to_jax(x), to_jax(mask)

    jax_ref = np.asarray(T.reference(params, jx, jm, config=config))
    np.testing.assert_allclose(jax_ref, ref, rtol=0, atol=FP32_ATOL)

    exact = np.asarray(T.forward(params, jx, jm, config=config, policy="exact_fp32"))
    np.testing.assert_allclose(exact, ref, rtol=0, atol=FP32_ATOL)

    mixed = T.forward(params, jx, jm, config=config)
    assert mixed.dtype == jnp.float32 and mixed.shape == x.shape
    harness_rule(to_torch(mixed), torch.from_numpy(ref))

    if mask is not None:   # invalid rows are exactly zero, never NaN
        invalid = ~mask.numpy()
        assert (np.asarray(mixed)[invalid] == 0).all() and (exact[invalid] == 0).all()


@pytest.mark.parametrize("mask_kind", ["prefix", "random", "all_invalid"])
def test_mask_modes_agree(mask_kind):
    """The same mask run as classified on the host, as unknown (decided on the device) and as general
    (full key masking) gives the same output."""
    config = CONFIGS["hd16-S7"]
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=1))
    mask = to_jax(make_mask(mask_kind, config.batch_size, config.seq_len, seed=5))
    outs = {kind: np.asarray(T.forward(params, x, mask, config=config, policy="exact_fp32", mask_kind=kind))
            for kind in (None, "unknown", "general")}
    np.testing.assert_allclose(outs["unknown"], outs["general"], atol=1e-6)
    np.testing.assert_allclose(outs[None], outs["general"], atol=1e-6)


def test_invalid_rows_of_the_attention_never_reach_valid_rows_or_gradients():
    """layers.layer zeroes invalid queries' context rows before the out-projection (so nothing sits between
    that GEMM and the residual add) and leaves invalid rows to the stack's end. Whatever attention gives an
    invalid row, NaN included, the layer's valid rows and the gradients (weights and x) through the
    stack's final zeroing equal those with that row zeroed first, and stay finite."""
    from ttj_jax import layers
    from ttj_jax.numerics import get_policy
    from ttj_jax.params import prepare_weights
    config = CONFIGS["hd16-S7"]
    _, params = baseline_and_params(config)
    policy = get_policy("exact_fp32")
    w = prepare_weights(params, policy).layer(0)
    x = to_jax(random_input(config, seed=3))
    mask = to_jax(make_mask("prefix", config.batch_size, config.seq_len, seed=4))
    assert not bool(mask.all())
    plan = T.Plan(policy="exact_fp32", attention="xla", mask_mode="keys")

    def run(poison):
        def attention(qkv, key_valid, *, causal, policy):
            context = layers.xla_attention(qkv, key_valid, causal=causal, policy=policy)
            return jnp.where(mask[:, :, None, None], context, jnp.nan if poison else 0.0)

        def loss(w, x):
            y = layers.layer(w, x, mask[:, :, None], mask, config=config, plan=plan, policy=policy,
                             attention=attention)
            y = jnp.where(mask[:, :, None], y, 0.0)   # as layer_stack zeroes y
            return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))), y
        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(w, x)
        return y, grads

    y, grads = run(poison=True)
    y_zero, grads_zero = run(poison=False)
    assert np.isfinite(np.asarray(y)).all() and (np.asarray(y)[~np.asarray(mask)] == 0).all()
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_zero))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_zero)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_inputs(dtype, harness_rule):
    """fp16/bf16 x: output in x's dtype, matching the fp32 reference run on the same (rounded) input."""
    config = CONFIGS["hd32-S33-noncausal"]
    base, params = baseline_and_params(config)
    x = random_input(config, seed=2).to(getattr(torch, dtype))
    ref = torch_reference(base, x, None)
    y = T.forward(params, jnp.asarray(x.float().numpy()).astype(dtype), config=config)
    assert y.dtype == jnp.dtype(dtype)
    harness_rule(to_torch(y.astype(jnp.float32)), ref)


def test_prepared_weights_give_the_same_output(harness_rule):
    config = CONFIGS["hd16-S7"]
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=4))
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    np.testing.assert_array_equal(np.asarray(T.forward(prepared, x, config=config)),
                                  np.asarray(T.forward(params, x, config=config)))
    with pytest.raises(ValueError, match="prepared for policy"):
        T.forward(prepared, x, config=config, policy="exact_fp32")
    # weights depend only on the GEMM dtype: mixed_fp16's serve the planner's GEMM-bound policy too
    y16 = T.forward(prepared, x, config=config, policy="mixed_fp16_qkv16")
    harness_rule(to_torch(y16), to_torch(T.forward(params, x, config=config, policy="exact_fp32")))


def test_the_layer_program_takes_its_weights_stacked_fourteen_arrays_at_any_depth():
    """The XLA program's weights as `stacks.kernel_weights` builds them: each per-layer array stacked
    over the layers (jax's dispatch costs host time per argument), the output equal to the bit."""
    from ttj_jax import stacks
    config = dataclasses.replace(CONFIGS["hd16-S7"], num_layers=3)
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=4))
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    stacked = stacks.kernel_weights(prepared, T.model_key(config), "layers")
    assert isinstance(stacked, T.StackedWeights) and stacked.num_layers == 3
    assert len(jax.tree_util.tree_leaves(stacked)) == 14 < len(jax.tree_util.tree_leaves(prepared))
    plan = T.plan(T.model_key(config), T.InputFacts(*x.shape[:2], "float32"))
    assert plan.stack == "layers"
    run = T.executable(plan, T.model_key(config))
    np.testing.assert_array_equal(np.asarray(run(stacked, x, None)), np.asarray(run(prepared, x, None)))


def test_the_three_gemm_qkv_projection_gives_the_fused_programs_output(monkeypatch):
    """Plan.qkv_gemms = 3 (q, k and v by three GEMMs, each output dense, for cuDNN's attention): its weights
    split to [L, 3, d, d] once (its own layout, kept apart from the fused one), and the program's output
    the fused projection's, from the split layout, from per-layer weights (sliced in the program) and
    scanned over the layers. A CPU stand-in takes cuDNN's place (the XLA attention on the same q, k, v)."""
    import functools

    from ttj_jax import layers, planner, stacks

    def stand_in(qkv, key_valid, *, causal, policy):
        qkv = jnp.stack(qkv, axis=2) if isinstance(qkv, tuple) else qkv
        return layers.xla_attention(qkv, key_valid, causal=causal, policy=policy)
    monkeypatch.setitem(layers.ATTENTION, "cudnn", stand_in)
    config = dataclasses.replace(CONFIGS["hd16-S7"], num_layers=3)
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=4))
    key = T.model_key(config)
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    fused = T.Plan(policy=planner.GEMM_BOUND_POLICY, attention="cudnn", mask_mode="none")
    three = dataclasses.replace(fused, qkv_gemms=3, xla_options=planner.QKV_SPLIT_XLA_OPTIONS)
    assert "/qkv3" in three.name and stacks.weights_layout(three) == "layers-qkv3"
    split = stacks.kernel_weights(prepared, key, three)
    d = config.d_model
    assert split.layers["qkv_weight"].shape == (3, 3, d, d) and split.layers["qkv_bias"].shape == (3, 3, d)
    assert stacks.kernel_weights(prepared, key, three) is split                  # built once
    assert stacks.kernel_weights(prepared, key, fused).layers["qkv_weight"].shape == (3, d, 3 * d)
    np.testing.assert_array_equal(np.asarray(split.layers["qkv_weight"][1, 2]),
                                  np.asarray(prepared.layers[1]["qkv_weight"][:, 2 * d:]))

    def run(plan, weights):   # not model.executable: its cache would keep the stand-in's program
        return np.asarray(jax.jit(functools.partial(layers.run_layers, config=key, plan=plan))(weights, x, None))
    y = run(fused, stacks.kernel_weights(prepared, key, fused))
    np.testing.assert_allclose(run(three, split), y, atol=1e-6)
    np.testing.assert_allclose(run(three, prepared), y, atol=1e-6)
    np.testing.assert_allclose(run(dataclasses.replace(three, scan_layers=True), split), y, atol=1e-6)
    np.testing.assert_allclose(run(fused, split), y, atol=1e-6)   # split weights joined again for one GEMM
    with pytest.raises(ValueError, match="qkv_gemms=3"):
        dataclasses.replace(three, attention="pallas")


def _equations(jaxpr):
    """Every equation of a jaxpr, those of the jaxprs inside its equations (custom_vjp, pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_layer_norm_and_row_zeroing_backwards_keep_one_row_tensor_and_the_mask():
    """The training forward's residuals: LayerNorm keeps its fp32 input and per-row statistics (jax's
    own rule kept two fp32 tensors of x's size), the zeroing of invalid rows only the [B, S, 1] mask
    (jax's rule for where kept it broadcast and a zero tensor of x's size); gradients equal jax's rules'."""
    from ttj_jax.layers import zero_invalid_rows
    from ttj_jax.numerics import layer_norm
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (3, 5, 16)) * 2 + 1
    w, b = jax.random.normal(keys[1], (16,)), jax.random.normal(keys[2], (16,))
    g = jax.random.normal(keys[3], x.shape)
    valid = jnp.arange(5)[None, :, None] < jnp.array([5, 2, 0])[:, None, None]

    def plain_layer_norm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        centered = x - mean
        return centered * jax.lax.rsqrt((centered * centered).mean(-1, keepdims=True) + 1e-5) * w + b

    def ours(x, w, b):
        return zero_invalid_rows(layer_norm(x, w, b), valid)

    def plain(x, w, b):
        return jnp.where(valid, plain_layer_norm(x, w, b), 0.0)
    (y, pull), (want_y, want_pull) = jax.vjp(ours, x, w, b), jax.vjp(plain, x, w, b)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
    for got, want in zip(pull(g), want_pull(g)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    residuals = [leaf for leaf in jax.tree.leaves(pull) if hasattr(leaf, "shape")]
    assert sum(leaf.size >= x.size for leaf in residuals) == 1   # x itself, as [15, 16] rows
    assert sum(leaf.size >= x.size for leaf in jax.tree.leaves(want_pull) if hasattr(leaf, "shape")) > 1
    assert any(leaf.shape == valid.shape and leaf.dtype == jnp.bool_ for leaf in residuals)


def test_layer_norm_reduces_over_two_dimensional_rows_and_keeps_the_shape():
    """numerics.layer_norm of a [B, S, d] input computes on the [B*S, d] rows: XLA's GPU fusion of the
    3-D form tiled rows a sequence apart (10% of vit-s197's program, docs/decisions.md). Its values
    are the per-row formula's."""
    from ttj_jax.numerics import layer_norm
    x = jax.random.normal(jax.random.key(0), (3, 5, 16)) * 2 + 1
    w, b = jnp.linspace(0.5, 1.5, 16), jnp.linspace(-1, 1, 16)
    reductions = [e for e in _equations(jax.make_jaxpr(layer_norm)(x, w, b).jaxpr) if e.primitive.name == "reduce_sum"]
    assert reductions and all(e.invars[0].aval.shape == (15, 16) for e in reductions)
    y = layer_norm(x, w, b)
    assert y.shape == x.shape and y.dtype == jnp.float32
    rows = np.asarray(x, np.float64).reshape(15, 16)
    mean, var = rows.mean(1, keepdims=True), rows.var(1, keepdims=True)
    expected = ((rows - mean) / np.sqrt(var + 1e-5) * np.asarray(w) + np.asarray(b)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y), expected, atol=2e-6)
    assert layer_norm(x[0, 0], w, b).shape == (16,)


@pytest.mark.parametrize("weights", ["stacked", "prepared"])
def test_the_layers_as_one_scan_give_the_unrolled_programs_output(weights, harness_rule):
    from ttj_jax import stacks
    config = dataclasses.replace(CONFIGS["hd16-S7"], num_layers=3)
    base, params = baseline_and_params(config)
    x = random_input(config, seed=5)
    mask = make_mask("prefix", config.batch_size, config.seq_len, seed=5)
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    given = stacks.kernel_weights(prepared, T.model_key(config), "layers") if weights == "stacked" else prepared
    plan = T.plan(T.model_key(config), T.InputFacts(*x.shape[:2], "float32", T.MaskKind.PREFIX))
    scanned = dataclasses.replace(plan, scan_layers=True)
    assert "/scan" in scanned.name
    y = T.executable(scanned, T.model_key(config))(given, to_jax(x), to_jax(mask))
    y_unrolled = T.executable(plan, T.model_key(config))(given, to_jax(x), to_jax(mask))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_unrolled), atol=2e-5)
    harness_rule(to_torch(y), torch_reference(base, x, mask))


def test_the_plans_xla_options_reach_the_compiler():
    """model.executable compiles with plan.xla_options (the planner's GEMM-bound plans turn XLA's Triton
    GEMMs off; on the CPU a CPU option stands in, and a misspelt one is refused by XLA itself)."""
    config = CONFIGS["hd16-S7"]
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=4))
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    base = T.plan(T.model_key(config), T.InputFacts(*x.shape[:2], "float32"))
    optioned = dataclasses.replace(base, xla_options=(("xla_cpu_enable_fast_math", False),))
    np.testing.assert_allclose(np.asarray(T.executable(optioned, T.model_key(config))(prepared, x, None)),
                               np.asarray(T.executable(base, T.model_key(config))(prepared, x, None)), atol=1e-5)
    misspelt = dataclasses.replace(base, xla_options=(("xla_no_such_option", False),))
    with pytest.raises(Exception, match="xla_no_such_option"):
        T.executable(misspelt, T.model_key(config))(prepared, x, None)


def test_deterministic_and_no_recompilation():
    config = CONFIGS["hd16-S7"]
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=4))
    first = np.asarray(T.forward(params, x, config=config))
    with count_compilations() as counter:
        second = np.asarray(T.forward(params, x + 0.0, config=config))
        mask_a = to_jax(make_mask("random", config.batch_size, config.seq_len, seed=1))
        mask_b = to_jax(make_mask("random", config.batch_size, config.seq_len, seed=2))
        T.forward(params, x, mask_a, config=config)
        warm = counter.count
        T.forward(params, x, mask_b, config=config)        # same shape, same mask kind: no new program
        T.forward(params, x, mask_a, config=config)
    np.testing.assert_array_equal(first, second)
    assert counter.count == warm, f"{counter.count - warm} recompilations on repeated calls"
    assert warm >= 1   # the counter itself works: the first masked call compiled


def test_forward_plans_each_input_signature_once(monkeypatch):
    """forward keeps its plan and executable per input signature (model._forward_call): a repeated call
    does not plan again, and anything plan_for reads (shape, dtype, mask kind, options) gets its own
    plan, never a stale one. Inside a caller's jit (traced x) it plans every time and still works."""
    import jax

    from ttj_jax import model
    config = CONFIGS["hd16-S7"]
    _, params = baseline_and_params(config)
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    x = to_jax(random_input(config, seed=5))
    calls = []
    real = model.plan_for
    monkeypatch.setattr(model, "plan_for", lambda *a, **k: calls.append(k) or real(*a, **k))
    model.clear_forward_cache()
    first = np.asarray(T.forward(prepared, x, config=config))
    assert len(calls) == 1
    np.testing.assert_array_equal(np.asarray(T.forward(prepared, x, config=config)), first)
    assert len(calls) == 1                                             # same signature: no planning
    T.forward(prepared, x[:1], config=config)                          # another batch
    T.forward(prepared, x.astype(jnp.float16), config=config)          # another dtype
    T.forward(prepared, x, jnp.ones(x.shape[:2], bool).at[0, -1].set(False), config=config)   # a prefix mask
    T.forward(prepared, x, config=config, stack="layers", attention="xla")                   # options
    assert len(calls) == 5 and calls[-1]["attention"] == "xla"
    T.forward(prepared, x, config=config, stack="layers", attention="xla")
    assert len(calls) == 5
    # the cached entry is the plan a fresh planning gives
    key_plan = next(v[0] for k, v in model._FORWARD_CALLS.items() if k[1] == x.shape and k[5] == (
        ("policy", None), ("attention", None), ("data_parallel", None), ("stack", None),
        ("sequence_parallel", None)) and k[4] == T.MaskKind.NONE and k[2] == x.dtype)
    assert key_plan == real(config, x, T.MaskKind.NONE)
    traced = jax.jit(lambda v: T.forward(prepared, v, config=config))(x)
    np.testing.assert_allclose(np.asarray(traced), first, rtol=0, atol=1e-6)
    assert len(calls) == 6                                             # planned under the trace


def test_batch_chunked_plan_matches_whole_batch():
    config = dataclasses.replace(CONFIGS["hd16-S7"], batch_size=6)
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=9))
    mask = to_jax(make_mask("random", 6, config.seq_len, seed=9))
    whole = T.Plan(policy="exact_fp32", attention="xla", mask_mode="keys")
    chunked = dataclasses.replace(whole, batch_chunk=2)
    prepared = T.prepare_weights(params, T.EXACT_FP32)
    key = T.model_key(config)
    np.testing.assert_allclose(np.asarray(T.executable(chunked, key)(prepared, x, mask)),
                               np.asarray(T.executable(whole, key)(prepared, x, mask)), atol=1e-6)


def test_nan_in_input_is_passed_through_not_hidden():
    """Documented behaviour: NaN in x is not hidden. It reaches the same outputs as in the reference:
    its whole sequence (the probabilities' zeros times a NaN value row are NaN, in the reference too),
    and no other sequence."""
    config = CONFIGS["hd16-S7"]
    base, params = baseline_and_params(config)
    x = random_input(config, seed=4)
    x[0, 3, 5] = float("nan")
    ref = torch_reference(base, x, None).numpy()
    y = np.asarray(T.forward(params, to_jax(x), config=config))
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref))
    assert np.isnan(y[0]).any() and np.isfinite(y[1]).all()


@pytest.mark.parametrize("make_bad, error, match", [
    (lambda x, m: (x[0], None), ValueError, "rank 3"),
    (lambda x, m: (x[..., :-1], None), ValueError, "d_model"),
    (lambda x, m: (x, m[:, :-1]), ValueError, "valid_token_mask must have shape"),
    (lambda x, m: (x, m.astype(jnp.int32)), TypeError, "valid_token_mask must be bool"),
    (lambda x, m: (x.astype(jnp.int32), None), TypeError, "floating point"),
    (lambda x, m: (x[:, :0], None), ValueError, "seq_len >= 1"),
])
def test_bad_inputs_raise_clear_errors(make_bad, error, match):
    config = CONFIGS["hd16-S7"]
    _, params = baseline_and_params(config)
    x = to_jax(random_input(config, seed=0))
    mask = jnp.ones(x.shape[:2], bool)
    bad_x, bad_mask = make_bad(x, mask)
    with pytest.raises(error, match=match):
        T.forward(params, bad_x, bad_mask, config=config)


def test_config_errors():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        T.Config(1, 8, 30, 4, 32, 1, True)
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        T.Config(1, 8, 32, 4, 32, 0, True)
    with pytest.raises(TypeError, match="causal must be a bool"):
        T.Config(1, 8, 32, 4, 32, 1, 1)
    with pytest.raises(TypeError, match="d_model must be an int"):
        T.Config(1, 8, 32.0, 4, 32, 1, True)
    with pytest.raises(ValueError, match="lacks field"):
        T.Config.from_object(object())


@pytest.mark.parametrize("attention", [pytest.param("pallas", marks=pytest.mark.interpret), "cudnn"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_implementations_through_the_model(attention, causal, harness_rule, request):
    """The model with each GPU attention implementation forced, every mask kind (a sequence with no valid
    token among the random ones). On the CPU, Pallas runs interpreted; cuDNN cannot run there, so its call
    goes to jax's own attention with the same arguments (the key mask as `mask`): our side of the call is
    checked here, cuDNN's on the GPU (`ttj-bench`, bench/grad_check.py)."""
    if attention == "cudnn":
        request.getfixturevalue("cudnn_on_cpu")
    config = T.Config(2, 33, 32, 2, 32, 2, causal)
    base, params = baseline_and_params(config)
    x0 = random_input(config, seed=11)
    for kind in ("none", "prefix", "random", "all_invalid"):
        mask = make_mask(kind, 2, 33, seed=2)
        x = x0 if mask is None else x0.masked_fill(~mask[:, :, None], 0.0)
        y = T.forward(params, to_jax(x), to_jax(mask), config=config, attention=attention,
                      mask_kind=None if mask is None else "general")
        assert np.isfinite(np.asarray(y)).all()
        harness_rule(to_torch(y), torch_reference(base, x, mask), label=f"-{kind}")


def test_cudnn_attention_carries_a_key_mask_in_extra_lanes_with_exact_gradients(cudnn_on_cpu):
    """layers.cudnn_attention with a key mask (extra lanes of q and k) against the explicit masked
    attention: the same context and the same gradients of q, k and v on every valid query, causal and
    not, a sequence with no valid token included. cuDNN's call runs as jax's own attention (CPU)."""
    from ttj_jax import layers, planner
    B, S, H, hd = 3, 37, 2, 16
    qkv = jax.random.normal(jax.random.PRNGKey(0), (B, S, 3, H, hd), jnp.float32) * 2
    mask = jnp.asarray(make_mask("all_invalid", B, S, seed=3).numpy())
    weight = jax.random.normal(jax.random.PRNGKey(1), (B, S, H, hd)) * mask[:, :, None, None]
    for causal in (True, False):
        def loss(fn, t):
            return jnp.sum(fn(t, mask, causal=causal, policy=T.EXACT_FP32) * weight)
        got, want = (jax.value_and_grad(functools.partial(loss, fn))(qkv)
                     for fn in (layers.cudnn_attention, layers.xla_attention))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-4, atol=1e-5)
        out = layers.cudnn_attention(qkv, mask, causal=causal, policy=T.EXACT_FP32)
        assert out.shape == (B, S, H, hd) and np.isfinite(np.asarray(out)).all()
    assert cudnn_on_cpu[-1] == ((B, S, H, hd + planner.CUDNN_MASK_LANES),) * 3
    with pytest.raises(ValueError, match="head_dim <= 120"):
        wide = jnp.zeros((1, 8, 3, 1, 128))
        layers.cudnn_attention(wide, jnp.ones((1, 8), bool), causal=False, policy=T.EXACT_FP32)


def test_fp16_projection_policy_is_never_the_rules_choice_and_meets_the_rule(harness_rule):
    # mixed_fp16_qkv16 writes the q/k/v projection in fp16: the torch peer's numerics, which only the
    # measured planner may choose (planner.PEER_NUMERICS_POLICY, a candidate on the GPU), never the rules
    from ttj_jax.numerics import MIXED_FP16_QKV16
    h = jnp.ones((2, 8), jnp.float32)
    w = jnp.ones((8, 6), jnp.float16)
    assert MIXED_FP16_QKV16.project_qkv(h, w, jnp.zeros(6)).dtype == jnp.float16
    assert T.MIXED_FP16.project_qkv(h, w, jnp.zeros(6)).dtype == jnp.float32
    config = T.Config(2, 24, 32, 2, 48, 2, True)
    baseline, params = baseline_and_params(config)
    x = random_input(config, seed=3)
    y = T.forward(params, to_jax(x), config=config, policy="mixed_fp16_qkv16")
    harness_rule(to_torch(y), baseline(x, None))
    assert T.plan(config, T.InputFacts(2, 24, "float32")).policy == "mixed_fp16"


def test_the_training_gelu_is_torchs_erf_formula_within_fp32_rounding():
    """numerics.gelu_erf (the fast policies' GELU, x (1 + erf(x / sqrt 2)) / 2 as torch writes it) is
    gelu_exact (jax.nn.gelu through erfc) to fp32 rounding, over the range a pre-activation takes and its
    tails, and its derivative in the training policy's custom rule is the derivative of gelu_exact."""
    from ttj_jax.numerics import MIXED_FP16_TRAIN, gelu_erf, gelu_exact
    x = jnp.linspace(-12.0, 12.0, 20001, dtype=jnp.float32)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in np.asarray(x, np.float64)])
    for got in (gelu_erf(x), gelu_exact(x)):
        assert np.max(np.abs(np.asarray(got, np.float64) - want)) < 2e-6
    np.testing.assert_allclose(np.asarray(gelu_erf(x)), np.asarray(gelu_exact(x)), rtol=1e-5, atol=2e-6)
    w = jnp.eye(8, dtype=jnp.float32)
    b = jnp.zeros(8, jnp.float32)
    h = x[::2500][:8].reshape(1, 8)
    d_ours = jax.grad(lambda t: jnp.sum(MIXED_FP16_TRAIN.mlp_hidden(t, w, b).astype(jnp.float32)))(h)
    d_want = jax.grad(lambda t: jnp.sum(gelu_exact(t.astype(jnp.float16).astype(jnp.float32))))(h)
    np.testing.assert_allclose(np.asarray(d_ours), np.asarray(d_want), rtol=2e-3, atol=2e-3)


def test_the_training_mlp_with_its_bias_inside_the_gelu_rule_has_the_same_gradients(monkeypatch):
    """numerics.MLP_BIAS_IN_GELU: GELU(x @ w + b) with the bias added inside the GELU's custom rule (whose
    residual is the GEMM's output) gives the value and the gradients of x, w and b that jax's own rules
    give for the same fp16 GEMM and fp32 GELU, and those of the shipped form (bias added before the rule)
    to fp16 rounding of the pre-activation."""
    from ttj_jax import numerics
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    x = jax.random.normal(keys[0], (3, 5, 16), jnp.float32)
    w = jax.random.normal(keys[1], (16, 24), jnp.float32) / 4
    b = jax.random.normal(keys[2], (24,), jnp.float32)
    g = jax.random.normal(keys[3], (3, 5, 24), jnp.float32)

    def loss(policy_form, x, w, b):
        return jnp.sum(policy_form(x, w, b).astype(jnp.float32) * g)

    def by_jax(x, w, b):
        y = jnp.matmul(x.astype(jnp.float16), w.astype(jnp.float16), preferred_element_type=jnp.float16)
        return numerics.gelu_erf(y.astype(jnp.float32) + b).astype(jnp.float16)
    want = jax.value_and_grad(functools.partial(loss, by_jax), argnums=(0, 1, 2))(x, w, b)
    shipped = jax.value_and_grad(functools.partial(loss, numerics.MIXED_FP16_TRAIN.mlp_hidden), argnums=(0, 1, 2))(x, w, b)
    monkeypatch.setattr(numerics, "MLP_BIAS_IN_GELU", True)
    got = jax.value_and_grad(functools.partial(loss, numerics.MIXED_FP16_TRAIN.mlp_hidden), argnums=(0, 1, 2))(x, w, b)
    for reference, tolerance in ((want, 2e-3), (shipped, 1e-2)):
        np.testing.assert_allclose(float(got[0]), float(reference[0]), rtol=tolerance)
        for ours, theirs in zip(got[1], reference[1]):
            assert ours.dtype == theirs.dtype == jnp.float32
            err = np.linalg.norm(np.asarray(ours) - np.asarray(theirs)) / np.linalg.norm(np.asarray(theirs))
            assert err < tolerance


def test_fp16_hidden_policy_rounds_only_the_mlp_pre_activation_and_meets_the_rule(harness_rule):
    # mixed_fp16_gemm16: q/k/v and the MLP's pre-activation written in fp16 (an experiment for shape 8;
    # the planner never picks it on its own). Its hidden layer is GELU of the fp16-rounded
    # pre-activation, rounded to fp16; the default policies keep the fp32 pre-activation.
    from ttj_jax.numerics import EXACT_FP32, MIXED_FP16_GEMM16, gelu_erf, gelu_exact
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 8)) * 0.3, jnp.float16)
    b = jnp.asarray(rng.standard_normal(8), jnp.float32)
    hidden = MIXED_FP16_GEMM16.mlp_hidden(h, w, b)
    assert hidden.dtype == jnp.float16
    pre = (jnp.matmul(h.astype(jnp.float16), w, preferred_element_type=jnp.float16) + b.astype(jnp.float16))
    np.testing.assert_array_equal(np.asarray(hidden), np.asarray(gelu_erf(pre.astype(jnp.float32)).astype(jnp.float16)))
    exact = gelu_erf(T.MIXED_FP16.matmul(h, w) + b)
    np.testing.assert_array_equal(np.asarray(T.MIXED_FP16.mlp_hidden(h, w, b)), np.asarray(exact))
    # the fast policies take PyTorch's erf form, the exact policy the erfc form (numerics.NumericsPolicy.gelu)
    w32 = w.astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(EXACT_FP32.mlp_hidden(h, w32, b)),
                                  np.asarray(gelu_exact(EXACT_FP32.matmul(h, w32) + b)))
    assert float(jnp.max(jnp.abs(hidden.astype(jnp.float32) - exact))) < 2e-2
    config = T.Config(2, 24, 32, 2, 48, 2, True)
    baseline, params = baseline_and_params(config)
    x = random_input(config, seed=4)
    y = T.forward(params, to_jax(x), config=config, policy="mixed_fp16_gemm16")
    harness_rule(to_torch(y), baseline(x, None))


def test_compensated_projections_pass_the_rule_at_a_small_input_scale_where_one_fp16_product_fails():
    """Input scale 0.01 (the harness's --input-scale), the official shape 2 as it is: one fp16 product per
    projection (mixed_fp16) fails the harness rule against the fp32 baseline; three (mixed_fp16x3,
    numerics.compensated_matmul) pass, with margin; so does tf32 (fp32 operands: exact fp32 on the CPU)."""
    from bench.baseline import check_close
    config = T.OFFICIAL["2"].config
    base, params = baseline_and_params(config)
    x = random_input(config, seed=1234, scale=0.01)
    ref = torch_reference(base, x, None)
    failed = {}
    for policy in ("mixed_fp16", "mixed_fp16x3", "tf32"):
        y = to_torch(T.forward(params, to_jax(x), config=config, policy=policy))
        failed[policy] = check_close(y, ref)
    assert failed["mixed_fp16"][0] > 0
    assert failed["mixed_fp16x3"][0] == 0 and failed["mixed_fp16x3"][1] < 0.7
    assert failed["tf32"][0] == 0 and failed["tf32"][1] < 0.1
    with pytest.raises(ValueError, match="prepared for policy"):   # fp16 weights would drop the tails
        T.forward(T.prepare_weights(params, T.MIXED_FP16), to_jax(x), config=config, policy="mixed_fp16x3")


def test_compensated_matmul_is_about_as_exact_as_fp32():
    from ttj_jax.numerics import compensated_matmul
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 256)).astype(np.float32), (rng.standard_normal((256, 96)) / 16).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(exact).max()
    one = jnp.matmul(jnp.asarray(a, jnp.float16), jnp.asarray(b, jnp.float16), preferred_element_type=jnp.float32)
    three = compensated_matmul(jnp.asarray(a), jnp.asarray(b))
    assert np.abs(np.asarray(one) - exact).max() / scale > 1e-4
    assert np.abs(np.asarray(three) - exact).max() / scale < 2e-6


def test_tanh_gelu_policy_is_the_gemm_bound_choice_and_meets_the_rule(harness_rule):
    # mixed_fp16_gemm16_tanh (the planner's GEMM-bound policy): the tanh GELU on the fp16 pre-activation,
    # as one expression on the GEMM's output (what cuBLASLt takes into its epilogue), within 2e-3 of the
    # erf GELU's hidden values here, and the whole model within the harness rule
    from ttj_jax.numerics import MIXED_FP16_GEMM16, MIXED_FP16_GEMM16_TANH, get_policy
    from ttj_jax.planner import GEMM_BOUND_POLICY
    assert get_policy(GEMM_BOUND_POLICY) is MIXED_FP16_GEMM16_TANH
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 16)) * 0.4, jnp.float16)
    b = jnp.asarray(rng.standard_normal(16), jnp.float32)
    tanh, erf = MIXED_FP16_GEMM16_TANH.mlp_hidden(h, w, b), MIXED_FP16_GEMM16.mlp_hidden(h, w, b)
    assert tanh.dtype == jnp.float16
    difference = np.abs(np.asarray(tanh, np.float32) - np.asarray(erf, np.float32))
    assert 0 < difference.max() < 2e-3
    config = T.Config(2, 24, 32, 2, 48, 2, True)
    baseline, params = baseline_and_params(config)
    x = random_input(config, seed=5)
    y = T.forward(params, to_jax(x), config=config, policy="mixed_fp16_gemm16_tanh")
    harness_rule(to_torch(y), baseline(x, None))


def test_numerics_policy_refuses_an_unknown_gelu():
    import dataclasses
    with pytest.raises(ValueError, match="gelu"):
        dataclasses.replace(T.MIXED_FP16, gelu="sigmoid")


@pytest.mark.parametrize("offset, scale", [(0.0, 1.0), (1000.0, 1.0), (50.0, 0.01), (0.0, 1e-3), (0.0, 100.0)])
def test_one_pass_layer_norm_statistics_are_accurate(monkeypatch, offset, scale):
    """numerics.LAYER_NORM_ONE_PASS: the rows' mean and variance from sums of x - x0 and its square (x0 the
    row's first element) stay within fp32 rounding of a float64 LayerNorm, offsets large against the
    deviation and a constant row included, as the two-pass form does; gradients agree too."""
    from ttj_jax import numerics
    x = jax.random.normal(jax.random.PRNGKey(3), (64, 768), jnp.float32) * scale + offset
    x = x.at[5].set(7.0)
    w = 1.0 + jax.random.normal(jax.random.PRNGKey(4), (768,)) / 10
    b = jax.random.normal(jax.random.PRNGKey(5), (768,)) / 10
    x64 = np.asarray(x, np.float64)
    want = (x64 - x64.mean(-1, keepdims=True)) / np.sqrt(x64.var(-1, keepdims=True) + 1e-5)
    want = want * np.asarray(w, np.float64) + np.asarray(b, np.float64)
    g = jax.random.normal(jax.random.PRNGKey(6), x.shape)
    results = {}
    for one_pass in (False, True):
        monkeypatch.setattr(numerics, "LAYER_NORM_ONE_PASS", one_pass)
        y, pull = jax.vjp(numerics.layer_norm, x, w, b)
        results[one_pass] = (y, *pull(g))
        # fp32's own rounding of x (|x| up to ~1000 here) bounds either form's error
        tolerance = 2e-5 + 4e-7 * (abs(offset) / scale)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=tolerance)
    for two, one in zip(results[False], results[True]):
        np.testing.assert_allclose(np.asarray(one), np.asarray(two), rtol=2e-3, atol=2e-3 * float(jnp.abs(two).max()))


def test_a_training_layer_norm_returning_fp16_changes_only_the_cotangents_rounding(monkeypatch):
    """numerics.LAYER_NORM_OUT_IN_GEMM_DTYPE: the training program's LayerNorms that feed GEMMs return fp16
    (the same values the GEMMs rounded to before), so the output is bitwise the same and the gradients
    differ only by the fp16 rounding of dL/dh (well inside the 1e-2 gradient target); inference policies
    and the compensated one keep fp32."""
    from ttj_jax import numerics, training
    from ttj_jax.shapes import find
    config = find("cpu-2").config
    params = T.init_params(jax.random.PRNGKey(0), config)
    x = jax.random.normal(jax.random.PRNGKey(1), (config.batch_size, config.seq_len, config.d_model))
    g = jax.random.normal(jax.random.PRNGKey(2), x.shape) / x.size

    def run():
        y, pull = training.forward_with_pullback(params, x, None, config=config, on_gpu=False)
        return y, training.apply_pullback(pull, g)

    def fp16_written_dots():   # in the backward program
        _, pull = training.forward_with_pullback(params, x, None, config=config, on_gpu=False)
        text = str(jax.make_jaxpr(lambda g: training.apply_pullback(pull, g))(g))
        return len(re.findall(r":f16\[[^\]]*\] = dot_general", text))
    monkeypatch.setattr(numerics, "LAYER_NORM_OUT_IN_GEMM_DTYPE", False)   # the fp32 form first
    y_a, (dp_a, dx_a) = run()
    shipped_dots = fp16_written_dots()
    monkeypatch.setattr(numerics, "LAYER_NORM_OUT_IN_GEMM_DTYPE", True)
    # dL/dh of each layer's two normed GEMM inputs is now written in fp16 by its GEMM
    assert fp16_written_dots() == shipped_dots + 2 * config.num_layers
    assert numerics.MIXED_FP16_TRAIN.norm_dtype == np.float16
    assert numerics.MIXED_FP16.norm_dtype is None and numerics.MIXED_FP16X3.norm_dtype is None
    y_b, (dp_b, dx_b) = run()
    np.testing.assert_array_equal(np.asarray(y_b), np.asarray(y_a))
    grads_a = {**T.params_to_state_dict(dp_a), "x": dx_a}
    grads_b = {**T.params_to_state_dict(dp_b), "x": dx_b}
    for name, a in grads_a.items():
        if name.endswith("k_proj.bias"):   # zero in exact arithmetic: rounding noise either way
            continue
        b = grads_b[name]
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(b - a) <= 2e-3 * np.linalg.norm(a), name


def test_layer_norm_parameter_sums_as_one_reduction_are_the_same(monkeypatch):
    """numerics.LAYER_NORM_JOINT_PARAMETER_SUMS: the weight's and bias's gradients from one reduction over
    the rows give the same values (to fp32 summation order) as two; dx is untouched."""
    from ttj_jax import numerics
    x = jax.random.normal(jax.random.PRNGKey(7), (4, 33, 96)) * 3 + 1
    w = jax.random.normal(jax.random.PRNGKey(8), (96,))
    b = jax.random.normal(jax.random.PRNGKey(9), (96,))
    g = jax.random.normal(jax.random.PRNGKey(10), x.shape)
    grads = {}
    for joint in (False, True):
        monkeypatch.setattr(numerics, "LAYER_NORM_JOINT_PARAMETER_SUMS", joint)
        grads[joint] = jax.vjp(numerics.layer_norm, x, w, b)[1](g)
    for two, one in zip(grads[False], grads[True]):
        assert one.shape == two.shape and one.dtype == two.dtype
        np.testing.assert_allclose(np.asarray(one), np.asarray(two), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(grads[True][0]), np.asarray(grads[False][0]))


def test_a_weight_kept_transposed_gives_the_same_gradients(monkeypatch):
    """numerics.WEIGHT_RESIDUAL_TRANSPOSED: the training GEMMs keep their fp16 weight as w^T (torch's
    layout) and form dw as (g^T x)^T: the same products, so the output and every gradient match the
    shipped form's to fp32 summation order, in the same dtypes; the kept weight is [n, k]."""
    from ttj_jax import numerics
    keys = jax.random.split(jax.random.PRNGKey(6), 5)
    x = jax.random.normal(keys[0], (3, 5, 16), jnp.float32)
    w = jax.random.normal(keys[1], (16, 24), jnp.float32) / 4
    b = jax.random.normal(keys[2], (24,), jnp.float32)
    g = jax.random.normal(keys[3], (3, 5, 24), jnp.float32)
    policy = numerics.MIXED_FP16_TRAIN
    forms = {"matmul": lambda x, w, b: policy.matmul(x, w),
             "qkv": lambda x, w, b: policy.project_qkv(x, w, b),
             "mlp": lambda x, w, b: policy.mlp_hidden(x, w, b)}

    def run(form):
        y, pull = jax.vjp(forms[form], x, w, b)
        return (y, *pull(g.astype(y.dtype)))
    shipped = {form: run(form) for form in forms}
    monkeypatch.setattr(numerics, "WEIGHT_RESIDUAL_TRANSPOSED", True)
    switched = {form: run(form) for form in forms}
    for form in forms:
        for a, c in zip(shipped[form], switched[form]):
            assert a.dtype == c.dtype and a.shape == c.shape
            np.testing.assert_allclose(np.asarray(c, np.float32), np.asarray(a, np.float32), rtol=1e-5, atol=1e-6)
    residuals = jax.tree.leaves(jax.vjp(forms["matmul"], x, w, b)[1])
    assert any(r.shape == (24, 16) and r.dtype == jnp.float16 for r in residuals)
    monkeypatch.setattr(numerics, "WEIGHT_RESIDUAL_TRANSPOSED", False)
    residuals = jax.tree.leaves(jax.vjp(forms["matmul"], x, w, b)[1])
    assert any(r.shape == (16, 24) and r.dtype == jnp.float16 for r in residuals)


def test_a_sixteen_bit_inputs_gradient_written_by_its_gemm_is_the_converted_one(monkeypatch):
    """numerics.DX_IN_INPUT_DTYPE: the training GEMMs' backward writes an fp16 x's gradient in fp16 itself
    instead of fp32 then a convert: the same fp32 accumulation and one rounding, so the gradient of x
    matches the shipped form's to an fp16 ulp, in x's dtype; an fp32 x's gradient and w's are unchanged."""
    from ttj_jax import numerics
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    w = jax.random.normal(keys[1], (16, 24), jnp.float32) / 4
    b = jax.random.normal(keys[2], (24,), jnp.float32)
    g = jax.random.normal(keys[3], (3, 5, 24), jnp.float32)
    policy = numerics.MIXED_FP16_TRAIN
    forms = {"matmul": lambda x, w, b: policy.matmul(x, w),
             "affine": lambda x, w, b: policy.mlp_hidden(x, w, b)}

    def grads(form, x):
        return jax.grad(lambda x, w, b: jnp.sum(forms[form](x, w, b).astype(jnp.float32) * g), argnums=(0, 1))(x, w, b)
    for x_dtype in (jnp.float16, jnp.float32):
        x = jax.random.normal(keys[0], (3, 5, 16), jnp.float32).astype(x_dtype)
        shipped = {form: grads(form, x) for form in forms}
        monkeypatch.setattr(numerics, "DX_IN_INPUT_DTYPE", True)
        switched = {form: grads(form, x) for form in forms}
        monkeypatch.setattr(numerics, "DX_IN_INPUT_DTYPE", False)
        for form in forms:
            (dx_a, dw_a), (dx_b, dw_b) = shipped[form], switched[form]
            assert dx_a.dtype == dx_b.dtype == x_dtype and dw_b.dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(dw_a), np.asarray(dw_b))
            if x_dtype == jnp.float32:
                np.testing.assert_array_equal(np.asarray(dx_a), np.asarray(dx_b))
            else:
                a32, b32 = np.asarray(dx_a, np.float32), np.asarray(dx_b, np.float32)
                np.testing.assert_allclose(b32, a32, rtol=2 ** -10, atol=2 ** -24)

    def fp16_written_dots(x):   # dot_generals that write fp16 in matmul's program (forward writes fp32)
        text = str(jax.make_jaxpr(lambda x: grads("matmul", x))(x))
        return len(re.findall(r":f16\[[^\]]*\] = dot_general", text))
    x16 = jax.random.normal(keys[0], (3, 5, 16), jnp.float32).astype(jnp.float16)
    assert fp16_written_dots(x16) == 0
    monkeypatch.setattr(numerics, "DX_IN_INPUT_DTYPE", True)
    assert fp16_written_dots(x16) == 1
