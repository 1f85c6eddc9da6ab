"""The compiled programs: one jitted function per (plan, model), which jax compiles once per input
shape. What runs is the plan's stack (stacks.py), over several devices where the plan splits the work."""

from __future__ import annotations

import functools

import jax

from ttj_jax import stacks
from ttj_jax.config import Config
from ttj_jax.planner import Plan
from ttj_jax.ring_attention import sequence_parallel_forward


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
