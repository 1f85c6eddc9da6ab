"""Gradients through the bridge.

- Eager calls in grad mode on a module in training mode (`Recorded`): the forward runs the
  layer-by-layer XLA program under `jax.vjp` (ttj_jax/training.py) and keeps its residuals until the
  backward applies them: one forward, no recomputation. On a module in eval mode the forward stays the
  planned inference path and a backward recomputes, as below.
- The custom operator `torch.ops.ttj.forward` (compiled graphs, ops.py): its forward runs whatever plan the
  planner chose (whole-stack kernels included, which have no backward of their own) and keeps only
  references to its inputs; its backward, `torch.ops.ttj.backward`, recomputes the same XLA program and
  takes `jax.vjp` of it (as JAX callers' `jax.grad` of `forward` does).
Any mask acts as key masking plus zeroed rows, read from the mask tensor on every call (nothing about its
contents is cached): padded keys and zeroed rows get exactly zero gradient.
Gradients come back for x and every parameter, in their own dtypes and on their devices. The key
projection's bias gets exact zeros: adding a vector to every key shifts each query's scores by one
constant, which the softmax removes, so that gradient is zero in exact arithmetic under any mask (the
recomputation would return its fp16 rounding noise instead).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import torch

from bridge.transfer import transfer_for
from ttj_jax.config import Config
from ttj_jax.params import expected_shapes, params_from_state_dict, params_to_state_dict
from ttj_jax.programs import model_key
from ttj_jax.training import apply_residuals, backward_attention, forward_with_residuals, pullback

# The parameter whose gradient is zero in exact arithmetic (module docstring).
ZERO_GRADIENT_SUFFIX = "attention.k_proj.bias"
# How a training forward learns whether its mask has every token valid (forward_keeping_residuals).
TRAINING_MASK_ENV = "TTJ_TRAINING_MASK"
TRAINING_MASK_READS = ("device", "host")


def training_mask_read() -> str:
    """"device" (default): a training forward reads nothing of its mask on the host; the mask goes to the
    masked program (our flash kernels forward and backward), no host sync. "host": it reads mask.all()
    on the host (a sync) and runs the mask-free program, cuDNN's attention included, when that holds.
    Measured on the H200 with the harness's all-True mask, device against host: 8.85 against 9.69 ms
    per step at bert-base, 8.15 / 9.07 at shape 8, 3.84 / 4.53 at gpt2-s4096
    (bench/results/train-2026-12-03-h200-mask-read.json). Read on every call."""
    choice = os.environ.get(TRAINING_MASK_ENV, "device").strip() or "device"
    if choice not in TRAINING_MASK_READS:
        raise ValueError(f"{TRAINING_MASK_ENV}={choice!r} must be one of {TRAINING_MASK_READS}")
    return choice


def flat_gradients(d_params, config: Config) -> jax.Array:
    """Every parameter's gradient as one fp32 vector in the harness's order, the key biases' as exact zeros
    (module docstring): one export to torch instead of one per parameter (~15-35 us of host time each),
    whose views are the gradients (gradients_to_torch)."""
    named = params_to_state_dict(d_params)
    return jnp.concatenate([jnp.zeros(named[name].size, jnp.float32) if name.endswith(ZERO_GRADIENT_SUFFIX)
                            else named[name].astype(jnp.float32).reshape(-1) for name in expected_shapes(config)])


@functools.cache
def _vjp_program(config: Config, on_gpu: bool, attention: str):
    def program(params, x, mask, grad_out):
        d_params, d_x = pullback(params, x, mask, grad_out, config=config, on_gpu=on_gpu, attention=attention)
        return flat_gradients(d_params, config), d_x.astype(jnp.float32)
    return jax.jit(program)


@functools.cache
def forward_program(config: Config, on_gpu: bool, attention: str):
    """The jitted training forward of a model key (one per process): (y as float32, its residuals,
    training.Residuals, which leave out the program's own inputs)."""
    def program(params, x, mask):
        y, residuals = forward_with_residuals(params, x, mask, config=config, on_gpu=on_gpu, attention=attention)
        return y.astype(jnp.float32), residuals
    return jax.jit(program)


@functools.cache
def apply_program(config: Config):
    """The jitted application of forward_program's residuals to dL/dy (training.apply_residuals;
    `forwarded`: residuals.forwarded((params, x, mask)) of the forward's inputs): the parameters'
    gradients as flat_gradients, and dL/dx."""
    def program(residuals, forwarded, grad_out):
        d_params, d_x = apply_residuals(residuals, forwarded, grad_out)
        return flat_gradients(d_params, config), d_x.astype(jnp.float32)
    return jax.jit(program)


def jax_inputs(x: torch.Tensor, mask: torch.Tensor | None, params: list[torch.Tensor], config: Config, tree=None):
    """The call's inputs as jax arrays, ordered after torch's pending work on them (the optimizer's update
    of the parameters, the layer that made x) without a host sync. `tree`: the parameters' kept jax
    views as the params pytree (runtime.training_parameters), else they are imported here."""
    transfer = transfer_for(x.device)
    transfer.order_before_jax()
    to_jax = lambda t: transfer.to_jax(t.detach().float().contiguous())   # noqa: E731
    jparams = tree if tree is not None else params_from_state_dict(
        dict(zip(expected_shapes(config), map(to_jax, params))), config)
    jmask = transfer.to_jax(mask.contiguous()) if mask is not None else None
    return transfer, to_jax, jparams, jmask


def gradients_to_torch(transfer, flat, gx, x: torch.Tensor, params: list[torch.Tensor], separate: bool = False):
    """(dL/dx, [dL/dp]) as torch tensors from a program's (flat_gradients, fp32 d x): one export for all
    the parameters, each gradient a view of it in its parameter's shape (one C++ call for all the views),
    dtype and device converted where the parameter's differ, or a copy with `separate` (a custom
    operator's outputs may not alias)."""
    grad_x = transfer.to_torch(gx).to(x.dtype)
    flat = transfer.to_torch(flat)
    grads = _unflatten(flat, params)
    if separate or any(p.dtype != flat.dtype or p.device != flat.device for p in params):
        grads = [_own(grad, p, separate) for grad, p in zip(grads, params)]
    return grad_x, list(grads)


# Views of a flat tensor shaped as the given tensors, in one C++ call (what torch's DDP unflattens its
# buckets with): 31 us for GPT-2-like 32 parameters on the CPU, against 78 us for split and a view each.
_unflatten = getattr(torch._utils, "_unflatten_dense_tensors", None) or (
    lambda flat, tensors: [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]),
                                                                    tensors)])


def _own(grad: torch.Tensor, p: torch.Tensor, separate: bool) -> torch.Tensor:
    """grad in p's dtype and on p's device, a tensor of its own memory where `separate` asks for one."""
    converted = grad.to(device=p.device, dtype=p.dtype)
    return converted.clone() if separate and converted.data_ptr() == grad.data_ptr() else converted


def gradients(x: torch.Tensor, mask: torch.Tensor | None, params: list[torch.Tensor], config: Config,
              grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(dL/dx, [dL/dp for p in params]) for y = forward(x, mask) and dL/dy = grad_out, by recomputation.
    `params` are in the harness's order (ops.ordered_parameters)."""
    transfer, to_jax, jparams, jmask = jax_inputs(x, mask, params, config)
    program = _vjp_program(model_key(config), x.device.type == "cuda", backward_attention())
    flat, gx = program(jparams, to_jax(x), jmask, to_jax(grad_out))   # ordered by jax_inputs
    return gradients_to_torch(transfer, flat, gx, x, params, separate=True)


def training_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The mask a training forward passes to its program: as given, or None where training_mask_read()
    says "host" and the host read finds every token valid."""
    if mask is not None and training_mask_read() == "host" and bool(mask.all()):
        return None
    return mask


def forward_keeping_residuals(x: torch.Tensor, mask: torch.Tensor | None, params: list[torch.Tensor],
                              config: Config, tree=None):
    """(y, pull) for an eager call in grad mode: the backward's program run forward once, its residuals
    kept in `pull` (instead of the planned inference forward plus a recomputation at backward time). The
    mask is read on the host only where training_mask_read() says "host": a mask with every token valid is
    then dropped, so the mask-free program, with cuDNN's attention where it applies, runs."""
    mask = training_mask(mask)
    transfer, to_jax, jparams, jmask = jax_inputs(x, mask, params, config, tree)
    program = forward_program(model_key(config), x.device.type == "cuda", backward_attention())
    inputs = (jparams, to_jax(x), jmask)
    y, residuals = program(*inputs)
    return transfer.to_torch(y).to(x.dtype), (residuals, residuals.forwarded(inputs))


def gradients_from(pull, x: torch.Tensor, params: list[torch.Tensor], config: Config, grad_out: torch.Tensor):
    """(dL/dx, [dL/dp]) from forward_keeping_residuals's pull: (training.Residuals, the forward's inputs
    they need back)."""
    transfer = transfer_for(x.device)
    transfer.order_before_jax()   # grad_out was made on torch's stream
    residuals, forwarded = pull
    flat, gx = apply_program(model_key(config))(residuals, forwarded,
                                                transfer.to_jax(grad_out.detach().float().contiguous()))
    return gradients_to_torch(transfer, flat, gx, x, params)


def needs_grad(x: torch.Tensor, params) -> bool:
    """Whether a call must record for autograd: grad mode on, and x or a parameter requiring grad."""
    return (torch.is_grad_enabled() and isinstance(x, torch.Tensor)
            and (x.requires_grad or any(p.requires_grad for p in params)))


class Recorded(torch.autograd.Function):
    """An eager call recorded for autograd.
    - `run` None (a module in training mode): the forward is forward_keeping_residuals (the backward's
      program; `tree` the parameters' kept jax views as the params pytree, or None), its residuals kept
      on ctx until the backward has applied them.
    - `run` given (grad mode on a module in eval mode, as a harness that times without no_grad runs
      it): the forward is `run()`, the planned inference path at its inference speed, and a backward,
      if one comes, recomputes (torch.ops.ttj.backward), as does a second backward through the same
      graph (retain_graph=True).
    Cheaper per call than the custom op's own autograd wrapper, which walks its 66-tensor parameter
    list through pytrees."""

    @staticmethod
    def forward(ctx, run, tree, config: Config, x, mask, *params):
        if run is None:
            y, ctx.pull = forward_keeping_residuals(x, mask, list(params), config, tree)
        else:
            y, ctx.pull = run(), None
        ctx.config = config
        ctx.save_for_backward(x, mask, *params)   # torch then refuses a backward after in-place edits
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, mask, *params = ctx.saved_tensors
        config, pull = ctx.config, ctx.pull
        ctx.pull = None   # the residuals go with this backward, as autograd's saved tensors do
        if pull is not None:
            grad_x, grads = gradients_from(pull, x, params, config, grad_out)
        else:
            grad_x, *grads = torch.ops.ttj.backward(x, mask, params, config.num_heads, bool(config.causal), grad_out)
        return None, None, None, grad_x, None, *grads
