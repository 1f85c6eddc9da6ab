"""Data parallelism over several devices with JAX's own SPMD: a 1-D `Mesh` over the batch axis and
`shard_map`. Each device runs exactly the single-device program on its slice of the batch (no
collectives: sequences are independent), with the weights replicated.

Placement is part of the call: inputs committed to one device (a torch tensor imported on cuda:0, say)
are split over the mesh with `device_put`, and the batch-sharded output is gathered back by the caller
that needs one device (the bridge). The planner decides the device count (Plan.data_parallel).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ttj_jax.compat import shard_map

BATCH_AXIS = "batch"


@functools.lru_cache(maxsize=None)
def batch_mesh(device_count: int, platform: str) -> Mesh:
    devices = jax.devices(platform)
    if len(devices) < device_count:
        raise ValueError(f"the plan asks for {device_count} {platform} devices; {len(devices)} are visible")
    return Mesh(np.array(devices[:device_count]), (BATCH_AXIS,))


def data_parallel(body, mesh: Mesh):
    """body(weights, x, mask) on one device's batch slice -> the same over the mesh's batch axis."""
    batch = P(BATCH_AXIS)

    def run(weights, x, mask):
        replicated = NamedSharding(mesh, P())
        sharded = NamedSharding(mesh, batch)
        weights = jax.device_put(weights, replicated)
        x = jax.device_put(x, sharded)
        if mask is None:
            return mapped_no_mask(weights, x)
        return mapped(weights, x, jax.device_put(mask, sharded))

    mapped = jax.jit(shard_map(body, mesh=mesh, in_specs=(P(), batch, batch), out_specs=batch))
    mapped_no_mask = jax.jit(shard_map(lambda w, x: body(w, x, None), mesh=mesh, in_specs=(P(), batch),
                                       out_specs=batch))
    return run
