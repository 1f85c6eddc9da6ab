"""The JAX entry point: `forward` plans each input signature once and runs one jitted function per
(plan, model shape), compiled once per input shape. What runs is the plan's stack (stacks.py)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ttj_jax import stacks
from ttj_jax.config import Config
from ttj_jax.inputs import cached_mask_kind, validate_inputs
from ttj_jax.masks import MaskKind
from ttj_jax.params import PreparedWeights
from ttj_jax.planner import InputFacts, Plan, device_facts
from ttj_jax.planner import plan as make_plan
from ttj_jax.ring_attention import sequence_parallel_forward
from ttj_jax.stacks import kernel_weights

__all__ = ["clear_forward_cache", "executable", "forward", "forward_cache_plans", "kernel_weights", "model_key", "plan_for",
           "validate_inputs"]


@functools.cache
def executable(plan: Plan, config: Config, compiler_options: tuple = ()):
    """The jitted forward for one plan and model: f(weights, x, mask_or_None) -> y. Pass
    `model_key(config)` so that one executable serves every input shape of a model. The program is
    compiled with the plan's XLA options (`plan.xla_options`) and `compiler_options` on top:
    ((name, value), ...), bench/ablate.py's experiments."""
    if plan.sequence_parallel > 1:   # each sequence over several devices: the ring (ring_attention.py)
        return functools.partial(_run_ring, config=config, plan=plan)
    body = functools.partial(stacks.get(plan.stack).run, config=config, plan=plan)
    if plan.data_parallel > 1:
        from ttj_jax.parallel import batch_mesh, data_parallel
        return data_parallel(body, batch_mesh(plan.data_parallel, jax.default_backend()))
    return jax.jit(body, compiler_options={**dict(plan.xla_options), **dict(compiler_options)} or None)


def _run_ring(weights, x, mask, *, config: Config, plan: Plan):
    # x's batch and length come from x (config is the model key); the ring prepares raw params itself.
    return sequence_parallel_forward(weights, x, mask, config=config.with_input(x.shape[0], x.shape[1]),
                                     devices=plan.sequence_parallel, policy=plan.policy, attention="pallas")


def model_key(config: Config) -> Config:
    """The config with batch_size and seq_len normalised away: they come from x, so one executable
    (and jax's per-shape cache inside it) serves every input shape of one model."""
    return config.with_input(1, 1)


def plan_for(config: Config, x, mask_kind: MaskKind, device=None, caller: str = "jax", **overrides) -> Plan:
    # a traced x (forward inside a caller's jit) has no devices yet: planned for the default device
    placed = hasattr(x, "devices") and callable(x.devices) and not isinstance(x, jax.core.Tracer)
    devices = x.devices() if placed else ()
    device = device if device is not None else next(iter(devices)) if devices else jax.devices()[0]
    facts = InputFacts(batch_size=int(x.shape[0]), seq_len=int(x.shape[1]), dtype=str(jnp.dtype(x.dtype)),
                       mask_kind=mask_kind, input_devices=max(1, len(devices)), caller=caller)
    return make_plan(config, facts, device_facts(device), **overrides)


def forward(params: Any, x, valid_token_mask=None, *, config, mask_kind: MaskKind | str | None = None,
            policy: str | None = None, attention: str | None = None, data_parallel: int | None = None,
            stack: str | None = None, sequence_parallel: int | None = None):
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
        ("sequence_parallel", sequence_parallel)))
    mask = mask if chosen.mask_mode != "none" else None
    if prepared:
        params = kernel_weights(params, key_config, chosen.stack)
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


def _forward_call(config: Config, x, kind: MaskKind, overrides: tuple):
    key = None
    if not isinstance(x, jax.core.Tracer):
        key = (config, x.shape, x.dtype, x.sharding, kind, overrides)
        found = _FORWARD_CALLS.get(key)
        if found is not None:
            return found
    chosen = plan_for(config, x, kind, **dict(overrides))
    key_config = model_key(config)
    found = (chosen, executable(chosen, key_config), key_config)
    if key is not None:
        _FORWARD_CALLS[key] = found
    return found
