"""The layer-by-layer XLA program: LayerNorm -> fused QKV GEMM -> attention -> out-projection ->
residual -> LayerNorm -> MLP -> residual, per layer, then the final LayerNorm (docs/spec.md).

Numerics come from the plan's policy (numerics.py), attention from the plan's implementation, masking
work from its mask mode. `layer_stack` takes an `attention` override, which the ring (ring_attention.py)
uses to run the same layers on a slice of each sequence.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from ttj_jax.config import Config
from ttj_jax.numerics import NumericsPolicy, get_policy, layer_norm
from ttj_jax.params import PreparedWeights, StackedWeights, prepare_weights, stack_layer_weights
from ttj_jax.planner import CUDNN_MASK_LANES, CUDNN_MASKED_MAX_HEAD_DIM, KEY_MASK_MODES, Plan, cudnn_takes_head_dim

# A large finite negative instead of -inf for excluded keys: a row with no allowed key then yields a
# finite (uniform) softmax instead of NaN, and such rows are always zeroed afterwards (docs/spec.md).
MASKED_SCORE = -1e30


def xla_attention(qkv: jax.Array, key_valid: jax.Array | None, *, causal: bool,
                  policy: NumericsPolicy) -> jax.Array:
    """qkv: (B, S, 3, H, hd) fp32 -> context (B, S, H, hd) fp32, explicit scores, softmax in fp32."""
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]                                  # (B, S, H, hd)
    S, head_dim = q.shape[1], q.shape[-1]
    scores = policy.einsum("bqhd,bkhd->bhqk", q * head_dim ** -0.5, k)                  # (B, H, S, S)
    allowed = None
    if causal:
        allowed = jnp.tril(jnp.ones((S, S), bool))[None, None]
    if key_valid is not None:
        keys = key_valid[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    if allowed is not None:
        scores = jnp.where(allowed, scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores.astype(policy.statistics_dtype), axis=-1)
    return policy.einsum("bhqk,bkhd->bqhd", probs, v)


def pallas_attention(qkv, key_valid, *, causal, policy, implementation="auto"):
    """Our flash kernel, reading q, k and v straight from the fused layout. Its dots take fp16 operands
    with fp32 accumulation whatever the policy (the kernel's documented choice), so the exact_fp32
    policy never plans it. On the CPU (forced, for tests) it runs interpreted."""
    from ttj_jax.kernels import flash_attention_fused_qkv  # deferred: Pallas import cost only when used
    interpret = jax.default_backend() == "cpu"
    return flash_attention_fused_qkv(qkv.astype(policy.gemm_dtype), causal=causal, key_mask=key_valid,
                                     interpret=interpret, implementation=implementation).astype(jnp.float32)


# cuDNN's key mask through jax is a bias with a row per query ([B, 1, S, S], jax checks its length), which
# cuDNN reads per head and differentiates. Instead each head gains planner.CUDNN_MASK_LANES lanes (cuDNN's
# head_dim granularity): q's first is 1, k's first is -CUDNN_MASK_PENALTY at an invalid key and 0 at a
# valid one, the rest and v's are 0. A valid key's score is q.k plus exact zeros; an invalid key's is
# lowered by CUDNN_MASK_PENALTY * hd**-0.5 (>= 2**15 / 11 here), whose exp is 0 in fp32 beside any valid
# score; the context's extra lanes are 0 and dropped.
CUDNN_MASK_PENALTY = 2.0 ** 15  # exact in fp16, under its largest finite value


def cudnn_attention(qkv, key_valid, *, causal, policy):
    """cuDNN's fused attention through jax. qkv: (B, S, 3, H, hd), or a tuple (q, k, v) of (B, S, H, hd)
    each (the three-GEMM projection, `project_qkv`): cuDNN takes dense q, k and v, so from the fused
    layout XLA first copies each out. A key mask (B, S) rides in the extra lanes of q and k
    (CUDNN_MASK_LANES; head_dim at most CUDNN_MASKED_MAX_HEAD_DIM): a query with no allowed key (only an
    invalid one: a valid query sees itself under causal attention, docs/spec.md) gets a finite row."""
    if isinstance(qkv, tuple):
        q, k, v = (t.astype(policy.gemm_dtype) for t in qkv)
    else:
        qkv = qkv.astype(policy.gemm_dtype)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    head_dim = q.shape[-1]
    if key_valid is not None:
        if not cudnn_takes_head_dim(head_dim, masked=True):
            raise ValueError(f"cuDNN's key-masked attention takes head_dim <= {CUDNN_MASKED_MAX_HEAD_DIM}, a "
                             f"multiple of 8, got {head_dim}; the planner must choose another")
        lanes = jnp.zeros((*q.shape[:-1], CUDNN_MASK_LANES), q.dtype)
        penalty = jnp.where(key_valid, 0.0, -CUDNN_MASK_PENALTY).astype(k.dtype)[:, :, None, None]
        q = jnp.concatenate([q, lanes.at[..., 0].set(1)], axis=-1)
        k = jnp.concatenate([k, lanes.at[..., :1].set(penalty)], axis=-1)
        v = jnp.concatenate([v, lanes], axis=-1)
    context = jax.nn.dot_product_attention(q, k, v, scale=head_dim ** -0.5, is_causal=causal,
                                           implementation="cudnn")
    return context[..., :head_dim].astype(jnp.float32)


ATTENTION = {"xla": xla_attention, "pallas": pallas_attention, "cudnn": cudnn_attention}


def attention_for(plan: Plan):
    """The plan's attention function."""
    return ATTENTION[plan.attention]


def project_qkv(h, w: Mapping[str, jax.Array], *, config: Config, plan: Plan, policy: NumericsPolicy):
    """The q/k/v projection of h (B, S, d). One GEMM (plan.qkv_gemms == 1): (B, S, 3, H, hd), the fused
    layout our flash kernel reads. Three (cuDNN's attention): a tuple (q, k, v), each (B, S, H, hd) and
    dense, from weights split as [3, d, d] (`split_qkv`, `stacks.weights_layout`; an unsplit [d, 3d] is
    sliced here, at the cost of a copy per call)."""
    B, S, _ = h.shape
    heads = (config.num_heads, config.head_dim)
    weight, bias = w["qkv_weight"], w["qkv_bias"]
    if plan.qkv_gemms == 1:
        if weight.ndim == 3:   # split weights: joined again (a copy per call)
            weight, bias = jnp.concatenate(list(weight), axis=1), bias.reshape(-1)
        return policy.project_qkv(h, weight, bias).reshape(B, S, 3, *heads)              # free reshape
    if weight.ndim == 2:
        weight, bias = split_qkv(weight, bias)
    return tuple(policy.project_qkv(h, weight[t], bias[t]).reshape(B, S, *heads) for t in range(3))


def split_qkv(weight, bias):
    """A fused q/k/v projection's [..., d, 3d] weight and [..., 3d] bias as [..., 3, d, d] and [..., 3, d]:
    q's, k's and v's, each contiguous."""
    d = weight.shape[-2]
    weight = jnp.moveaxis(weight.reshape(*weight.shape[:-1], 3, d), -2, -3)
    return weight, bias.reshape(*bias.shape[:-1], 3, d)


def layer(w: Mapping[str, jax.Array], x, row_valid, key_valid, *, config: Config, plan: Plan,
           policy: NumericsPolicy, attention=None):
    """One pre-LN block on the fp32 residual x (B, S, d). attention: the plan's (attention_for) unless
    given (ring_attention.py runs this on a slice of the sequence with a ring in its place)."""
    B, S, d = x.shape
    h = layer_norm(x, w["norm1_weight"], w["norm1_bias"], policy.norm_dtype)
    qkv = project_qkv(h, w, config=config, plan=plan, policy=policy)
    context = (attention or attention_for(plan))(qkv, key_valid, causal=config.causal, policy=policy)
    context = context.reshape(B, S, d)
    if row_valid is not None and attention is not None and not getattr(attention, "finite_rows", False):
        # Invalid rows are left to the stack's end (layer_stack zeroes them in y), not zeroed per layer as
        # docs/spec.md writes the model: no valid row ever reads an invalid one (invalid keys are masked,
        # or, for a prefix mask under causal attention, come after every valid query), and the rows'
        # GEMMs are row by row, so valid rows come out the same. The attentions of ATTENTION give every
        # row a finite context from finite inputs (a row with no allowed key: a uniform softmax over
        # MASKED_SCORE in xla_attention or over cuDNN's mask lanes, zeros in our flash kernel), so their
        # invalid rows stay finite and their zero cotangents give zero weight gradients. An attention
        # given by the caller (the ring's) may give such a row a NaN (a softmax over no key), which P v
        # would carry into valid rows at the next layer (0 x NaN): its invalid queries' context is
        # zeroed here, on the out-projection's input, unless the function says it gives every row a
        # finite context (an attribute `finite_rows = True`: the training program's flash attention).
        # Nothing sits between a GEMM and its residual add, which cuBLAS fuses into its epilogue as in
        # the mask-free program.
        context = zero_invalid_rows(context, row_valid)
    a = policy.matmul(context, w["out_weight"]) + w["out_bias"]
    x = x + a
    h = layer_norm(x, w["norm2_weight"], w["norm2_bias"], policy.norm_dtype)
    h = policy.mlp_hidden(h, w["ffn_in_weight"], w["ffn_in_bias"])
    return x + policy.matmul(h, w["ffn_out_weight"]) + w["ffn_out_bias"]


@jax.custom_vjp
def zero_invalid_rows(x, row_valid):
    """x with the rows where row_valid ([B, S, 1] bool) is False set to zero. Its backward keeps only
    row_valid: jax's rule for jnp.where keeps the condition broadcast to x's shape and a zero tensor as
    large as x."""
    return jnp.where(row_valid, x, 0.0)


def _zero_rows_forward(x, row_valid):
    return jnp.where(row_valid, x, 0.0), row_valid


def _zero_rows_backward(row_valid, g):
    return jnp.where(row_valid, g, 0.0), None


zero_invalid_rows.defvjp(_zero_rows_forward, _zero_rows_backward)


def key_mask_for(mask, *, mode: str):
    """The key mask attention must apply, or None. "keys" and "device" plans mask keys with the mask as it
    is: under causal attention a prefix mask's masking changes invalid rows only (each valid query's keys
    are all valid), which are zeroed, so the device needs no test of the mask's kind (docs/spec.md), and a
    program with no work on the mask outside its kernels is one the bridge can launch itself."""
    return mask if mode in KEY_MASK_MODES else None


def layer_stack(weights: PreparedWeights | StackedWeights, x, mask, *, config: Config, plan: Plan, attention=None):
    """The layer stack on x (B, S, d); attention: see `layer`."""
    policy = get_policy(plan.policy)
    row_valid = mask[:, :, None] if plan.mask_mode != "none" else None
    key_valid = key_mask_for(mask, mode=plan.mask_mode)
    h = x.astype(policy.residual_dtype)
    if plan.scan_layers:   # one layer's body, compiled once, looped on the device over the stacked weights
        stacked = weights if isinstance(weights, StackedWeights) else stack_layer_weights(weights)

        def body(h, w):
            return layer(w, h, row_valid, key_valid, config=config, plan=plan, policy=policy, attention=attention), None
        h, _ = jax.lax.scan(body, h, stacked.layers)
    else:
        for i in range(weights.num_layers):
            h = layer(weights.layer(i), h, row_valid, key_valid, config=config, plan=plan, policy=policy,
                      attention=attention)
    y = layer_norm(h, weights.final_norm["weight"], weights.final_norm["bias"])
    if row_valid is not None:
        y = zero_invalid_rows(y, row_valid)
    return y.astype(x.dtype)


def run_layers(weights, x, mask, *, config: Config, plan: Plan):
    """The layer stack for a plan; weights: StackedWeights (the fast path, see `stacks.kernel_weights`),
    PreparedWeights, or raw params (prepared inside the call)."""
    if not isinstance(weights, (PreparedWeights, StackedWeights)):
        weights = prepare_weights(weights, get_policy(plan.policy))
    if not get_policy(weights.policy_name).shares_weights_with(get_policy(plan.policy)):
        raise ValueError(f"weights were prepared for policy {weights.policy_name!r}, "
                         f"the plan needs {plan.policy!r}")
    if not plan.batch_chunk or plan.batch_chunk >= x.shape[0]:
        return layer_stack(weights, x, mask, config=config, plan=plan)
    # Batch chunks run one after another (lax.map is a scan): peak activations are one chunk's.
    # The planner picks a divisor of B, so both reshapes are free.
    B, S, d = x.shape
    n = B // plan.batch_chunk
    xs = x.reshape(n, plan.batch_chunk, S, d)
    if mask is None:
        ys = jax.lax.map(lambda xc: layer_stack(weights, xc, None, config=config, plan=plan), xs)
    else:
        masks = mask.reshape(n, plan.batch_chunk, S)
        ys = jax.lax.map(lambda a: layer_stack(weights, a[0], a[1], config=config, plan=plan), (xs, masks))
    return ys.reshape(B, S, d)
