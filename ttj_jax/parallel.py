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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ttj_jax.compat import shard_map

BATCH_AXIS = "batch"


def batch_mesh(device_count: int, platform: str) -> Mesh:
    return device_mesh(device_count, platform, BATCH_AXIS)


@functools.cache
def device_mesh(device_count: int, platform: str, axis_name: str) -> Mesh:
    """A 1-D mesh over the first `device_count` devices of `platform` (the batch split's, or the ring's)."""
    devices = jax.devices(platform)
    if len(devices) < device_count:
        raise ValueError(f"the plan asks for {device_count} {platform} devices; {len(devices)} are visible")
    return Mesh(np.array(devices[:device_count]), (axis_name,))


def data_parallel(body, mesh: Mesh):
    """body(weights, x, mask) on one device's batch slice -> the same over the mesh's batch axis.

    The weights are replicated over the mesh with device_put, which walks every leaf even when they are
    placed already (tens of weights: a large part of a split chunk's host time, and the bridge sends one
    split call through in several chunks). So the last weights object passed in and its replicated
    version are kept, and the same object (by identity) is not placed again. That holds because jax
    arrays are immutable; a pytree container changed in place after a call is not noticed (the bridge
    builds a new one whenever a parameter changes); the replicated copy stays alive until a call with
    other weights. Likewise x (and the mask) are placed only when
    they are not batch-sharded over the mesh already."""
    batch = P(BATCH_AXIS)
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, batch)
    placed = [None, None]   # (weights passed in, their replicated version)

    def run(weights, x, mask):
        if weights is not placed[0]:
            placed[:] = weights, jax.device_put(weights, replicated)
        weights = placed[1]
        x = place(x)
        if mask is None:
            return mapped_no_mask(weights, x)
        return mapped(weights, x, place(mask))

    def place(array):   # batch-sharded over the mesh; an array already so (the bridge's) is passed as is
        return array if getattr(array, "sharding", None) == sharded else jax.device_put(array, sharded)

    mapped = jax.jit(shard_map(body, mesh=mesh, in_specs=(P(), batch, batch), out_specs=batch))
    mapped_no_mask = jax.jit(shard_map(lambda w, x: body(w, x, None), mesh=mesh, in_specs=(P(), batch),
                                       out_specs=batch))
    return run


# Consecutive chunks a split call goes through by default, the first count that divides the batch. On two
# H200s, shape 6 split in 1 / 2 / 4 chunks: 5.44 / 4.73 / 4.43 ms; 5, 8 and weighted chunks were no faster.
DEFAULT_SPLIT_CHUNKS = (4, 2, 1)


def default_split_chunks(rows: int, devices: int) -> int:
    """The chunk count a split of `rows` over `devices` takes when the caller names none."""
    return next(c for c in DEFAULT_SPLIT_CHUNKS if rows % (devices * c) == 0 or c == 1)


def split_chunk_rows(rows: int, devices: int, chunks) -> list[int]:
    """The batch rows of each consecutive chunk of a split over `devices` (each chunk itself split evenly
    over them). chunks: an int C, C equal chunks (rows must divide into devices * C); or a sequence of
    positive weights, chunks in those proportions, each a multiple of `devices` rows (rows must divide
    by devices), the last taking what rounding leaves. Small first and last chunks shorten the copies
    that nothing overlaps, before the first chunk's program and after the last one's (on two H200s,
    shape 6: within noise of equal chunks)."""
    if isinstance(chunks, bool):
        raise ValueError(f"split chunks must be an int >= 1 or a sequence of positive ints; got {chunks!r}")
    if isinstance(chunks, int):
        if chunks < 1:
            raise ValueError(f"split chunks must be >= 1; got {chunks}")
        if rows % (devices * chunks):
            raise ValueError(f"batch {rows} cannot be split into {chunks} chunk(s) over {devices} devices evenly")
        return [rows // chunks] * chunks
    weights = list(chunks)
    if not weights or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in weights):
        raise ValueError(f"split chunk weights must be positive ints; got {chunks!r}")
    if rows % devices:
        raise ValueError(f"batch {rows} cannot be split over {devices} devices evenly")
    units, total = rows // devices, sum(weights)
    per_device = [units * w // total for w in weights[:-1]]
    per_device.append(units - sum(per_device))
    if min(per_device) < 1:
        raise ValueError(f"batch {rows} is too small for chunk weights {weights} over {devices} devices")
    return [u * devices for u in per_device]
