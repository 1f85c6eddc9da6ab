"""The fp32 reference of docs/spec.md's model in bounded memory, for sequences whose [S, S] scores cannot exist.

Same semantics and numerics as `ttj_jax.reference.reference_forward` (fp32, `precision=HIGHEST`, erf GELU,
the same masking rules), computed so that no [S, S] or [H, S, S] tensor is ever built:

- one sequence at a time (`lax.map` over the batch), so the live activations are O(S * d);
- projections and the MLP on the whole sequence: O(S * d) and O(S * ffn), which is what one sequence holds;
- attention per query chunk (`lax.map`), and inside it an exact online softmax over key chunks
  (`lax.fori_loop`): a running max m, a running sum l and an unnormalised context acc, all fp32, so
  the live scores are [H, query_chunk, key_chunk]. A new key chunk with scores s updates them as
      m' = max(m, rowmax(s)),  l' = l * exp(m - m') + rowsum(exp(s - m')),  acc' = acc * exp(m - m') + exp(s - m') @ v
  and context = acc / l at the end: the same softmax, with the normalisation done once instead of per key.
- Under causal attention a query chunk stops at the last key chunk that holds a key at or before its last
  query: the key chunks wholly above the diagonal are never computed (the loop's trip count depends on
  the chunk index, so XLA runs it as a while loop; the memory stays one chunk's worth).

The sequence is padded at its end to a multiple of each chunk size; padded keys are excluded like masked
keys and padded query rows are dropped, so any S works.

Masked keys get -inf and a running max of -inf is replaced by 0 before it is subtracted: a query whose
keys are all excluded so far contributes exp(-inf) = 0, never NaN. A row with no allowed key at all
(l == 0: an invalid query of a sequence without valid tokens, or a padded row) gets a zero context;
every such row is zeroed afterwards anyway (docs/spec.md), where the reference's NaN is replaced too.

The result differs from `reference_forward` by fp32 rounding only: the softmax is summed in a different
order (per chunk, rescaled) and normalised after the `probs @ v` product instead of before it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ttj_jax.config import Config
from ttj_jax.numerics import gelu_exact, layer_norm

HIGHEST = lax.Precision.HIGHEST

# Defaults sized for one GPU: the live scores are H * 1024 * 1024 * 4 bytes (64 MiB at H=16).
QUERY_CHUNK = 1024
KEY_CHUNK = 1024


def _linear(x, linear):
    # As in reference.py: y = x @ W.T + b in fp32 at the highest precision.
    return jnp.matmul(x, linear["weight"].astype(jnp.float32).T, precision=HIGHEST) + linear["bias"]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_rows(t, rows: int):
    return jnp.pad(t, [(0, rows - t.shape[0])] + [(0, 0)] * (t.ndim - 1))


def _chunked_attention(q, k, v, key_ok, *, causal: bool, query_chunk: int, key_chunk: int):
    """q, k, v: (S, H, hd) fp32, unscaled (the scale multiplies the scores, as in the reference).
    key_ok: (S,) bool, the keys any query may attend to, causality aside. Returns the context (S, H, hd)."""
    S, H, hd = q.shape
    scale = hd ** -0.5
    q_rows, k_rows = _round_up(S, query_chunk), _round_up(S, key_chunk)
    num_key_chunks = k_rows // key_chunk
    q_chunks = _pad_rows(q, q_rows).reshape(q_rows // query_chunk, query_chunk, H, hd)
    k, v = _pad_rows(k, k_rows), _pad_rows(v, k_rows)                   # (k_rows, H, hd)
    key_ok = _pad_rows(key_ok, k_rows)                                   # padded keys: False

    def one_query_chunk(args):
        index, q_chunk = args
        q_chunk = q_chunk.transpose(1, 0, 2)                             # (H, qc, hd)
        q_pos = index * query_chunk + jnp.arange(query_chunk)

        def one_key_chunk(j, carry):
            m, l, acc = carry                                            # (H, qc), (H, qc), (H, qc, hd)
            start = j * key_chunk
            k_chunk = lax.dynamic_slice_in_dim(k, start, key_chunk).transpose(1, 0, 2)   # (H, kc, hd)
            v_chunk = lax.dynamic_slice_in_dim(v, start, key_chunk).transpose(1, 0, 2)
            allowed = lax.dynamic_slice_in_dim(key_ok, start, key_chunk)[None, :]        # (1, kc)
            if causal:
                allowed = allowed & (start + jnp.arange(key_chunk)[None, :] <= q_pos[:, None])  # (qc, kc)
            scores = jnp.matmul(q_chunk, k_chunk.transpose(0, 2, 1), precision=HIGHEST) * scale  # (H, qc, kc)
            scores = jnp.where(allowed[None], scores, -jnp.inf)
            m_new = jnp.maximum(m, scores.max(axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)            # all excluded so far: exp(-inf) = 0
            p = jnp.exp(scores - m_safe[..., None])
            rescale = jnp.exp(m - m_safe)
            l = l * rescale + p.sum(axis=-1)
            acc = acc * rescale[..., None] + jnp.matmul(p, v_chunk, precision=HIGHEST)
            return m_new, l, acc

        if causal:   # the last key chunk holding a key at or before this chunk's last query
            stop = jnp.minimum(((index + 1) * query_chunk - 1) // key_chunk + 1, num_key_chunks)
        else:
            stop = num_key_chunks
        init = (jnp.full((H, query_chunk), -jnp.inf, jnp.float32), jnp.zeros((H, query_chunk), jnp.float32),
                jnp.zeros((H, query_chunk, hd), jnp.float32))
        _, l, acc = lax.fori_loop(0, stop, one_key_chunk, init)
        context = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
        return context.transpose(1, 0, 2)                                # (qc, H, hd)

    indices = jnp.arange(q_rows // query_chunk)
    context = lax.map(one_query_chunk, (indices, q_chunks))              # (chunks, qc, H, hd)
    return context.reshape(q_rows, H, hd)[:S]


def _sequence_forward(params, x, mask, *, config: Config, query_chunk: int, key_chunk: int):
    """One sequence: x (S, d) fp32, mask (S,) bool or None -> (S, d) fp32."""
    S, d = x.shape
    H, hd = config.num_heads, config.head_dim
    key_ok = jnp.ones((S,), bool) if mask is None else mask
    zero_invalid = (lambda t: t) if mask is None else (lambda t: jnp.where(mask[:, None], t, 0.0))
    for layer in params["layers"]:
        p = layer["attention"]
        h = layer_norm(x, layer["norm1"]["weight"], layer["norm1"]["bias"])
        q, k, v = (_linear(h, p[name]).reshape(S, H, hd) for name in ("q_proj", "k_proj", "v_proj"))
        context = _chunked_attention(q, k, v, key_ok, causal=config.causal, query_chunk=query_chunk,
                                     key_chunk=key_chunk).reshape(S, d)
        x = x + zero_invalid(_linear(context, p["out_proj"]))
        h = layer_norm(x, layer["norm2"]["weight"], layer["norm2"]["bias"])
        x = zero_invalid(x + _linear(gelu_exact(_linear(h, layer["ffn_in"])), layer["ffn_out"]))
    return zero_invalid(layer_norm(x, params["final_norm"]["weight"], params["final_norm"]["bias"]))


@functools.partial(jax.jit, static_argnames=("config", "query_chunk", "key_chunk"))
def _chunked_forward(params, x, mask, *, config: Config, query_chunk: int, key_chunk: int):
    body = functools.partial(_sequence_forward, config=config, query_chunk=query_chunk, key_chunk=key_chunk)
    x = x.astype(jnp.float32)
    if mask is None:
        return lax.map(lambda xs: body(params, xs, None), x)
    return lax.map(lambda xs: body(params, *xs), (x, mask.astype(bool)))


def chunked_reference_forward(params, x, valid_token_mask=None, *, config: Config,
                              query_chunk: int = QUERY_CHUNK, key_chunk: int = KEY_CHUNK):
    """fp32 forward of docs/spec.md's model in O(S * d + H * query_chunk * key_chunk) memory per sequence.

    params: raw params (`init_params` / `params_from_state_dict`); x: (B, S, d); valid_token_mask: bool
    (B, S) or None. Returns fp32 (B, S, d) whatever x's dtype. Chunks larger than S are cut to S (rounded
    up to 8) so short inputs do not pay for padding; config and the chunk sizes are static under jit.
    """
    config = Config.from_object(config)
    if x.ndim != 3 or x.shape[-1] != config.d_model:
        raise ValueError(f"x must be [batch, seq_len, d_model={config.d_model}]; got shape {tuple(x.shape)}")
    if valid_token_mask is not None and tuple(valid_token_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"valid_token_mask must have shape {tuple(x.shape[:2])}; "
                         f"got {tuple(valid_token_mask.shape)}")
    for name, chunk in (("query_chunk", query_chunk), ("key_chunk", key_chunk)):
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"{name}={chunk!r} must be a positive int")
    seq_cap = _round_up(x.shape[1], 8)
    # Batch and sequence length come from x: normalise them away so one compiled program per shape serves.
    return _chunked_forward(params, x, valid_token_mask, config=config.with_input(1, 1),
                            query_chunk=min(query_chunk, seq_cap), key_chunk=min(key_chunk, seq_cap))
