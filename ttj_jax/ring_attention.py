"""Sequence parallelism: one sequence split over the devices of a mesh axis, attention as a ring
(the design: docs/sequence-parallel.md).

Everything in a layer but attention is token-local, so each device runs the usual layer code
(`layers.layer`) on its own tokens; only attention is replaced, by `ring_attention`: the devices pass
their keys and values around a ring (`lax.ppermute`), N - 1 hops for N devices, and every device keeps
an online softmax (running max, sum and unnormalised context, fp32) for its own queries, merged over the
visiting blocks. The ppermute of the next block is issued before the current block's compute, so XLA may
overlap the two; a device holds two k/v blocks at a time.

Layout: the sequence is cut into 2N equal chunks and device i holds chunks i and 2N-1-i ("zigzag",
`zigzag_order`), so that under causal attention every device has the same amount of work (with
contiguous slices the last device would do N times the first's). Positions travel with the keys, so
causality and the key mask are decided per (query, key) pair wherever the pair meets.

Inside one visit ("xla" attention) the work is bounded: queries in chunks (`lax.map`), keys in chunks (`lax.fori_loop`),
live scores [B, H, query_chunk, key_chunk]; a key chunk wholly after a query chunk's last position is
skipped under causal attention (`lax.cond`), which halves the work over the ring.

Numerics are the plan's policy (numerics.py): the two dots with gemm_dtype operands and fp32
accumulation, softmax statistics in fp32. Masks: the key mask (with row zeroing, done by the layer code)
is the general semantics of docs/spec.md, so every mask mode runs as "keys" here: the "rows" and
"device" shortcuts of the one-device program need whole sequences.

The per-visit attention is one of two (`attention=`): "xla" as above, or "pallas": our generic flash
kernel (Triton on the GPU) on each pair of zigzag chunks, returning its log-sum-exp, the visits merged by
it (`_ring_flash`).

Status: correctness, CPU-tested on 2 and 4 host devices against the one-device forward and the fp32
reference, both attentions (tests/test_ring_attention.py; the flash kernel interpreted). Not run on a
GPU: `bench/ring_check.py` checks and times it there next to the one-device call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ttj_jax.compat import shard_map
from ttj_jax.config import Config
from ttj_jax.inputs import cached_mask_kind, validate_inputs
from ttj_jax.layers import layer_stack
from ttj_jax.masks import MaskKind
from ttj_jax.numerics import get_policy
from ttj_jax.parallel import device_mesh
from ttj_jax.params import PreparedWeights, StackedWeights, prepare_weights
from ttj_jax.planner import Plan

SEQ_AXIS = "seq"
QUERY_CHUNK = 512
KEY_CHUNK = 512


def check_ring_length(seq_len: int, devices: int) -> None:
    """Raises ValueError unless the sequence splits into 2 * devices equal zigzag chunks."""
    if devices < 1 or seq_len % (2 * devices):
        raise ValueError(f"seq_len {seq_len} must be a multiple of 2 * devices = {2 * devices} for the ring's "
                         "zigzag layout")


def zigzag_order(seq_len: int, devices: int) -> np.ndarray:
    """The sequence's token positions in the order they are laid out over `devices` (device-major): of
    2 * devices equal chunks, device i holds chunk i then chunk 2 * devices - 1 - i."""
    check_ring_length(seq_len, devices)
    chunks = np.arange(seq_len).reshape(2 * devices, seq_len // (2 * devices))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * devices - 1 - i]]) for i in range(devices)])


def _chunk(size: int, wanted: int) -> int:
    """The largest divisor of size that is at most wanted."""
    return next(c for c in range(min(size, wanted), 0, -1) if size % c == 0)


def ring_attention(qkv: jax.Array, key_valid: jax.Array | None, positions: jax.Array, *, causal: bool,
                   policy, devices: int, query_chunk: int = QUERY_CHUNK, key_chunk: int = KEY_CHUNK,
                   axis_name: str = SEQ_AXIS, attention: str = "xla") -> jax.Array:
    """Inside shard_map over `axis_name` (`devices` long). qkv: (B, L, 3, H, hd), this device's tokens
    (two zigzag chunks); key_valid: (B, L) bool or None; positions: (L,) int32, their places in the
    sequence. Returns the context (B, L, H, hd) fp32; a query with no allowed key gets zeros.
    attention: "xla" (query x key chunks, online softmax in XLA) or "pallas" (our flash kernel per pair
    of zigzag chunks, merged by its log-sum-exp; see _ring_flash)."""
    if attention == "pallas":
        return _ring_flash(qkv, key_valid, positions, causal=causal, policy=policy, devices=devices,
                           axis_name=axis_name)
    if attention != "xla":
        raise ValueError(f"ring attention={attention!r} must be 'xla' or 'pallas'")
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
    _, l, acc = _around_the_ring(visit, state, block, devices=devices, axis_name=axis_name)
    context = jnp.where(l.transpose(0, 1, 3, 2)[..., None] > 0,
                        acc / jnp.maximum(l, 1e-30).transpose(0, 1, 3, 2)[..., None], 0.0)
    return context.transpose(1, 0, 2, 3, 4).reshape(B, L, H, hd)


def _ring_flash(qkv, key_valid, positions, *, causal: bool, policy, devices: int, axis_name: str):
    """ring_attention with our flash kernel (ttj_jax.kernels.flash_attention with return_lse: the Hopper
    kernel where its dispatch rule sends the call, mask-free chunks of >= 4096 tokens on sm_90; else the
    generic one) on each pair of (local query chunk, visiting key chunk): the two zigzag chunks a device holds are each
    contiguous in the sequence, so a pair is wholly visible (key chunk earlier: not causal), the
    diagonal (the same chunk: causal), or wholly masked (later: skipped) under causal attention; which,
    is known only at run time (lax.switch). Visits are merged by their log-sum-exp: with lse = logaddexp
    of the two, out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)."""
    from ttj_jax.kernels import flash_attention
    B, L, _, H, hd = qkv.shape
    c = L // 2
    interpret = jax.default_backend() == "cpu"
    qkv = qkv.astype(policy.gemm_dtype)
    queries = [qkv[:, :c, 0], qkv[:, c:, 0]]
    query_ids = [positions[0] // c, positions[c] // c]
    key_ok = jnp.ones((B, L), bool) if key_valid is None else key_valid
    block = (qkv[:, :, 1:], positions, key_ok)

    def pair(q, q_id, k, v, k_id, ok):   # -> (out fp32 (B, c, H, hd), lse (B, H, c))
        mask = None if key_valid is None else ok

        def attend(is_causal):
            def run(_):
                out, lse = flash_attention(q, k, v, causal=is_causal, key_mask=mask, interpret=interpret,
                                           return_lse=True)
                return out.astype(jnp.float32), lse
            return run

        def skip(_):
            return jnp.zeros((B, c, H, hd), jnp.float32), jnp.full((B, H, c), -jnp.inf, jnp.float32)

        if not causal:
            return attend(False)(None)
        branch = jnp.where(k_id < q_id, 0, jnp.where(k_id == q_id, 1, 2))
        return lax.switch(branch, [attend(False), attend(True), skip], None)

    def merge(a, b):
        (out_a, lse_a), (out_b, lse_b) = a, b
        lse = jnp.logaddexp(lse_a, lse_b)
        safe = jnp.where(jnp.isneginf(lse), 0.0, lse)         # no key on either side: stays zero, not NaN
        weight = lambda x: jnp.exp(x - safe).transpose(0, 2, 1)[..., None]   # (B, c, H, 1)  # noqa: E731
        return out_a * weight(lse_a) + out_b * weight(lse_b), lse

    def visit(state, block):
        kv, k_pos, k_ok = block
        state = list(state)
        for half in range(2):                                  # the visiting block's two zigzag chunks
            rows = slice(half * c, (half + 1) * c)
            k_id = k_pos[half * c] // c
            for which in range(2):                             # this device's two query chunks
                state[which] = merge(state[which], pair(queries[which], query_ids[which], kv[:, rows, 0],
                                                        kv[:, rows, 1], k_id, k_ok[:, rows]))
        return tuple(state)

    empty = (jnp.zeros((B, c, H, hd), jnp.float32), jnp.full((B, H, c), -jnp.inf, jnp.float32))
    state = _around_the_ring(visit, (empty, empty), block, devices=devices, axis_name=axis_name)
    return jnp.concatenate([state[0][0], state[1][0]], axis=1)


def _around_the_ring(visit, state, block, *, devices: int, axis_name: str):
    """state = visit(state, block) for this device's block and then each other device's, in ring order:
    the block travels one hop per step (lax.ppermute), sent on before this step's visit uses it, so the
    transfer can run under the compute."""
    ring = [(j, (j + 1) % devices) for j in range(devices)]
    for step in range(devices):
        following = lax.ppermute(block, axis_name, ring) if step + 1 < devices else None
        state = visit(state, block)
        block = following
    return state


def sequence_parallel_forward(weights, x: jax.Array, mask: jax.Array | None = None, *, config: Config,
                              devices: int, policy: str = "mixed_fp16", query_chunk: int = QUERY_CHUNK,
                              key_chunk: int = KEY_CHUNK, attention: str = "xla") -> jax.Array:
    """The layer stack with each sequence split over `devices` devices (a ring per attention). weights:
    PreparedWeights or raw params; x: (B, S, d) with S a multiple of 2 * devices; mask: (B, S) bool or
    None. Returns y like `ttj_jax.forward` on one device (the same semantics and policy; fp32 rounding
    differs, from the order of the softmax's sums). attention: the ring's per-visit attention, "xla"
    or "pallas" (our flash kernel per pair of zigzag chunks, fp16/bf16 operands whatever the policy,
    as the one-device Pallas path; interpreted on the CPU)."""
    if attention not in ("xla", "pallas"):
        raise ValueError(f"attention={attention!r} must be 'xla' or 'pallas'")
    validate_inputs(x.shape, str(jnp.dtype(x.dtype)), None if mask is None else mask.shape,
                    None if mask is None else str(jnp.dtype(mask.dtype)), config)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be an int >= 1; got {devices!r}")
    if not isinstance(weights, (PreparedWeights, StackedWeights)):
        weights = prepare_weights(weights, get_policy(policy))
    check_ring_length(x.shape[1], devices)   # before anything compiles (the order itself is built at trace time)
    if mask is not None and not isinstance(mask, jax.core.Tracer) and cached_mask_kind(mask) == MaskKind.ALL_TRUE:
        mask = None   # as the one-device forward's plan: no mask work (and the Hopper kernel stays eligible)
    return _compiled(config.with_input(1, 1), devices, policy, query_chunk, key_chunk, mask is not None,
                     jax.default_backend(), attention)(weights, x, mask)


@functools.cache
def _compiled(config: Config, devices: int, policy_name: str, query_chunk: int, key_chunk: int,
              has_mask: bool, platform: str, attention: str = "xla"):
    mesh = device_mesh(devices, platform, SEQ_AXIS)
    # "keys": the general masking (key mask and row zeroing), right on any slice of a sequence
    plan = Plan(policy=policy_name, attention="xla", mask_mode="keys" if has_mask else "none")
    along_sequence = P(None, SEQ_AXIS)

    def body(weights, x, mask, positions):   # this device's tokens: x (B, L, d), mask (B, L), positions (L,)
        ring = functools.partial(ring_attention, positions=positions, devices=devices, query_chunk=query_chunk,
                                 key_chunk=key_chunk, attention=attention)
        return layer_stack(weights, x, mask, config=config, plan=plan, attention=ring)   # attention replaced

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
