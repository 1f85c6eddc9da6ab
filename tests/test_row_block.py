"""The "rows" stack (kernels/row_block.py) in interpret mode on the CPU: per layer our flash attention and
one row-tile kernel for everything else. Compared with the XLA program (same mixed policy) under the
harness rule and with the exact fp32 reference; masks as docs/spec.md says; its Triton lowering for CUDA.
Its speed is measured on the H200 by `python -m bench.rows_check`, not here."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import to_torch

import ttj_jax as T
from ttj_jax.kernels.row_block import RowsWeights, rows_forward, rows_weights, stacked_weights, supports
from ttj_jax.masks import MaskKind
from ttj_jax.planner import CPU

CASES = {   # (B, S, d, H, ffn, L, causal, mask kind)
    "causal-no-mask": (2, 32, 64, 4, 128, 2, True, None),
    "noncausal-general-mask": (2, 32, 64, 4, 64, 2, False, "general"),
    "causal-prefix-mask-hd16": (4, 16, 32, 2, 32, 1, True, "prefix"),
    "causal-general-mask-S48": (4, 48, 32, 4, 64, 1, True, "general"),
}


def _mask(kind, B, S):
    rng = np.random.default_rng(B * S)
    if kind is None:
        return None
    if kind == "prefix":
        return jnp.asarray(np.arange(S)[None, :] < rng.integers(1, S + 1, B)[:, None])
    mask = rng.random((B, S)) < 0.6
    mask[0] = False                                  # a sequence with no valid token: zeros, never NaN
    return jnp.asarray(mask)


@pytest.mark.parametrize("case", list(CASES))
def test_rows_stack_matches_the_xla_program(case, harness_rule):
    B, S, d, H, ffn, L, causal, kind = CASES[case]
    config = T.Config(B, S, d, H, ffn, L, causal)
    params = T.init_params(jax.random.key(len(case)), config)
    x = jax.random.normal(jax.random.key(S), (B, S, d), jnp.float32)
    mask = _mask(kind, B, S)
    y = np.asarray(T.forward(params, x, mask, config=config, stack="rows"))
    assert np.isfinite(y).all()
    if mask is not None:
        assert (y[~np.asarray(mask)] == 0).all()
    xla = np.asarray(T.forward(params, x, mask, config=config, stack="layers"))
    harness_rule(to_torch(y), to_torch(xla))
    exact = np.asarray(T.reference(params, x, mask, config=config))
    # no further from the exact fp32 reference than the XLA program (both round the same operands)
    assert np.abs(y - exact).max() <= 1.5 * np.abs(xla - exact).max() + 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("mask_kind", [None, "general"])
def test_padded_heads_give_the_unpadded_result(mask_kind, harness_rule):
    """head_dim 8: rows_weights pads each head to the flash kernel's width 16 (q/k/v columns, out-projection
    rows); the row kernels then write q, k, v padded and no copies surround attention. Same output as the
    unpadded weights (where the flash kernel pads itself) up to summation order, and the harness rule
    against the XLA program; the model's rows path takes the padded layout from kernel_weights."""
    B, S, d, H, ffn, L = 2, 32, 64, 8, 64, 2
    config = T.Config(B, S, d, H, ffn, L, True)
    params = T.init_params(jax.random.key(3), config)
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    padded = rows_weights(prepared, H)
    assert padded.layers["qkv_weight"].shape == (L, d, 3 * H * 16)
    assert padded.layers["out_weight"].shape == (L, H * 16, d)
    for layer in range(L):
        w = np.asarray(padded.layers["qkv_weight"][layer], np.float32).reshape(d, 3, H, 16)
        assert (w[..., 8:] == 0).all() and np.array_equal(
            w[..., :8].reshape(d, -1), np.asarray(prepared.layers[layer]["qkv_weight"], np.float32))
    assert rows_weights(T.prepare_weights(T.init_params(jax.random.key(0), T.Config(1, 16, 64, 4, 64, 1, True)),
                                          T.MIXED_FP16), 4).layers["qkv_weight"].shape == (1, 64, 192)   # hd 16: as is
    x = jax.random.normal(jax.random.key(5), (B, S, d), jnp.float32)
    mask = _mask(mask_kind, B, S)
    key_valid = None if mask is None else mask
    run = lambda weights: np.asarray(rows_forward(weights, x, mask, key_valid, num_heads=H, causal=True,  # noqa: E731
                                                  interpret=True))
    np.testing.assert_allclose(run(padded), run(prepared), rtol=0, atol=2e-4)
    y = np.asarray(T.forward(prepared, x, mask, config=config, stack="rows"))
    assert T.model.kernel_weights(prepared, T.model_key(config), "rows").layers["qkv_weight"].shape[-1] == 3 * H * 16
    harness_rule(to_torch(y), to_torch(T.forward(params, x, mask, config=config, stack="layers")))
    with pytest.raises(ValueError, match="width"):
        rows_forward(padded, x, num_heads=4, causal=True, interpret=True)


@pytest.mark.slow
def test_stacked_weights_are_fourteen_arrays_and_give_the_per_layer_result():
    """RowsWeights holds each per-layer weight stacked over the layers: the program takes 14 arrays at
    any depth (jax's dispatch costs ~1 us of host time per argument), and each kernel reads its layer's
    slice in place. The output equals running the same kernels on PreparedWeights (stacked inside the
    call), bit for bit: the kernels read the same values."""
    B, S, d, H, ffn, L = 2, 32, 64, 4, 128, 3
    config = T.Config(B, S, d, H, ffn, L, True)
    prepared = T.prepare_weights(T.init_params(jax.random.key(11), config), T.MIXED_FP16)
    stacked = stacked_weights(prepared)
    assert isinstance(stacked, RowsWeights) and stacked.num_layers == L
    assert len(jax.tree_util.tree_leaves(stacked)) == 14 and len(jax.tree_util.tree_leaves(prepared)) == 12 * L + 2
    for name, array in stacked.layers.items():
        for layer in range(L):
            assert np.array_equal(np.asarray(array[layer]), np.asarray(prepared.layers[layer][name])), name
    x = jax.random.normal(jax.random.key(2), (B, S, d), jnp.float32)
    run = lambda w: np.asarray(rows_forward(w, x, num_heads=H, causal=True, interpret=True))  # noqa: E731
    assert np.array_equal(run(stacked), run(prepared))
    # the layers are distinct: swapping two layers' weights changes the output
    swapped = RowsWeights({k: v[jnp.array([1, 0, 2])] for k, v in stacked.layers.items()}, stacked.final_norm,
                          stacked.policy_name)
    assert not np.allclose(run(swapped), run(stacked))


def test_padded_heads_lower_with_no_copies_around_attention():
    config = T.OFFICIAL["11"].config   # 16 heads of 8
    params = jax.eval_shape(lambda: T.init_params(jax.random.key(0), config))
    padded = jax.eval_shape(lambda p: rows_weights(T.prepare_weights(p, T.MIXED_FP16), 16), params)
    x = jax.ShapeDtypeStruct((2, 128, 128), jnp.float32)
    text = jax.jit(lambda w, x: rows_forward(w, x, num_heads=16, causal=True)).trace(padded, x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "ttj_flash_attention" in text and "ttj_rows_between" in text
    assert set(re.findall(r"stablehlo\.(\w+)", text)) <= {"custom_call", "reshape", "return", "call"}


def test_planner_takes_the_rows_stack_between_the_fused_kernel_and_long_sequences():
    from ttj_jax.planner import ROWS_STACK_MAX_SEQ_LEN
    h200 = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30)
    shape_13 = T.OFFICIAL["13"].config
    for kind in (MaskKind.ALL_TRUE, MaskKind.PREFIX, MaskKind.UNKNOWN):
        plan = T.plan(shape_13, T.InputFacts(64, 1024, "float32", kind), h200)
        assert plan.stack == "rows" and plan.attention == "pallas" and "row-tile" in plan.explain()
    assert T.plan(shape_13, T.InputFacts(64, 1024, "float32"), CPU).stack == "layers"     # GPU only
    longer = shape_13.with_input(4, 2 * ROWS_STACK_MAX_SEQ_LEN)
    assert T.plan(longer, T.InputFacts(4, longer.seq_len, "float32"), h200).stack == "layers"  # unmeasured
    odd = shape_13.with_input(1, 1000)                                   # 1000 rows: not a multiple of 64
    assert T.plan(odd, T.InputFacts(1, 1000, "float32"), h200).stack == "layers"
    assert T.plan(T.OFFICIAL["8"].config, T.InputFacts(64, 128, "float32"), h200).stack == "layers"
    assert T.plan(shape_13, T.InputFacts(64, 1024, "float32"), h200, attention="xla").stack == "layers"


def test_rows_stack_needs_what_it_says():
    assert supports(T.OFFICIAL["13"].config) and supports(T.OFFICIAL["1"].config)
    assert not supports(T.OFFICIAL["8"].config)                     # d_model 1024
    config = T.Config(1, 20, 32, 2, 32, 1, True)                     # 20 rows: not a multiple of 64
    with pytest.raises(ValueError, match="multiple of 64"):
        T.plan(config, T.InputFacts(1, 20, "float32"), stack="rows")
    prepared = T.prepare_weights(T.init_params(jax.random.key(0), config), T.MIXED_FP16)
    with pytest.raises(ValueError, match="block_rows"):
        rows_forward(prepared, jnp.zeros((1, 20, 32)), num_heads=2, causal=True, interpret=True)


@pytest.mark.parametrize("masked", [False, True])
def test_rows_stack_lowers_through_triton_for_cuda(masked):
    # Shape 13's widths, a smaller batch: one entry kernel, then per layer attention and one row kernel
    # (jit outlines repeated identical calls, so the text names each kernel rather than counting calls).
    config = T.OFFICIAL["13"].config
    params = jax.eval_shape(lambda: T.init_params(jax.random.key(0), config))
    weights = jax.eval_shape(lambda p: rows_weights(T.prepare_weights(p, T.MIXED_FP16), 4), params)
    x = jax.ShapeDtypeStruct((2, 1024, 128), jnp.float32)
    mask = jax.ShapeDtypeStruct((2, 1024), jnp.bool_)
    forward = lambda w, x, m: rows_forward(w, x, m, m, num_heads=4, causal=True)   # rows and keys masked
    text = jax.jit(forward).trace(weights, x, mask if masked else None).lower(lowering_platforms=("cuda",)).as_text()
    assert "ttj_rows_entry" in text and "ttj_rows_between" in text and "ttj_flash_attention" in text
    # nothing around the kernels but free reshapes: the kernels read their layer of the stacked weights
    # in place (no per-call slicing or stacking); a mask, only as the bool's bytes (a convert to i8, which
    # the bridge's launch takes as a view: bridge/triton_launch.py)
    ops = set(re.findall(r"stablehlo\.(\w+)", text))
    assert ops <= {"custom_call", "reshape", "return", "call"} | ({"convert"} if masked else set())
    if masked:
        converts = re.findall(r"stablehlo\.convert .*: \(tensor<([\dx]+)xi1>\) -> tensor<([\dx]+)xi8>", text)
        assert converts and len(converts) == text.count("stablehlo.convert")
        assert all(before == after for before, after in converts)


def test_gpu_script_refuses_a_machine_without_cuda(capsys):
    from bench import rows_check
    assert rows_check.main(["--shapes", "13"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert rows_check.stacks_for(T.OFFICIAL["13"].config) == ["layers", "rows"]
    assert rows_check.stacks_for(T.OFFICIAL["1"].config) == ["layers", "rows", "fused"]
