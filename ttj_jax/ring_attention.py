"""Sequence parallelism: one sequence split over the devices of a mesh axis, attention as a ring
(the design: docs/sequence-parallel.md).

Everything in a layer but attention is token-local, so each device runs the usual layer code
(`model._layer`) on its own tokens; only attention is replaced, by `ring_attention`: the devices pass
their keys and values around a ring (`lax.ppermute`), N - 1 hops for N devices, and every device keeps
an online softmax (running max, sum and unnormalised context, fp32) for its own queries, merged over the
visiting blocks. The ppermute of the next block is issued before the current block's compute, so XLA may
overlap the two; a device holds two k/v blocks at a time.

Layout: the sequence is cut into 2N equal chunks and device i holds chunks i and 2N-1-i ("zigzag",
`zigzag_order`), so that under causal attention every device has the same amount of work (with
contiguous slices the last device would do N times the first's). Positions travel with the keys, so
causality and the key mask are decided per (query, key) pair wherever the pair meets.

Inside one visit the work is bounded: queries in chunks (`lax.map`), keys in chunks (`lax.fori_loop`),
live scores [B, H, query_chunk, key_chunk]; a key chunk wholly after a query chunk's last position is
skipped under causal attention (`lax.cond`), which halves the work over the ring.

Numerics are the plan's policy (numerics.py): the two dots with gemm_dtype operands and fp32
accumulation, softmax statistics in fp32. Masks: the key mask (with row zeroing, done by the layer code)
is the general semantics of SPEC section 1, so every mask mode runs as "keys" here: the "rows" and
"device" shortcuts of the one-device program need whole sequences.

Status: correctness, CPU-tested on 2 and 4 host devices against the one-device forward
(tests/test_ring_attention.py). Not run on a GPU; its attention is plain XLA per chunk pair, not our
flash kernel (which would need to return its log-sum-exp: the design's step 1), so it is a working
ring, not yet a fast one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from ttj_jax.compat import shard_map
from ttj_jax.config import Config
from ttj_jax.numerics import get_policy
from ttj_jax.params import PreparedWeights, prepare_weights

SEQ_AXIS = "seq"
QUERY_CHUNK = 512
KEY_CHUNK = 512


def zigzag_order(seq_len: int, devices: int) -> np.ndarray:
    """The sequence's token positions in the order they are laid out over `devices` (device-major): of
    2 * devices equal chunks, device i holds chunk i then chunk 2 * devices - 1 - i."""
    if devices < 1 or seq_len % (2 * devices):
        raise ValueError(f"seq_len {seq_len} must be a multiple of 2 * devices = {2 * devices} for the ring's "
                         "zigzag layout")
    chunks = np.arange(seq_len).reshape(2 * devices, seq_len // (2 * devices))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * devices - 1 - i]]) for i in range(devices)])


@functools.lru_cache(maxsize=None)
def sequence_mesh(devices: int, platform: str) -> Mesh:
    available = jax.devices(platform)
    if len(available) < devices:
        raise ValueError(f"sequence parallelism over {devices} {platform} devices; {len(available)} are visible")
    return Mesh(np.array(available[:devices]), (SEQ_AXIS,))


def _chunk(size: int, wanted: int) -> int:
    """The largest divisor of size that is at most wanted."""
    return next(c for c in range(min(size, wanted), 0, -1) if size % c == 0)


def ring_attention(qkv: jax.Array, key_valid: jax.Array | None, positions: jax.Array, *, causal: bool,
                   policy, devices: int, query_chunk: int = QUERY_CHUNK, key_chunk: int = KEY_CHUNK,
                   axis_name: str = SEQ_AXIS) -> jax.Array:
    """Inside shard_map over `axis_name` (`devices` long). qkv: (B, L, 3, H, hd), this device's tokens;
    key_valid: (B, L) bool or None; positions: (L,) int32, their places in the sequence. Returns the
    context (B, L, H, hd) fp32; a query with no allowed key gets zeros."""
    B, L, _, H, hd = qkv.shape
    qc, kc = _chunk(L, query_chunk), _chunk(L, key_chunk)
    nq, nk = L // qc, L // kc
    scale = hd ** -0.5
    q = (qkv[:, :, 0] * scale).reshape(B, nq, qc, H, hd).transpose(1, 0, 2, 3, 4)       # (nq, B, qc, H, hd)
    q_pos = positions.reshape(nq, qc)
    key_ok = jnp.ones((B, L), bool) if key_valid is None else key_valid
    # What travels: k and v in gemm dtype (half the bytes of fp32 under mixed_fp16), positions, key mask.
    block = (qkv[:, :, 1:].astype(policy.gemm_dtype), positions, key_ok)

    def visit(state, block):
        kv, k_pos, k_ok = block
        kv = kv.reshape(B, nk, kc, 2, H, hd)
        k_pos, k_ok = k_pos.reshape(nk, kc), k_ok.reshape(B, nk, kc)

        def per_query_chunk(args):
            q_chunk, qp, (m, l, acc) = args            # (B, qc, H, hd), (qc,), (B, H, qc) x2, (B, qc, H, hd)

            def update(j, carry):
                m, l, acc = carry
                kv_j = lax.dynamic_index_in_dim(kv, j, axis=1, keepdims=False)            # (B, kc, 2, H, hd)
                kp = lax.dynamic_index_in_dim(k_pos, j, keepdims=False)                   # (kc,)
                allowed = lax.dynamic_index_in_dim(k_ok, j, axis=1, keepdims=False)[:, None, None, :]
                if causal:
                    allowed = allowed & (kp[None, :] <= qp[:, None])[None, None]         # (B, 1, qc, kc)
                s = policy.einsum("bqhd,bkhd->bhqk", q_chunk, kv_j[:, :, 0])              # (B, H, qc, kc)
                s = jnp.where(allowed, s.astype(policy.statistics_dtype), -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=-1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # no allowed key yet: no NaN
                p = jnp.exp(s - m_safe[..., None])
                correction = jnp.exp(m - m_safe)
                l = l * correction + p.sum(axis=-1)
                pv = policy.einsum("bhqk,bkhd->bqhd", p, kv_j[:, :, 1])
                acc = acc * correction.transpose(0, 2, 1)[..., None] + pv
                return m_new, l, acc

            def maybe_update(j, carry):
                if not causal:
                    return update(j, carry)
                first_key = lax.dynamic_index_in_dim(k_pos, j, keepdims=False).min()
                return lax.cond(first_key <= qp.max(), lambda c: update(j, c), lambda c: c, carry)

            return lax.fori_loop(0, nk, maybe_update, (m, l, acc))

        return lax.map(per_query_chunk, (q, q_pos, state))

    state = (jnp.full((nq, B, H, qc), -jnp.inf, jnp.float32), jnp.zeros((nq, B, H, qc), jnp.float32),
             jnp.zeros((nq, B, qc, H, hd), jnp.float32))
    ring = [(j, (j + 1) % devices) for j in range(devices)]
    for step in range(devices):
        # the next block is sent on before this one is used, so the transfer can run under the compute
        following = lax.ppermute(block, axis_name, ring) if step + 1 < devices else None
        state = visit(state, block)
        block = following
    _, l, acc = state
    context = jnp.where(l.transpose(0, 1, 3, 2)[..., None] > 0,
                        acc / jnp.maximum(l, 1e-30).transpose(0, 1, 3, 2)[..., None], 0.0)
    return context.transpose(1, 0, 2, 3, 4).reshape(B, L, H, hd)


def sequence_parallel_forward(weights, x: jax.Array, mask: jax.Array | None = None, *, config: Config,
                              devices: int, policy: str = "mixed_fp16", query_chunk: int = QUERY_CHUNK,
                              key_chunk: int = KEY_CHUNK) -> jax.Array:
    """The layer stack with each sequence split over `devices` devices (a ring per attention). weights:
    PreparedWeights or raw params; x: (B, S, d) with S a multiple of 2 * devices; mask: (B, S) bool or
    None. Returns y like `ttj_jax.forward` on one device (the same semantics and policy; fp32 rounding
    differs, from the order of the softmax's sums)."""
    from ttj_jax.model import validate_inputs
    validate_inputs(x.shape, str(jnp.dtype(x.dtype)), None if mask is None else mask.shape,
                    None if mask is None else str(jnp.dtype(mask.dtype)), config)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1; got {devices!r}")
    if not isinstance(weights, PreparedWeights):
        weights = prepare_weights(weights, get_policy(policy))
    zigzag_order(x.shape[1], devices)   # checks the length before anything compiles
    return _compiled(config.with_input(1, 1), devices, policy, query_chunk, key_chunk, mask is not None,
                     jax.default_backend())(weights, x, mask)


@functools.lru_cache(maxsize=None)
def _compiled(config: Config, devices: int, policy_name: str, query_chunk: int, key_chunk: int,
              has_mask: bool, platform: str):
    from ttj_jax.model import _layer   # the one-device layer, with its attention replaced
    from ttj_jax.numerics import layer_norm
    from ttj_jax.planner import Plan
    mesh = sequence_mesh(devices, platform)
    policy = get_policy(policy_name)
    plan = Plan(policy=policy_name, attention="xla", mask_mode="keys" if has_mask else "none")
    along_sequence = P(None, SEQ_AXIS)

    def body(weights, x, mask, positions):   # this device's tokens: x (B, L, d), mask (B, L), positions (L,)
        attention = functools.partial(ring_attention, positions=positions, devices=devices,
                                      query_chunk=query_chunk, key_chunk=key_chunk)
        row_valid = None if mask is None else mask[:, :, None]
        h = x.astype(policy.residual_dtype)
        for w in weights.layers:
            h = _layer(w, h, row_valid, mask, config=config, plan=plan, policy=policy, attention=attention)
        y = layer_norm(h, weights.final_norm["weight"], weights.final_norm["bias"])
        if row_valid is not None:
            y = jnp.where(row_valid, y, 0.0)
        return y.astype(x.dtype)

    if has_mask:
        mapped = shard_map(body, mesh=mesh, in_specs=(P(), along_sequence, along_sequence, P(SEQ_AXIS)),
                           out_specs=along_sequence)
    else:
        mapped = shard_map(lambda w, x, positions: body(w, x, None, positions), mesh=mesh,
                           in_specs=(P(), along_sequence, P(SEQ_AXIS)), out_specs=along_sequence)

    @jax.jit
    def run(weights, x, mask):
        # zigzag: the tokens reordered so that the sequence axis's even split gives each device its two
        # chunks (shard_map places the operands by its in_specs); `order` doubles as the positions. Both
        # permutations are constants of the program (the length is static).
        order = zigzag_order(x.shape[1], devices)
        inverse = jnp.asarray(np.argsort(order), jnp.int32)
        order = jnp.asarray(order, jnp.int32)
        if mask is None:
            y = mapped(weights, x[:, order], order)
        else:
            y = mapped(weights, x[:, order], mask[:, order], order)
        return y[:, inverse]

    return run
