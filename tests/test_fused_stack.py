"""The fused layer-stack kernel in interpret mode on the CPU, and its Triton lowering for CUDA.

The GPU run of this same kernel is checked and timed by `bench/bench_fused_stack.py`, not in CI.

Each case is compared three ways:
- against `fused_stack_reference` (plain jnp, same operations in the same order): the two differ only by
  fp32 summation order inside the dots. That alone is ~1e-7 relative, but it occasionally flips an fp16
  rounding of a dot operand (one fp16 ulp, 2**-11 relative, on one element), which moves the outputs
  downstream by up to ~1e-4 and spreads through later layers. Tolerance: REFERENCE_ATOL_PER_LAYER per
  layer (measured worst over these cases: see the module constant), plus one output ulp for fp16/bf16
  outputs. A structural error (a wrong mask, LayerNorm over padded columns) is >= 1e-2; a subtle one
  such as tanh GELU for erf GELU moves the output by only ~5e-4, so `pallas_common.erf` and `gelu` are pinned
  against jax's own on their own.
- against `ttj_jax.forward` (the project's XLA path, same mixed policy): the harness rule, zero failures.
- against the exact fp32 reference (`ttj_jax.reference`): the kernel may be no further from it than the
  XLA mixed path is, up to a factor MIXED_ERROR_FACTOR (both round the same operands to fp16).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import to_torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ttj_jax as T
from bench.baseline import check_close
from ttj_jax.kernels.fused_stack import (
    FusedWeights,
    StackBlocks,
    fused_stack_forward,
    fused_stack_reference,
    stack_weights,
    supports,
)
from ttj_jax.kernels.pallas_common import erf, gelu

REFERENCE_ATOL_PER_LAYER = 3e-4   # measured worst: 1.4e-4 per layer (S32-hd8-H16, one layer)
MIXED_ERROR_FACTOR = 1.5
OUTPUT_UNIT_ROUNDOFF = {jnp.float32: 0.0, jnp.float16: 2.0 ** -10, jnp.bfloat16: 2.0 ** -7}

# (S, d, H, ffn, L, causal, B, block_sequences, x dtype): S in {1, 7, 20, 32, 128}, d in {32, 48, 128},
# head_dim 8 to 128, ffn below and above d, padding of S, d, ffn, head_dim and the batch all exercised.
CASES = {
    "S1-hd8-packed": (1, 32, 4, 32, 1, True, 3, 2, jnp.float32),
    "S7-hd32-noncausal-packed": (7, 32, 1, 128, 4, False, 3, 2, jnp.float32),
    "S7-hd128-fp16": (7, 128, 1, 32, 1, True, 1, 1, jnp.float16),
    "S32-hd8-H16-noncausal-packed": (32, 128, 16, 128, 1, False, 3, 2, jnp.float32),
    "S32-official12-fp16-packed": (32, 128, 4, 128, 4, True, 3, 2, jnp.float16),
    "S32-d32-hd8": (32, 32, 4, 32, 4, True, 1, 1, jnp.float32),
    "S128-official2": (128, 128, 4, 128, 4, True, 1, 1, jnp.float32),
    "S128-hd32-noncausal-fp16": (128, 32, 1, 32, 1, False, 1, 1, jnp.float16),
    "S20-odd-widths-noncausal": (20, 48, 4, 80, 2, False, 2, 1, jnp.float32),
    "S7-bf16": (7, 32, 2, 32, 1, True, 3, 1, jnp.bfloat16),
}


def _model(S, d, H, ffn, L, causal, B, seed=0):
    config = T.Config(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn, num_layers=L, causal=causal)
    params = T.init_params(jax.random.key(seed), config)
    return config, params, stack_weights(T.prepare_weights(params, T.MIXED_FP16), num_heads=H)


def _f32(a):
    return np.asarray(a.astype(jnp.float32))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_forward_and_exact(case, harness_rule):
    S, d, H, ffn, L, causal, B, block_sequences, dtype = CASES[case]
    config, params, weights = _model(S, d, H, ffn, L, causal, B, seed=len(case))
    x = jax.random.normal(jax.random.key(S * d + L), (B, S, d), jnp.float32).astype(dtype)

    y = fused_stack_forward(weights, x, num_heads=H, causal=causal, block_sequences=block_sequences,
                            interpret=True)
    assert y.shape == x.shape and y.dtype == x.dtype
    y32 = _f32(y)
    assert np.isfinite(y32).all()

    reference = _f32(fused_stack_reference(weights, x, num_heads=H, causal=causal))
    rtol = OUTPUT_UNIT_ROUNDOFF[jnp.dtype(dtype).type]
    np.testing.assert_allclose(y32, reference, rtol=rtol, atol=REFERENCE_ATOL_PER_LAYER * L)

    forward = T.forward(params, x, config=config)
    harness_rule(to_torch(y32), to_torch(_f32(forward)))

    exact = _f32(T.reference(params, x.astype(jnp.float32), config=config))
    kernel_error = np.abs(y32 - exact).max()
    mixed_error = np.abs(_f32(forward) - exact).max()
    assert kernel_error <= MIXED_ERROR_FACTOR * mixed_error + 1e-5, (kernel_error, mixed_error)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, derandomize=True)
@given(seq_len=st.integers(1, 70), width=st.sampled_from([(16, 1), (32, 2), (48, 3), (64, 8), (40, 5)]),
       ffn=st.integers(8, 100), layers=st.integers(1, 2), causal=st.booleans(), batch=st.integers(1, 3),
       block_sequences=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_property_any_supported_shape(seq_len, width, ffn, layers, causal, batch, block_sequences, seed):
    d, H = width
    config, params, weights = _model(seq_len, d, H, ffn, layers, causal, batch, seed=seed)
    x = jax.random.normal(jax.random.key(seed), (batch, seq_len, d), jnp.float32)
    y = _f32(fused_stack_forward(weights, x, num_heads=H, causal=causal, block_sequences=block_sequences,
                                 interpret=True))
    reference = _f32(fused_stack_reference(weights, x, num_heads=H, causal=causal))
    np.testing.assert_allclose(y, reference, rtol=0, atol=REFERENCE_ATOL_PER_LAYER * layers)
    failed, worst = check_close(to_torch(y), to_torch(_f32(T.forward(params, x, config=config))))
    assert failed == 0, worst


def test_erf_and_gelu_match_jax():
    # Triton has no erf rule, so the kernel evaluates XLA's rational approximation itself: it must stay
    # within a few fp32 ulps of lax.erf (measured 6e-7 over [-10, 10]) and be the erf GELU, not tanh.
    x = jnp.linspace(-10.0, 10.0, 200_001, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(erf(x)), np.asarray(jax.lax.erf(x)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gelu(x)), np.asarray(jax.nn.gelu(x, approximate=False)),
                               rtol=0, atol=5e-6)


@pytest.mark.slow
def test_block_sequences_only_repack_the_batch():
    # Sequences never see each other: one per program or two packed per program give the same output,
    # up to the summation order of the taller dots.
    _, _, weights = _model(7, 32, 2, 32, 2, False, 4)
    x = jax.random.normal(jax.random.key(3), (4, 7, 32), jnp.float32)
    one = _f32(fused_stack_forward(weights, x, num_heads=2, causal=False, interpret=True))
    two = _f32(fused_stack_forward(weights, x, num_heads=2, causal=False, block_sequences=2, interpret=True))
    four = _f32(fused_stack_forward(weights, x, num_heads=2, causal=False, block_sequences=4, interpret=True))
    np.testing.assert_allclose(two, one, rtol=0, atol=2 * REFERENCE_ATOL_PER_LAYER)
    np.testing.assert_allclose(four, one, rtol=0, atol=2 * REFERENCE_ATOL_PER_LAYER)


def test_causal_prefix_rows_depend_only_on_the_prefix():
    # docs/spec.md: output rows [:K] under causal attention depend only on input rows [:K].
    _, _, weights = _model(32, 32, 4, 32, 2, True, 1)
    x = jax.random.normal(jax.random.key(4), (1, 32, 32), jnp.float32)
    full = _f32(fused_stack_forward(weights, x, num_heads=4, causal=True, interpret=True))
    prefix = _f32(fused_stack_forward(weights, x[:, :11], num_heads=4, causal=True, interpret=True))
    np.testing.assert_allclose(full[:, :11], prefix, rtol=0, atol=2 * REFERENCE_ATOL_PER_LAYER)


def test_two_runs_are_bit_identical():
    _, _, weights = _model(20, 48, 4, 80, 1, True, 2)
    x = jax.random.normal(jax.random.key(5), (2, 20, 48), jnp.float32)
    first = np.asarray(fused_stack_forward(weights, x, num_heads=4, causal=True, interpret=True))
    second = np.asarray(fused_stack_forward(weights, x, num_heads=4, causal=True, interpret=True))
    np.testing.assert_array_equal(first.view(np.uint32), second.view(np.uint32))


def test_stacked_weights_are_zero_padded_per_head():
    config, params, weights = _model(7, 48, 4, 80, 2, True, 1)   # d 48 -> 64, ffn 80 -> 128, head_dim 12 -> 16
    assert (weights.d_model, weights.num_heads, weights.ffn_dim, weights.num_layers) == (48, 4, 80, 2)
    assert weights.qkv_weight.shape == (2, 3, 4, 64, 16) and weights.qkv_weight.dtype == jnp.float16
    assert weights.out_weight.shape == (2, 4, 16, 64) and weights.ffn_in_weight.shape == (2, 64, 128)
    assert weights.norm1_weight.shape == (2, 64) and weights.norm1_weight.dtype == jnp.float32
    padding = {   # every padded slot must be zero: padding is exact only then
        "qkv_weight": [np.s_[..., 48:, :], np.s_[..., 12:]], "qkv_bias": [np.s_[..., 12:]],
        "out_weight": [np.s_[:, :, 12:, :], np.s_[..., 48:]],
        "ffn_in_weight": [np.s_[:, 48:, :], np.s_[..., 80:]], "ffn_in_bias": [np.s_[..., 80:]],
        "ffn_out_weight": [np.s_[:, 80:, :], np.s_[..., 48:]],
        **{name: [np.s_[..., 48:]] for name in ("norm1_weight", "norm1_bias", "out_bias", "norm2_weight",
                                                "norm2_bias", "ffn_out_bias", "final_norm_weight",
                                                "final_norm_bias")},
    }
    assert set(padding) == set(FusedWeights.FIELDS)
    for name, slices in padding.items():
        for index in slices:
            assert not np.asarray(weights.arrays[name])[index].any(), (name, index)
    # Head 1's k columns are columns d + 12 .. d + 24 of the fused [d, 3d] qkv weight.
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    np.testing.assert_array_equal(np.asarray(weights.qkv_weight[1, 1, 1, :48, :12]),
                                  np.asarray(prepared.layers[1]["qkv_weight"][:, 48 + 12:48 + 24]))
    # A pytree: survives jit with its static widths.
    assert jax.jit(lambda w: w)(weights).head_dim == 12


def test_stack_weights_accepts_raw_params():
    config, params, weights = _model(7, 32, 2, 32, 1, True, 1)
    from_raw = stack_weights(params, num_heads=2)
    for name in FusedWeights.FIELDS:
        np.testing.assert_array_equal(np.asarray(from_raw.arrays[name]), np.asarray(weights.arrays[name]))


def test_supports_the_launch_bound_official_shapes():
    supported = {shape_id for shape_id, shape in T.OFFICIAL.items() if supports(shape.config, shape.config.seq_len)}
    assert supported == {"1", "2", "3", "4", "5", "6", "7", "9", "10", "11", "12"}   # not 8 (d 1024), 13, 14
    assert not supports(T.Config(1, 8, 32, 8, 32, 1), 8)        # head_dim 4
    assert not supports(T.Config(1, 8, 64, 4, 1024, 1), 8)      # ffn 1024
    assert not supports(T.Config(1, 8, 64, 4, 64, 1), 257)      # S 257


_WEIGHTS = _model(5, 32, 2, 32, 1, True, 2)[2]
_X = jnp.zeros((2, 5, 32), jnp.float32)


@pytest.mark.parametrize("args,kwargs,name", [
    ((_WEIGHTS, _X[0]), {}, "x.shape"),                                               # rank 2
    ((_WEIGHTS, jnp.zeros((2, 5, 48))), {}, "d_model"),                              # width differs
    ((_WEIGHTS, _X.astype(jnp.int32)), {}, "x.dtype"),                                # not floating
    ((_WEIGHTS, jnp.zeros((1, 257, 32))), {}, "seq_len"),                            # S > 256
    ((_WEIGHTS, _X), {"num_heads": 4}, "num_heads"),                                  # not the weights' H
    ((_WEIGHTS, _X), {"causal": 1}, "causal"),                                        # not a bool
    ((_WEIGHTS, _X), {"block_sequences": 3}, "block_sequences"),                      # not a power of two
    ((_WEIGHTS, jnp.zeros((2, 128, 32))), {"block_sequences": 4}, "rows"),           # 4 * 128 rows > 256
    ((_WEIGHTS, _X), {"ffn_block": 8}, "ffn_block"),                                  # < 16
    ((_WEIGHTS, _X), {"num_warps": 3}, "num_warps"),
    ((_WEIGHTS, _X), {"num_stages": 0}, "num_stages"),
    ((T.prepare_weights(T.init_params(jax.random.key(0), T.Config(1, 5, 32, 2, 32, 1)), T.MIXED_FP16), _X),
     {}, "FusedWeights"),                                                             # not stacked
])
def test_bad_inputs_name_the_argument(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        fused_stack_forward(*args, **({"num_heads": 2, "causal": True, "interpret": True} | kwargs))


@pytest.mark.parametrize("d,H,ffn,policy,name", [
    (512, 4, 64, "mixed_fp16", "d_model=512"),
    (64, 4, 1024, "mixed_fp16", "ffn_dim=1024"),
    (32, 8, 32, "mixed_fp16", "head_dim=4"),
    (256, 1, 64, "mixed_fp16", "head_dim=256"),
    (32, 2, 32, "exact_fp32", "policy_name"),
])
def test_stack_weights_rejects_what_the_kernel_cannot_run(d, H, ffn, policy, name):
    params = T.init_params(jax.random.key(0), T.Config(1, 4, d, H, ffn, 1))
    with pytest.raises(ValueError, match=name):
        stack_weights(T.prepare_weights(params, T.get_policy(policy)), num_heads=H)


def test_stack_blocks_validate_themselves():
    assert StackBlocks() == StackBlocks(block_sequences=1, ffn_block=64, num_warps=8, num_stages=1)
    for field, value in [("block_sequences", 0), ("ffn_block", 48), ("num_warps", 32), ("num_stages", True)]:
        with pytest.raises(ValueError, match=field):
            StackBlocks(**{field: value})


def _lower_for_cuda(S, d, H, ffn, L, B, block_sequences, dtype=jnp.float32, causal=True):
    config = T.Config(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn, num_layers=L, causal=causal)
    params = jax.eval_shape(lambda: T.init_params(jax.random.key(0), config))
    weights = jax.eval_shape(lambda p: stack_weights(T.prepare_weights(p, T.MIXED_FP16), num_heads=H), params)
    x = jax.ShapeDtypeStruct((B, S, d), dtype)
    forward = lambda w, x: fused_stack_forward(w, x, num_heads=H, causal=causal, block_sequences=block_sequences)
    return jax.jit(forward).trace(weights, x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("S,d,H,ffn,L,B,block_sequences,dtype", [
    (128, 128, 4, 128, 4, 64, 1, jnp.float32),    # official shapes 1-4
    (32, 128, 4, 128, 4, 64, 2, jnp.float16),     # official 12, two sequences per program
    (128, 32, 4, 32, 4, 64, 1, jnp.float32),      # official 7: head_dim 8, d 32
    (128, 128, 16, 128, 4, 64, 1, jnp.float32),   # official 11: head_dim 8, 16 heads
    (20, 48, 4, 80, 3, 3, 2, jnp.bfloat16),       # every width padded, 3 layers, a padded batch
])
def test_kernel_lowers_through_triton_for_cuda(S, d, H, ffn, L, B, block_sequences, dtype):
    # Runs Pallas's Triton lowering (to Triton IR, no GPU needed) on the CPU: catches a primitive the
    # Triton backend cannot lower (erf, for one, has no rule: hence `pallas_common.erf`) long before the H200 does.
    # Compiling that IR to PTX still needs Triton itself (bench/bench_fused_stack.py --ptxas).
    try:
        jax.jit(lambda x: x + 1).trace(jnp.zeros(4)).lower(lowering_platforms=("cuda",))
    except Exception as exc:  # noqa: BLE001 - this jaxlib cannot lower for CUDA at all
        pytest.skip(f"no CUDA lowering in this jaxlib: {exc}")
    text = _lower_for_cuda(S, d, H, ffn, L, B, block_sequences, dtype)
    assert "triton" in text
    assert text.count("stablehlo.custom_call") == 1   # the whole stack is one kernel launch
    if (S, d, ffn) in ((128, 128, 128), (32, 128, 128), (128, 32, 32)) and B % block_sequences == 0:
        # Official widths need no padding: the launch is all there is (reshapes are free).
        ops = set(re.findall(r"stablehlo\.(\w+)", text))
        assert ops <= {"custom_call", "reshape", "return"}, ops


def test_bench_script_imports_and_explains_itself(capsys):
    from bench import bench_fused_stack
    with pytest.raises(SystemExit) as exit_info:
        bench_fused_stack.main(["--help"])
    assert exit_info.value.code == 0 and "--ptxas" in capsys.readouterr().out
    assert all(supports(T.OFFICIAL[s].config, T.OFFICIAL[s].config.seq_len) for s in bench_fused_stack.SHAPE_IDS)


# Masks (docs/spec.md): (S, d, H, ffn, L, causal, B, block_sequences, mask kind).
MASKED_CASES = {
    "prefix-causal-S32": (32, 64, 4, 64, 2, True, 3, 1, "prefix"),
    "general-causal-S20-packed": (20, 32, 2, 48, 2, True, 4, 2, "general"),
    "general-noncausal-S7": (7, 32, 4, 32, 2, False, 3, 1, "general"),
    "general-noncausal-S32-packed": (32, 64, 8, 64, 1, False, 4, 2, "general"),
    "all-true-S16": (16, 32, 2, 32, 1, True, 2, 1, "all"),
}


def _mask(kind, B, S, seed):
    rng = np.random.default_rng(seed)
    if kind == "all":
        mask = np.ones((B, S), bool)
    elif kind == "prefix":
        lengths = rng.integers(1, S + 1, B)
        mask = np.arange(S)[None, :] < lengths[:, None]
    else:
        mask = rng.random((B, S)) < 0.6
        mask[0] = False                     # a sequence with no valid token at all: zeros, never NaN
    return jnp.asarray(mask)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MASKED_CASES))
def test_masked_calls_match_reference_and_forward(case, harness_rule):
    S, d, H, ffn, L, causal, B, block_sequences, kind = MASKED_CASES[case]
    config, params, weights = _model(S, d, H, ffn, L, causal, B, seed=len(case) + 7)
    x = jax.random.normal(jax.random.key(S + d), (B, S, d), jnp.float32)
    mask = _mask(kind, B, S, seed=len(case))
    y = _f32(fused_stack_forward(weights, x, mask, num_heads=H, causal=causal,
                                 block_sequences=block_sequences, interpret=True))
    assert np.isfinite(y).all()
    assert (y[~np.asarray(mask)] == 0).all()                       # invalid rows exactly zero
    reference = _f32(fused_stack_reference(weights, x, mask, num_heads=H, causal=causal))
    np.testing.assert_allclose(y, reference, rtol=0, atol=REFERENCE_ATOL_PER_LAYER * L)
    harness_rule(to_torch(y), to_torch(_f32(T.forward(params, x, mask, config=config))))
    # int8 masks (what a direct launch hands over: a torch bool tensor's bytes) read the same
    y8 = _f32(fused_stack_forward(weights, x, mask.astype(jnp.int8), num_heads=H, causal=causal,
                                  block_sequences=block_sequences, interpret=True))
    np.testing.assert_array_equal(y8, y)


def test_a_mask_changes_what_it_must():
    # Without causal attention, masking a key changes every valid row; the unmasked call must differ.
    _, _, weights = _model(8, 32, 2, 32, 1, False, 1)
    x = jax.random.normal(jax.random.key(5), (1, 8, 32), jnp.float32)
    mask = jnp.asarray([[True] * 6 + [False] * 2])
    masked = _f32(fused_stack_forward(weights, x, mask, num_heads=2, causal=False, interpret=True))
    plain = _f32(fused_stack_forward(weights, x, num_heads=2, causal=False, interpret=True))
    assert np.abs(masked[0, :6] - plain[0, :6]).max() > 1e-3


@pytest.mark.parametrize("mask, name", [(jnp.ones((2, 5), bool), "shape"), (jnp.ones((2, 8), jnp.float32), "dtype")])
def test_bad_masks_name_the_problem(mask, name):
    _, _, weights = _model(8, 32, 2, 32, 1, True, 2)
    x = jnp.zeros((2, 8, 32), jnp.float32)
    with pytest.raises(ValueError, match=f"valid_token_mask.{name}"):
        fused_stack_forward(weights, x, mask, num_heads=2, causal=True, interpret=True)


@pytest.mark.parametrize("S,d,block_sequences", [(128, 128, 1), (32, 128, 2), (20, 48, 1)])
def test_masked_kernel_lowers_through_triton_for_cuda(S, d, block_sequences):
    # The mask path (an int8 row vector, compared and broadcast to the score tile) must lower too; an
    # int8 mask on a copy-free shape adds nothing around the one kernel.
    config, params, weights = _model(S, d, 4, d, 2, True, 4)
    x = jax.ShapeDtypeStruct((4, S, d), jnp.float32)
    mask = jax.ShapeDtypeStruct((4, S), jnp.int8)
    forward = lambda w, x, m: fused_stack_forward(w, x, m, num_heads=4, causal=True,
                                                  block_sequences=block_sequences)
    text = jax.jit(forward).trace(weights, x, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call") == 1
    if S in (128, 32):
        assert set(re.findall(r"stablehlo\.(\w+)", text)) <= {"custom_call", "reshape", "return"}


@pytest.mark.slow
def test_unrolled_loops_compute_the_same():
    # unroll=True (a tiling for the GPU to time) writes the head and MLP loops as straight-line code:
    # the same operations in the same order, so the same numbers; it still lowers to one kernel.
    _, _, weights = _model(32, 64, 4, 128, 2, True, 2)
    x = jax.random.normal(jax.random.key(11), (2, 32, 64), jnp.float32)
    looped = fused_stack_forward(weights, x, num_heads=4, causal=True, interpret=True)
    unrolled = fused_stack_forward(weights, x, num_heads=4, causal=True, unroll=True, interpret=True)
    np.testing.assert_allclose(_f32(unrolled), _f32(looped), rtol=0, atol=1e-6)
    lowered = jax.jit(lambda w, x: fused_stack_forward(w, x, num_heads=4, causal=True, unroll=True)).trace(
        weights, x).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("stablehlo.custom_call") == 1
    with pytest.raises(ValueError, match="unroll"):
        StackBlocks(unroll=1)
