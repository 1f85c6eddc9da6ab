"""What the attention kernels share: the masked-key score, argument checks and the plain-jnp reference
they are tested against (`flash_attention.py`, the generic kernel; `flash_attention_mgpu.py`, the Hopper one)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax

# What the Mosaic GPU kernels' key-masked builds add to an invalid key's score: far below any real
# score (softmax weight exp2(-1.8e5) or less, 0 in fp32, at head_dim up to 128), yet small enough that
# for a row whose keys are all invalid (an invalid token's) s * scale - m, which the compiler may fuse
# into one multiply-add, stays within a few hundredths of its exact value: with -1e30 that rounding
# difference alone overflowed exp2 to inf and the row turned NaN (seen in GPU interpret mode), which
# reached the valid rows through P v.
MASKED_SCORE = -1e6   # flash_attention_mgpu_kernel.py and fused_stack_mgpu_kernel.py


def check_qkv_layout(q, k, v):
    """q, k, v are [batch, seq_len, num_heads, head_dim] arrays of one shape and one dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}.shape={x.shape} must be [batch, seq_len, num_heads, head_dim] (rank 4)")
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q.shape={q.shape}, k.shape={k.shape} and v.shape={v.shape} must match")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q.dtype={q.dtype}, k.dtype={k.dtype} and v.dtype={v.dtype} must match")


def fused_qkv_view(qkv) -> jax.ShapeDtypeStruct:
    """q, k or v as one slot of a fused [batch, seq_len, 3, num_heads, head_dim] array shows it ([B, S, H,
    head_dim], qkv's dtype); raises where qkv has another layout."""
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv.shape={qkv.shape} must be [batch, seq_len, 3, num_heads, head_dim]")
    return jax.ShapeDtypeStruct(qkv.shape[:2] + qkv.shape[3:], qkv.dtype)


def check_causal_and_scale(causal, sm_scale):
    """The static arguments both attention kernels share."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r} must be a bool")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real)):
        raise ValueError(f"sm_scale={sm_scale!r} must be a Python float or None")


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                        kv_lengths: jax.Array | None = None, key_mask: jax.Array | None = None,
                        sm_scale: float | None = None, precision=lax.Precision.HIGHEST) -> jax.Array:
    """Plain-jnp attention with `flash_attention`'s semantics, computed in fp32 (materialises [B,H,S,S]).

    Returns q's dtype. A query with no allowed key gets zeros.
    """
    batch, seq_len, _, head_dim = q.shape
    sm_scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q32, k32, precision=precision) * sm_scale  # (B, H, S, S)
    positions = jnp.arange(seq_len)
    allowed = jnp.ones((batch, 1, seq_len, seq_len), bool)
    if causal:
        allowed &= positions[:, None] >= positions[None, :]
    if kv_lengths is not None:
        allowed &= (positions[None, :] < kv_lengths[:, None])[:, None, None, :]
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    scores = jnp.where(allowed, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # rows with no allowed key
    weights = jnp.where(allowed, jnp.exp(scores - row_max), 0.0)
    row_sum = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(row_sum > 0, row_sum, 1.0)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v32, precision=precision)  # (B, S, H, hd)
    return out.astype(q.dtype)
