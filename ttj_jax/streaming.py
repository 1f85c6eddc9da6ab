"""Inputs that live in host memory (or do not fit on the device): stream batch chunks through it.

Three stages overlap, each on its own hardware queue: the next chunk's host-to-device copy
(`device_put` is asynchronous), this chunk's compute, and the previous chunk's device-to-host copy
(`copy_to_host_async`). The host waits only for the chunk before last, so at most three chunks are on the
device at once. Every chunk has the same shape (the last is zero-padded), so one program serves them all.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from ttj_jax.config import Config
from ttj_jax.masks import classify_mask
from ttj_jax.model import executable, model_key, plan_for, validate_inputs
from ttj_jax.numerics import get_policy
from ttj_jax.params import PreparedWeights
from ttj_jax.planner import InputFacts, device_facts, streaming_chunk


def stream_forward(weights: PreparedWeights, x_host, valid_token_mask=None, *, config,
                   device=None, batch_chunk: int | None = None, policy: str | None = None,
                   progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """y = Transformer(x) for a host array x [B, S, d]; returns a host array of x's dtype.

    weights: prepared for the plan's policy (prepare_weights); they are placed on `device` once.
    batch_chunk: sequences per chunk (default: the planner's, from the device's memory).
    policy: force the numerics policy (default: the planner's); must match the prepared weights.
    progress(done_chunks, total_chunks) is called as each chunk's result lands on the host.
    """
    config = Config.from_object(config)
    x_host = np.asarray(x_host)
    mask_host = None if valid_token_mask is None else np.asarray(valid_token_mask)
    validate_inputs(x_host.shape, x_host.dtype.name, None if mask_host is None else mask_host.shape,
                    None if mask_host is None else mask_host.dtype.name, config)
    device = device if device is not None else jax.devices()[0]
    B, S, d = x_host.shape
    kind = classify_mask(mask_host)          # on the host already: free
    if batch_chunk is None:
        facts = InputFacts(batch_size=B, seq_len=S, dtype=x_host.dtype.name, mask_kind=kind)
        batch_chunk = streaming_chunk(config, facts, device_facts(device))
    if batch_chunk < 1:
        raise ValueError(f"batch_chunk={batch_chunk} must be >= 1")
    batch_chunk = min(batch_chunk, B)

    probe = jax.ShapeDtypeStruct((batch_chunk, S, d), x_host.dtype)
    plan = plan_for(config, probe, kind, device=device, policy=policy)
    if not get_policy(weights.policy_name).shares_weights_with(get_policy(plan.policy)):
        raise ValueError(f"weights were prepared for policy {weights.policy_name!r}, the plan needs {plan.policy!r}")
    run = executable(plan, model_key(config))
    weights = jax.device_put(weights, device)
    needs_mask = plan.mask_mode != "none"

    starts = list(range(0, B, batch_chunk))

    def put(start):
        stop = min(start + batch_chunk, B)
        xs, ms = x_host[start:stop], None if mask_host is None else mask_host[start:stop]
        if stop - start < batch_chunk:      # pad the tail so every chunk has one shape (one program)
            pad = ((0, batch_chunk - (stop - start)), (0, 0), (0, 0))
            xs = np.pad(xs, pad)
            ms = None if ms is None else np.pad(ms, pad[:2])
        return jax.device_put(xs, device), (jax.device_put(ms, device) if needs_mask else None)

    y_host = np.empty_like(x_host)
    in_flight: list[tuple[int, jax.Array]] = []

    def land(start, y):
        stop = min(start + batch_chunk, B)
        y_host[start:stop] = np.asarray(y)[: stop - start]
        if progress is not None:
            progress(starts.index(start) + 1, len(starts))

    arriving = put(starts[0])
    for i, start in enumerate(starts):
        x_dev, m_dev = arriving
        if i + 1 < len(starts):
            arriving = put(starts[i + 1])   # the next copy overlaps this chunk's compute
        y = run(weights, x_dev, m_dev)
        y.copy_to_host_async()
        in_flight.append((start, y))
        if len(in_flight) > 1:              # wait only for the chunk before this one
            land(*in_flight.pop(0))
    for item in in_flight:
        land(*item)
    return y_host
