"""The plain-jnp reference forward: docs/spec.md's model line by line, fp32, highest matmul precision,
explicit [B, H, S, S] scores. Tests compare the fast paths against this; it is not meant to be fast."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ttj_jax.config import Config
from ttj_jax.numerics import gelu_exact, layer_norm

HIGHEST = jax.lax.Precision.HIGHEST


def _linear(x, linear):
    return jnp.matmul(x, linear["weight"].astype(jnp.float32).T, precision=HIGHEST) + linear["bias"]


def _attention(p, x, mask, config: Config):
    B, S, d = x.shape
    H, hd = config.num_heads, config.head_dim
    split = lambda t: t.reshape(B, S, H, hd).transpose(0, 2, 1, 3)                      # (B, H, S, hd)
    q, k, v = split(_linear(x, p["q_proj"])), split(_linear(x, p["k_proj"])), split(_linear(x, p["v_proj"]))
    scores = jnp.matmul(q, k.transpose(0, 1, 3, 2), precision=HIGHEST) * hd ** -0.5        # (B, H, S, S)
    if config.causal:
        scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, -jnp.inf)
    if mask is not None:
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    context = jnp.matmul(probs, v, precision=HIGHEST).transpose(0, 2, 1, 3).reshape(B, S, d)
    out = _linear(context, p["out_proj"])
    if mask is not None:
        out = jnp.where(mask[:, :, None], out, 0.0)   # where, not a product: all-masked rows are NaN here
    return out


@functools.partial(jax.jit, static_argnames=("config",))
def reference_forward(params, x, valid_token_mask=None, *, config: Config):
    """fp32 forward of docs/spec.md's model; returns fp32 whatever x's dtype."""
    mask = valid_token_mask
    x = x.astype(jnp.float32)
    for layer in params["layers"]:
        x = x + _attention(layer["attention"], layer_norm(x, layer["norm1"]["weight"], layer["norm1"]["bias"]),
                           mask, config)
        h = layer_norm(x, layer["norm2"]["weight"], layer["norm2"]["bias"])
        x = x + _linear(gelu_exact(_linear(h, layer["ffn_in"])), layer["ffn_out"])
        if mask is not None:
            x = jnp.where(mask[:, :, None], x, 0.0)
    y = layer_norm(x, params["final_norm"]["weight"], params["final_norm"]["bias"])
    if mask is not None:
        y = jnp.where(mask[:, :, None], y, 0.0)
    return y
