"""Gradients of `forward` for JAX callers (`jax.grad`, `jax.vjp`, ...).

Under a differentiation transform `forward` runs inside a `jax.custom_vjp`: its planned program (our
Pallas kernels and whole-stack kernels included, which have no derivative rules of their own) where
nothing differentiates, and where something does, `jax.vjp` of the layer-by-layer XLA program
(layers.py), once, its residuals kept for the backward:
- in the numerics of policy mixed_fp16_train (numerics.py): the forward's fp16 GEMM operands with fp32
  accumulation, residual, LayerNorm and softmax, q/k/v and the MLP's pre-activation stored in fp16
  (as the GEMM-bound inference policy does), and fp16 operands in the backward's GEMMs too, so the
  gradients are those of the function the forward computes, to within its rounding;
- with cuDNN's fused attention (which has its backward) on a GPU for a call without a mask at a head_dim
  cuDNN takes, else our flash backward kernels (kernels/flash_attention_bwd.py); XLA's attention on
  the CPU;
- any mask as key masking plus zeroed rows: padded keys and zeroed rows get exactly zero gradient;
- the incoming cotangent scaled by a power of two into fp16's range (a loss scale chosen per call).
The torch bridge's backward (bridge/autograd.py) is the same program.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from ttj_jax.compat import tracing
from ttj_jax.config import Config
from ttj_jax.layers import layer_stack, run_layers
from ttj_jax.numerics import get_policy
from ttj_jax.params import PreparedWeights, prepare_weights
from ttj_jax.planner import Plan, cudnn_takes_head_dim

BACKWARD_POLICY = "mixed_fp16_train"   # mixed_fp16's forward, fp16 GEMMs in the backward too (numerics.py)
BACKWARD_ATTENTION_ENV = "TTJ_BACKWARD_ATTENTION"
BACKWARD_ATTENTIONS = ("auto", "flash", "xla")
# The flash attention reads q, k and v in place from the fused projection (flash_attention_fused_vjp), or
# (False) from three slices of it; kept as a switch for `python3 -m bench.train_programs`.
FUSED_QKV_ATTENTION = True
# A key-masked call's backward program with cuDNN's attention, the mask in extra lanes of q and k
# (layers.cudnn_attention), instead of our flash kernels; kept as a switch for `python3 -m bench.train_programs`.
MASKED_CUDNN = False


def backward_attention_kind(config: Config, masked: bool, on_gpu: bool, choice: str = "auto") -> str:
    """Which attention the backward recomputes and differentiates: "cudnn", "flash" or "xla".
    auto: on a GPU, cuDNN's fused attention for a mask-free call at a head_dim it takes (the fastest
    backward measured: bench/results/attention-bwd-*.json), and for a masked one too where MASKED_CUDNN
    is set (the mask in extra lanes, layers.cudnn_attention), else our flash kernels (any mask, no
    [S, S] tensor); on the CPU XLA's attention (the Pallas kernels would run interpreted).
    flash / xla: that attention wherever the call runs (xla: the explicit [B, H, S, S] scores)."""
    if choice in ("flash", "xla"):
        return choice
    if not on_gpu:
        return "xla"
    if masked and not MASKED_CUDNN:
        return "flash"
    return "cudnn" if cudnn_takes_head_dim(config.head_dim, masked) else "flash"


def backward_plan(config: Config, masked: bool, on_gpu: bool, choice: str = "auto") -> Plan:
    """The differentiable program a backward recomputes (its attention: backward_attention_kind)."""
    kind = backward_attention_kind(config, masked, on_gpu, choice)
    return Plan(policy=BACKWARD_POLICY, attention="xla" if kind == "flash" else kind,
                mask_mode="keys" if masked else "none", stack="layers",
                reason=f"backward: jax.vjp of the layer-by-layer XLA program, {kind} attention")


def backward_attention() -> str:
    """"auto" (backward_attention_kind), "flash" (our Pallas backward kernels everywhere,
    kernels/flash_attention_bwd.py) or "xla" (XLA's attention everywhere), from TTJ_BACKWARD_ATTENTION."""
    choice = os.environ.get(BACKWARD_ATTENTION_ENV, "auto").strip() or "auto"
    if choice not in BACKWARD_ATTENTIONS:
        raise ValueError(f"{BACKWARD_ATTENTION_ENV}={choice!r} must be one of {', '.join(BACKWARD_ATTENTIONS)}")
    return choice


def _flash_attention(qkv, key_valid, *, causal: bool, policy):
    """Layer attention (layers.ATTENTION's signature) through our differentiable flash kernel."""
    from ttj_jax.kernels import flash_attention_bwd as kernels  # deferred: Pallas import cost
    interpret = jax.default_backend() == "cpu"
    if FUSED_QKV_ATTENTION:
        return kernels.flash_attention_fused_vjp(qkv.astype(policy.gemm_dtype), causal, interpret,
                                                 key_valid).astype(jnp.float32)
    q, k, v = (qkv[:, :, i].astype(policy.gemm_dtype) for i in range(3))
    return kernels.flash_attention_vjp(q, k, v, causal, interpret, key_valid).astype(jnp.float32)


# Our flash kernels give a query with no allowed key a zero context (layers.layer then zeroes no rows).
_flash_attention.finite_rows = True


def _program(config: Config, masked: bool, on_gpu: bool, attention: str):
    """run(params, x, mask) -> y: the backward's differentiable program (backward_plan)."""
    plan = backward_plan(config, masked, on_gpu, attention)
    if backward_attention_kind(config, masked, on_gpu, attention) == "flash":
        def run(p, h, m):
            weights = p if isinstance(p, PreparedWeights) else prepare_weights(p, get_policy(plan.policy))
            return layer_stack(weights, h, m, config=config, plan=plan, attention=_flash_attention)
        return run
    return functools.partial(run_layers, config=config, plan=plan)


def forward_with_pullback(params, x, mask, *, config: Config, on_gpu: bool, attention: str = "auto"):
    """(y, pull): the backward program's output and its pullback (a pytree of residuals; apply it with
    apply_pullback). For a caller that keeps the residuals instead of recomputing them: the bridge's eager
    autograd. mask None means mask-free (the caller decides)."""
    run = _program(config, mask is not None, on_gpu, attention)
    return jax.vjp(lambda p, h: run(p, h, mask), params, x)


@jax.tree_util.register_pytree_node_class
class Residuals:
    """A pullback of forward_with_pullback split for a jitted program's boundary: the residuals that are
    not the forward's own inputs (`kept`, the pytree's leaves), and, as static data, the pull's structure
    and, for each of its leaves, the index of the input leaf it is (or None: kept). A program returning one
    of its own inputs pays a copy of it (an output may not alias an argument that is not donated): the
    fp32 x the first LayerNorm keeps, the LayerNorms' parameters and the mask, 12 copies per call at two
    layers on the flash path. `forwarded(inputs)` picks, from the same (params, x, mask) the forward took, the arrays
    `pullback` needs back."""

    def __init__(self, kept, treedef, sources: tuple):
        self.kept, self.treedef, self.sources = list(kept), treedef, sources
        self.needed = tuple(sorted({s for s in sources if s is not None}))

    @classmethod
    def split(cls, pull, inputs) -> Residuals:
        """pull's residuals, those that are leaves of `inputs` (by identity) left out."""
        index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(inputs))}
        leaves, treedef = jax.tree.flatten(pull)
        sources = tuple(index.get(id(leaf)) for leaf in leaves)
        return cls([leaf for leaf, s in zip(leaves, sources) if s is None], treedef, sources)

    def forwarded(self, inputs) -> list:
        """The leaves of `inputs` (the forward's (params, x, mask)) that `pullback` takes back."""
        leaves = jax.tree.leaves(inputs)
        return [leaves[i] for i in self.needed]

    def pullback(self, forwarded):
        """The pull again, from the kept residuals and forwarded(inputs)."""
        given = dict(zip(self.needed, forwarded))
        kept = iter(self.kept)
        return jax.tree.unflatten(self.treedef, [next(kept) if s is None else given[s] for s in self.sources])

    def tree_flatten(self):
        return tuple(self.kept), (self.treedef, self.sources)

    @classmethod
    def tree_unflatten(cls, aux, kept):
        return cls(kept, *aux)


def forward_with_residuals(params, x, mask, *, config: Config, on_gpu: bool, attention: str = "auto"):
    """(y, Residuals): forward_with_pullback for a jitted program that hands its residuals to another
    (apply_residuals) and does not return its own inputs."""
    y, pull = forward_with_pullback(params, x, mask, config=config, on_gpu=on_gpu, attention=attention)
    return y, Residuals.split(pull, (params, x, mask))


def apply_residuals(residuals: Residuals, forwarded, grad_out, dtype=jnp.float32):
    """apply_pullback on forward_with_residuals's residuals; `forwarded`: residuals.forwarded((params,
    x, mask)) of the forward's inputs."""
    return apply_pullback(residuals.pullback(forwarded), grad_out, dtype)


def apply_pullback(pull, grad_out, dtype=jnp.float32):
    """(d params, d x) from forward_with_pullback's pull and dL/dy. The GEMMs take fp16 operands,
    cotangents included: a loss averaged over many elements hands down cotangents far below fp16's
    normal range (6e-5), where they lose their precision. They are scaled by a power of two to a largest
    magnitude in [1, 2) and scaled back after (exact, the pullback being linear)."""
    g = grad_out.astype(jnp.float32)
    largest = jnp.max(jnp.abs(g))
    scale = jnp.where(jnp.isfinite(largest) & (largest > 0), jnp.exp2(-jnp.floor(jnp.log2(largest))), 1.0)
    d_params, d_x = pull((g * scale).astype(dtype))
    return jax.tree.map(lambda t: (t / scale).astype(t.dtype), (d_params, d_x))


def pullback(params, x, mask, grad_out, *, config: Config, on_gpu: bool, attention: str = "auto"):
    """(d params, d x) for y = forward(params, x, mask) and dL/dy = grad_out, by recomputation; params raw
    or prepared. attention: backward_attention()'s choice. A given mask takes the masked program, whatever
    it holds: deciding on the device whether it pads would be a lax.cond, which on the GPU makes the host
    wait as a host read does (bench/results/device-branch-*.json), and nothing about its contents is
    cached."""
    _, vjp = forward_with_pullback(params, x, mask, config=config, on_gpu=on_gpu, attention=attention)
    return apply_pullback(vjp, grad_out, x.dtype)


def is_differentiated(params, x) -> bool:
    """Whether x or a parameter may be traced by a transform (a differentiation among them): any active
    trace counts (params are only ever tracers inside one), which costs one flag read on forward's hot
    path instead of a walk over params' leaves."""
    return isinstance(x, jax.core.Tracer) or tracing()


def differentiable(primal, config: Config, on_gpu: bool):
    """primal(params, x, mask) -> y, given a custom VJP: outside differentiation `primal` (the planned
    program) runs; under it the forward is the backward's program run once under jax.vjp, whose
    residuals the backward applies (no recomputation)."""

    @jax.custom_vjp
    def call(params, x, mask):
        return primal(params, x, mask)

    def call_fwd(params, x, mask):
        y, pull = forward_with_pullback(params, x, mask, config=config, on_gpu=on_gpu,
                                        attention=backward_attention())
        return y.astype(x.dtype), pull

    def call_bwd(pull, grad_out):   # grad_out has y's dtype, which is x's
        d_params, d_x = apply_pullback(pull, grad_out, grad_out.dtype)
        return d_params, d_x.astype(grad_out.dtype), None

    call.defvjp(call_fwd, call_bwd)
    return call
