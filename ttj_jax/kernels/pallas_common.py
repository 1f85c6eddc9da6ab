"""In-kernel helpers shared by the Pallas whole-stack and row-tile kernels (fused_stack.py, row_block.py,
fused_stack_mgpu_kernel.py), and the weight check their weight builders share.

Everything here is plain jnp/lax, so it lowers through Triton and Mosaic GPU and runs in interpret mode.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ttj_jax.numerics import LAYER_NORM_EPS, MIXED_FP16
from ttj_jax.params import PreparedWeights, prepare_weights

GEMM_DTYPE = jnp.dtype(MIXED_FP16.gemm_dtype)   # fp16: numerics.py owns the choice

# XLA's fp32 rational erf (Eigen's generic_fast_erf_float): x * P(x^2) / Q(x^2), highest power first.
ERF_NUMERATOR = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
                 -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_DENOMINATOR = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                   -7.37332916720468e-03, -1.42647390514189e-02)
ERF_CLAMP = 4.0


def erf(x):
    """erf in fp32 by XLA's rational approximation on x clamped to [-4, 4], within 4e-7 of the exact erf.
    Only multiplies, adds and one divide: Triton's lowering has no erf primitive."""
    x = jnp.clip(x, -ERF_CLAMP, ERF_CLAMP)
    x2 = x * x
    numerator = jnp.float32(ERF_NUMERATOR[0])
    for c in ERF_NUMERATOR[1:]:
        numerator = numerator * x2 + c
    denominator = jnp.float32(ERF_DENOMINATOR[0])
    for c in ERF_DENOMINATOR[1:]:
        denominator = denominator * x2 + c
    return x * numerator / denominator


def gelu(x):
    """The erf GELU, 0.5 x (1 + erf(x / sqrt 2)), with `erf`."""
    return 0.5 * x * (1.0 + erf(x * 0.7071067811865476))


def dot(a, b, *, transpose_b=False):
    """a @ b (or a @ b.T) with fp16 operands, accumulated and returned in fp32."""
    contract = (((1,), (1,)) if transpose_b else ((1,), (0,)), ((), ()))
    return lax.dot_general(a.astype(GEMM_DTYPE), b.astype(GEMM_DTYPE), contract,
                           preferred_element_type=jnp.float32)


def layer_norm_rows(x, weight, bias, *, d_model: int):
    """LayerNorm of each row of x (rows, Dp) over its first d_model columns; columns past d_model are
    zero in x, weight and bias, so they come out zero."""
    inv_d = 1.0 / d_model
    mean = jnp.sum(x, axis=1) * inv_d
    centered = x - mean[:, None]
    if x.shape[1] != d_model:   # padded columns would add mean**2 each to the variance
        columns = lax.broadcasted_iota(jnp.int32, x.shape, 1)
        centered = jnp.where(columns < d_model, centered, 0.0)
    variance = jnp.sum(centered * centered, axis=1) * inv_d
    return centered * lax.rsqrt(variance + LAYER_NORM_EPS)[:, None] * weight[None, :] + bias[None, :]


def loop(count: int, body, carry, unroll: bool = False):
    """body(step, carry) for step in range(count). A one-step loop is just its body (no scf.for in the
    Triton program); unrolled, every step is, with plain int indices."""
    if count == 1:
        return body(0, carry)
    if unroll:
        for step in range(count):
            carry = body(step, carry)
        return carry
    return lax.fori_loop(0, count, body, carry)


def checked_prepared(prepared: PreparedWeights | dict, num_heads, limits_error):
    """(PreparedWeights, d_model, ffn_dim) for a whole-stack kernel's weight builder: raw params prepared
    with the mixed fp16 policy, the policy, num_heads and the kernel's width limits
    (`limits_error(d_model, num_heads, ffn_dim) -> str | None`) checked."""
    if not isinstance(prepared, PreparedWeights):
        prepared = prepare_weights(prepared, MIXED_FP16)
    if prepared.policy_name != MIXED_FP16.name:
        raise ValueError(f"prepared.policy_name={prepared.policy_name!r} must be {MIXED_FP16.name!r}: "
                         "the fused kernels run the mixed fp16 policy only")
    if isinstance(num_heads, bool) or not isinstance(num_heads, int):
        raise ValueError(f"num_heads={num_heads!r} must be an int")
    if prepared.num_layers < 1:
        raise ValueError("prepared has no layers")
    d_model, ffn_dim = prepared.layers[0]["ffn_in_weight"].shape
    error = limits_error(d_model, num_heads, ffn_dim)
    if error:
        raise ValueError(error)
    return prepared, d_model, ffn_dim
