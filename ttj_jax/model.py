"""The JAX entry point: `forward` plans each input signature once (by measuring on a GPU: autotune.py)
and runs one jitted function per (plan, model shape), compiled once per input shape (programs.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ttj_jax import autotune as _autotune
from ttj_jax import stacks, training
from ttj_jax.config import Config
from ttj_jax.device import device_facts
from ttj_jax.inputs import cached_mask_kind, validate_inputs
from ttj_jax.masks import MaskKind
from ttj_jax.params import PreparedWeights
from ttj_jax.planner import InputFacts, Plan
from ttj_jax.planner import plan as make_plan
from ttj_jax.programs import executable, model_key
from ttj_jax.stacks import kernel_weights

__all__ = ["clear_forward_cache", "executable", "forward", "forward_cache_plans", "kernel_weights", "model_key", "plan_for",
           "validate_inputs"]


def plan_for(config: Config, x, mask_kind: MaskKind, device=None, caller: str = "jax", autotune: bool | None = None,
             self_launched: tuple[str, ...] = (), **overrides) -> Plan:
    """The plan for x: forced choices in `overrides` (policy=..., stack=...) go to the rules; otherwise on a
    GPU the measured planner decides (autotune.choose: `autotune=False` or TTJ_AUTOTUNE=0 keeps the rules).
    self_launched: the stacks a torch caller launches itself for this call (planner.InputFacts)."""
    # a traced x (forward inside a caller's jit) has no devices yet: planned for the default device
    placed = hasattr(x, "devices") and callable(x.devices) and not isinstance(x, jax.core.Tracer)
    devices = x.devices() if placed else ()
    device = device if device is not None else next(iter(devices)) if devices else jax.devices()[0]
    facts = InputFacts(batch_size=int(x.shape[0]), seq_len=int(x.shape[1]), dtype=str(jnp.dtype(x.dtype)),
                       mask_kind=mask_kind, input_devices=max(1, len(devices)), caller=caller,
                       self_launched=tuple(self_launched))
    if not any(value is not None for value in overrides.values()):
        return _autotune.choose(config, facts, device, autotune=autotune)
    return make_plan(config, facts, device_facts(device), **overrides)


def forward(params: Any, x, valid_token_mask=None, *, config, mask_kind: MaskKind | str | None = None,
            policy: str | None = None, attention: str | None = None, data_parallel: int | None = None,
            stack: str | None = None, sequence_parallel: int | None = None, autotune: bool | None = None):
    """y = Transformer(x) per docs/spec.md, same shape and dtype as x.

    params: raw params (init_params / params_from_state_dict; prepared inside the same jitted call) or
    a PreparedWeights (prepared once, the fast path). valid_token_mask: bool [B, S] or None.
    mask_kind: skip the host-side mask classification when the caller already knows it.
    NaN/inf in x are not hidden: they propagate to the output rows they reach.
    data_parallel: split the batch over that many devices (default: the planner's choice); the output
    is then batch-sharded over them.
    sequence_parallel: split each sequence over that many devices, attention as a ring (default: the
    planner's choice, a long single sequence on one of several GPUs); the output may then be spread
    over them.
    autotune: on a GPU, time the candidate plans of a new input signature and run the fastest (default:
    on unless TTJ_AUTOTUNE=0; decisions kept on disk, see autotune.py); False plans by the rules alone.
    """
    config = Config.from_object(config)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array [batch, seq_len, d_model]; got {type(x).__name__}")
    mask = valid_token_mask
    validate_inputs(x.shape, jnp.dtype(x.dtype).name, None if mask is None else getattr(mask, "shape", ()),
                    None if mask is None else jnp.dtype(mask.dtype).name, config)
    if jnp.dtype(x.dtype) == jnp.float64:
        raise TypeError("x is float64, which jax computes only with x64 mode on; pass float32")
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)   # asarray of an Array: ~8 us for nothing
    mask = mask if mask is None or isinstance(mask, jax.Array) else jnp.asarray(mask)
    kind = MaskKind(mask_kind) if mask_kind is not None else cached_mask_kind(mask)
    prepared = isinstance(params, PreparedWeights)
    chosen, run, key_config = _forward_call(config, x, kind, (
        ("policy", policy), ("attention", attention), ("data_parallel", data_parallel), ("stack", stack),
        ("sequence_parallel", sequence_parallel)), autotune)
    mask = mask if chosen.mask_mode != "none" else None
    if training.is_differentiated(params, x):   # jax.grad and friends (training.py)
        def primal(p, h, m):
            build = stacks.layout_builder(chosen)
            return run(build(p, key_config) if prepared and build is not None else p, h, m)
        on_gpu = jax.default_backend() == "gpu"
        return training.differentiable(primal, key_config, on_gpu)(params, x, mask)
    if prepared:
        params = kernel_weights(params, key_config, chosen)
    return run(params, x, mask)


# forward's plan and executable per input signature: planning on every call cost a JAX user ~70-150 us
# of host time per call on the H200 host (shape 2: 205 us per call replanning, 89 with this cache).
# The key holds everything plan_for reads: the config, x's shape, dtype and sharding, the mask's kind
# and the options; the device facts read there do not change while the process runs. A traced x
# (forward inside a caller's jit) is planned every time (cheap next to tracing).
_FORWARD_CALLS: dict[tuple, tuple] = {}


def clear_forward_cache() -> None:
    """Forgets every input signature's plan and executable (they are found or built again on the next call)."""
    _FORWARD_CALLS.clear()


def forward_cache_plans() -> list[Plan]:
    """The plans `forward` keeps, one per input signature seen."""
    return [found[0] for found in _FORWARD_CALLS.values()]


def _forward_call(config: Config, x, kind: MaskKind, overrides: tuple, autotune: bool | None = None):
    key = None
    if not isinstance(x, jax.core.Tracer):
        key = (config, x.shape, x.dtype, x.sharding, kind, overrides, autotune)
        found = _FORWARD_CALLS.get(key)
        if found is not None:
            return found
    chosen = plan_for(config, x, kind, autotune=autotune, **dict(overrides))
    key_config = model_key(config)
    found = (chosen, executable(chosen, key_config), key_config)
    if key is not None:
        _FORWARD_CALLS[key] = found
    return found
