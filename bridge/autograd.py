"""Gradients through the bridge: the backward of `torch.ops.ttj.forward` (registered in ops.py).

The forward runs whatever plan the planner chose (whole-stack kernels included, which have no backward of
their own) and keeps only references to its inputs, as autograd would anyway. The backward recomputes the
layer stack as the layer-by-layer XLA program and takes `jax.vjp` of it (ttj_jax/training.py, which JAX
callers' `jax.grad` of `forward` uses too). Any mask acts as key masking plus zeroed rows, read from the
mask tensor itself at backward time: padded keys and zeroed rows get exactly zero gradient, and no
classification of the mask is cached.
Gradients come back for x and every parameter, in their own dtypes and on their devices. The key
projection's bias gets exact zeros: adding a vector to every key shifts each query's scores by one
constant, which the softmax removes, so that gradient is zero in exact arithmetic under any mask (the
recomputation would return its fp16 rounding noise instead).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch

from bridge.transfer import transfer_for
from ttj_jax.config import Config
from ttj_jax.params import expected_shapes, params_from_state_dict, params_to_state_dict
from ttj_jax.programs import model_key
from ttj_jax.training import backward_attention, pullback

# The parameter whose gradient is zero in exact arithmetic (module docstring).
ZERO_GRADIENT_SUFFIX = "attention.k_proj.bias"


@functools.cache
def _vjp_program(config: Config, on_gpu: bool, attention: str):
    return jax.jit(functools.partial(pullback, config=config, on_gpu=on_gpu, attention=attention))


def gradients(x: torch.Tensor, mask: torch.Tensor | None, params: list[torch.Tensor], config: Config,
              grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(dL/dx, [dL/dp for p in params]) for y = forward(x, mask) and dL/dy = grad_out. `params` are in the
    harness's order (ops.ordered_parameters)."""
    transfer = transfer_for(x.device)
    names = list(expected_shapes(config))
    to_jax = lambda t: transfer.to_jax(t.detach().float().contiguous())   # noqa: E731
    jparams = params_from_state_dict({name: to_jax(p) for name, p in zip(names, params)}, config)
    jmask = transfer.to_jax(mask.contiguous()) if mask is not None else None
    program = _vjp_program(model_key(config), x.device.type == "cuda", backward_attention())
    gparams, gx = program(jparams, to_jax(x), jmask, to_jax(grad_out))
    flat = params_to_state_dict(gparams)
    grad_x = transfer.to_torch(gx.astype(jnp.float32)).to(x.dtype)
    grads = [torch.zeros_like(p) if name.endswith(ZERO_GRADIENT_SUFFIX)
             else transfer.to_torch(flat[name]).to(device=p.device, dtype=p.dtype) for name, p in zip(names, params)]
    return grad_x, grads


def needs_grad(x: torch.Tensor, params) -> bool:
    """Whether a call must record for autograd: grad mode on, and x or a parameter requiring grad."""
    return (torch.is_grad_enabled() and isinstance(x, torch.Tensor)
            and (x.requires_grad or any(p.requires_grad for p in params)))


class Recorded(torch.autograd.Function):
    """An eager call recorded for autograd: the forward is `run()` (the planned fast path, whatever its
    kernels), the backward `torch.ops.ttj.backward`. Cheaper per call than the custom op's own autograd
    wrapper, which walks its 66-tensor parameter list through pytrees."""

    @staticmethod
    def forward(ctx, run, config: Config, x, mask, *params):
        ctx.config = config
        ctx.save_for_backward(x, mask, *params)   # torch then refuses a backward after in-place edits
        return run()

    @staticmethod
    def backward(ctx, grad_out):
        x, mask, *params = ctx.saved_tensors
        config = ctx.config
        grad_x, *grads = torch.ops.ttj.backward(x, mask, params, config.num_heads, bool(config.causal), grad_out)
        return None, None, grad_x, None, *grads
