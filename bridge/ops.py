"""ttj-jax's forward as a torch custom operator, so that `torch.compile` and `torch.export` see one opaque
op (`torch.ops.ttj.forward`) with a fake implementation instead of tracing into jax.

Eager calls skip the operator (its dispatch costs host time) and run bridge/runtime.py directly. Under
`torch.compile` the graph holds the op with x and the mask, and names the module one of two ways:
- a `TTJTransformer` by its handle, an int fixed at construction (and renewed on copy or unpickling):
  the op runs the runtime on the module itself, as an eager call does. Each tensor input of a compiled
  graph costs host time per call (~50 us for a model's 66 parameters), so this path passes none.
- any other module with the harness's layout (the one-line drop-in), and every module under
  `torch.export`, by its parameters in the harness's order, plus the two config values their shapes do
  not carry (heads, causal): an exported program then carries everything it needs.
Either way the parameters are read at call time, so edits between calls are seen.

- CUDA graphs: the op is tagged `cudagraph_unsafe` where torch has that tag, so inductor keeps it out
  of captured graphs; a capture that still reaches it raises (jax's launches cannot be captured by
  torch, and a replay would return stale output).
- Autograd: where grad mode is on and x or a parameter requires grad, eager calls and compiled graphs
  take the parameters path (so the parameters are the op's inputs) and the op's registered backward
  (bridge/autograd.py) returns gradients for x and every parameter. Otherwise no autograd work at all.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections import OrderedDict
from operator import is_

import torch

from bridge import autograd, runtime
from ttj_jax.config import Config
from ttj_jax.params import expected_shapes

# Parameter holders by (storage pointers, heads, causal): the runtime's per-module caches live on them.
# A few models' worth: each entry keeps its parameters alive.
_HOLDERS: OrderedDict[tuple, _ParameterHolder] = OrderedDict()
MAX_HOLDERS = 8


class _ParameterHolder(torch.nn.Module):
    """Parameters handed to the op, under the harness's names, as the runtime reads a module's."""

    def __init__(self, names: list[str], params: list[torch.Tensor], config: Config):
        super().__init__()
        self.names, self.params, self.config = names, list(params), config

    def named_parameters(self, *args, **kwargs):
        return zip(self.names, self.params)


def _config_from(params: list[torch.Tensor], num_heads: int, causal: bool, x: torch.Tensor) -> Config:
    if len(params) < 18 or (len(params) - 2) % 16:
        raise ValueError("torch.ops.ttj.forward takes a model's parameters in the harness's order (16 per layer "
                         f"and the final norm's 2); got {len(params)}")
    d_model = params[0].shape[0]                              # layers.0.norm1.weight: (d,)
    ffn_dim = params[12].shape[0]                             # layers.0.ffn_in.weight: (ffn, d)
    num_layers = (len(params) - 2) // 16
    return Config(batch_size=int(x.shape[0]), seq_len=int(x.shape[1]), d_model=int(d_model),
                  num_heads=num_heads, ffn_dim=int(ffn_dim), num_layers=num_layers, causal=causal)


def _holder(params: list[torch.Tensor], num_heads: int, causal: bool, x: torch.Tensor) -> _ParameterHolder:
    key = (tuple(p.data_ptr() for p in params), num_heads, causal)
    holder = _HOLDERS.get(key)
    if holder is not None and all(map(is_, holder.params, params)):   # same pointers: same count
        _HOLDERS.move_to_end(key)
        return holder
    config = _config_from(params, num_heads, causal, x)   # checks the count: 16 per layer, 2 for the final norm
    names = list(expected_shapes(config))
    if holder is not None:
        runtime.refresh(holder)   # new tensor objects on the same storage: rebuild the views
    holder = _HOLDERS[key] = _ParameterHolder(names, params, config)
    while len(_HOLDERS) > MAX_HOLDERS:
        _HOLDERS.popitem(last=False)
    return holder


_REGISTERED: dict[int, weakref.ref] = {}
_NEXT_HANDLE = itertools.count(1)


def register(module: torch.nn.Module) -> int:
    """A new handle naming `module` for the operator (held weakly)."""
    handle = next(_NEXT_HANDLE)
    _REGISTERED[handle] = weakref.ref(module, lambda _, h=handle: _REGISTERED.pop(h, None))
    return handle


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ttj::forward", mutates_args=(), tags=_TAGS)
def forward_op(x: torch.Tensor, valid_token_mask: torch.Tensor | None, handle: int, params: list[torch.Tensor],
               num_heads: int, causal: bool) -> torch.Tensor:
    if handle:
        ref = _REGISTERED.get(handle)
        module = ref() if ref is not None else None
        if module is None:
            raise RuntimeError(f"torch.ops.ttj.forward: no live module has handle {handle} (a graph traced in "
                               "another process?); compile or export again here")
        out = runtime.fast_forward(module, x, valid_token_mask)
        return out if out is not None else runtime.forward(module, x, valid_token_mask)
    holder = _holder(params, num_heads, causal, x)
    return runtime.forward(holder, x, valid_token_mask, config=holder.config)


@forward_op.register_fake
def _forward_fake(x, valid_token_mask, handle, params, num_heads, causal):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, valid_token_mask, handle, params, num_heads, causal = inputs
    ctx.handle, ctx.num_heads, ctx.causal, ctx.masked = handle, num_heads, causal, valid_token_mask is not None
    ctx.save_for_backward(x, valid_token_mask, *params)


@torch.library.custom_op("ttj::backward", mutates_args=(), tags=_TAGS)
def backward_op(x: torch.Tensor, valid_token_mask: torch.Tensor | None, params: list[torch.Tensor], num_heads: int,
                causal: bool, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """[dL/dx, dL/dp for p in params] (opaque to compiled graphs, as the forward is)."""
    config = _config_from(params, num_heads, causal, x)
    grad_x, grads = autograd.gradients(x, valid_token_mask, params, config, grad_out)
    return [grad_x, *grads]


@backward_op.register_fake
def _backward_fake(x, valid_token_mask, params, num_heads, causal, grad_out):
    return [torch.empty_like(x), *(torch.empty_like(p) for p in params)]


def _backward(ctx, grad_out):
    x, valid_token_mask, *params = ctx.saved_tensors
    if ctx.handle:   # forward() sends every call that needs gradients down the parameters path
        raise RuntimeError("torch.ops.ttj.forward was called by module handle, which carries no parameters to "
                           "differentiate; call it with the parameters (bridge.ops.forward does when grad is needed)")
    grad_x, *grads = torch.ops.ttj.backward(x, valid_token_mask, params, ctx.num_heads, ctx.causal, grad_out)
    return grad_x, None, None, grads, None, None


forward_op.register_autograd(_backward, setup_context=_setup_context)


def _exporting() -> bool:
    """Whether torch.export is tracing, from the flag torch.export itself sets. Not
    torch.compiler.is_exporting(): under torch.compile, Dynamo folded that call to a constant True before
    pytorch/pytorch#176347 was fixed (torch 2.11 on the H200 machine does), which sent every compiled
    graph down the parameters path: a model's 66 parameters as the op's inputs, each checked per call."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    if flag is None:   # a torch without the flag: its public reading
        return bool(getattr(torch.compiler, "is_exporting", lambda: False)())
    return bool(flag)


def ordered_parameters(module: torch.nn.Module, num_layers: int) -> list[torch.Tensor]:
    """The module's parameters in the harness's order, by attribute access (what Dynamo traces)."""
    params = []
    for i in range(num_layers):
        layer = module.layers[i]
        attention = layer.attention
        params += [layer.norm1.weight, layer.norm1.bias,
                   attention.q_proj.weight, attention.q_proj.bias, attention.k_proj.weight, attention.k_proj.bias,
                   attention.v_proj.weight, attention.v_proj.bias, attention.out_proj.weight, attention.out_proj.bias,
                   layer.norm2.weight, layer.norm2.bias,
                   layer.ffn_in.weight, layer.ffn_in.bias, layer.ffn_out.weight, layer.ffn_out.bias]
    return params + [module.final_norm.weight, module.final_norm.bias]


def _given(options: dict) -> list[str]:
    """The options set to something other than their defaults (None or 0)."""
    return sorted(name for name, value in options.items() if value not in (None, 0))


def forward(module: torch.nn.Module, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None, *,
            config=None, **options) -> torch.Tensor:
    """Runs ttj-jax on `module`'s own parameters (see bridge.runtime.forward for the options). Under
    torch.compile the call becomes one `torch.ops.ttj.forward` node; the options are eager-only there."""
    if torch.compiler.is_compiling():
        if _given(options):
            raise ValueError(f"options {sorted(options)} are not supported under torch.compile; call eagerly")
        handle = getattr(module, "ttj_handle", 0)
        if handle and config is None and not _exporting() and not autograd.needs_grad(x, module.parameters()):
            return torch.ops.ttj.forward(x, valid_token_mask, handle, [], 0, False)
        config = module.config if config is None else config
        return torch.ops.ttj.forward(x, valid_token_mask, 0, ordered_parameters(module, config.num_layers),
                                     config.num_heads, bool(config.causal))
    if config is None and not options:   # a repeat of the last launched call: one C++ call (bridge/native)
        out = runtime.fast_forward(module, x, valid_token_mask)
        if out is not None:
            return out
    if torch.is_grad_enabled():
        model_config, params = runtime.harness_parameters(module, config)
        if autograd.needs_grad(x, params):
            if _given(options):   # expert knobs: inference only
                warnings.warn(f"bridge.forward options {_given(options)} run without autograd: this call's output records "
                              "no gradient", stacklevel=2)
                return runtime.forward(module, x, valid_token_mask, config=config, **options)
            if module.training:   # a training step: one forward, its residuals kept for the backward
                _, _, tree = runtime.training_parameters(module, config)
                return autograd.Recorded.apply(None, tree, model_config, x, valid_token_mask, *params)
            # eval mode (a harness timing without no_grad, a saliency map): the inference path's speed;
            # x as given (the runtime detaches where it must): its kept import is found again next call
            run = lambda: runtime.forward(module, x, valid_token_mask, config=config)   # noqa: E731
            return autograd.Recorded.apply(run, None, model_config, x, valid_token_mask, *params)
    return runtime.forward(module, x, valid_token_mask, config=config, **options)
