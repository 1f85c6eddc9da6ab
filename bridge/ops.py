"""ttj-jax's forward as a torch custom operator, so that `torch.compile` and `torch.export` see one opaque
op (`torch.ops.ttj.forward`) with a fake implementation instead of tracing into jax.

Eager calls skip the operator (its dispatch costs host time) and run bridge/runtime.py directly. Under
`torch.compile` the module is named by an integer handle, fixed when Dynamo traces the call, so the
graph holds the op, x and the mask; the op looks the module up and runs the same eager path. Its
parameters are read there, as in eager mode: edits between calls are seen.

- CUDA graphs: the op is tagged `cudagraph_unsafe` where torch has that tag, so inductor keeps it out
  of captured graphs; a capture that still reaches it raises (jax's launches cannot be captured by
  torch, and a replay would return stale output).
- `torch.export`: the exported program calls the op with the handle of a module alive in this process.
  Loading it in another process and running it raises an error that says so.
- Inference only: the op has no autograd formula; torch raises if a compiled graph needs one.
"""

from __future__ import annotations

import weakref

import torch

from bridge import runtime

_MODULES: dict[int, tuple[weakref.ref, object]] = {}


@torch._dynamo.assume_constant_result
def module_handle(module: torch.nn.Module, config=None) -> int:
    """An integer naming `module` (and the config to run it with) for the operator; stable per module."""
    handle = id(module)
    entry = _MODULES.get(handle)
    if entry is None or entry[0]() is not module or entry[1] is not config:
        _MODULES[handle] = (weakref.ref(module, lambda _, h=handle: _MODULES.pop(h, None)), config)
    return handle


def _module_of(handle: int):
    entry = _MODULES.get(handle)
    module = entry[0]() if entry is not None else None
    if module is None:
        raise RuntimeError(
            "torch.ops.ttj.forward: the module this graph was traced from is not alive in this process. "
            "A torch.export program of a ttj-jax module runs only in the process that exported it, while "
            "the module lives; export again there, or call the module itself.")
    return module, entry[1]


_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


@torch.library.custom_op("ttj::forward", mutates_args=(), tags=_TAGS)
def forward_op(x: torch.Tensor, valid_token_mask: torch.Tensor | None, handle: int) -> torch.Tensor:
    module, config = _module_of(handle)
    return runtime.forward(module, x, valid_token_mask, config=config)


@forward_op.register_fake
def _forward_fake(x, valid_token_mask, handle):
    return torch.empty_like(x)


def forward(module: torch.nn.Module, x: torch.Tensor, valid_token_mask: torch.Tensor | None = None, *,
            config=None, **options) -> torch.Tensor:
    """Runs ttj-jax on `module`'s own parameters (see bridge.runtime.forward for the options). Under
    torch.compile the call becomes one `torch.ops.ttj.forward` node; the options are eager-only there."""
    if torch.compiler.is_compiling():
        if any(value not in (None, 0) for value in options.values()):
            raise ValueError(f"options {sorted(options)} are not supported under torch.compile; call eagerly")
        return torch.ops.ttj.forward(x, valid_token_mask, module_handle(module, config))
    return runtime.forward(module, x, valid_token_mask, config=config, **options)
