"""Session 23: can this jax's Pallas Mosaic GPU express what a one-launch shape-13 (or clustered
shape-11) kernel needs: a cluster of CTAs, each writing its shared memory, a cluster barrier, and each
reading its peer's shared memory (`plgpu.cluster_ref`)? Lowers the probe for CUDA and, if it can, runs it
in GPU interpret mode on the CPU (4 host devices: see tests/test_fused_stack_mgpu.py on thread pools).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. python bench/scratch/cluster_probe.py

Each of the 2 CTAs of a cluster fills a [128, 128] fp32 tile with its cluster index + 1, waits on the
cluster barrier, and copies its peer's tile out: y[c] must be all (1 - c) + 1."""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu


def build(interpret: bool):
    def body(y_ref, tile, barrier):
        c = lax.axis_index("c")
        tile[...] = jnp.full((128, 128), 1.0, jnp.float32) + c.astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)
        peer = plgpu.cluster_ref(tile, {"c": 1 - c})
        y_ref[c] = peer[...]

    return plgpu.kernel(
        lambda y_ref: pl.run_scoped(lambda tile, barrier: body(y_ref, tile, barrier),
                                    plgpu.SMEM((128, 128), jnp.float32),
                                    plgpu.ClusterBarrier(collective_axes=("c",), num_arrivals=1)),
        out_type=jax.ShapeDtypeStruct((2, 128, 128), jnp.float32),
        grid=(1,), grid_names=("g",), cluster=(2,), cluster_names=("c",),
        interpret=interpret or None)


def main() -> int:
    result = {"jax": jax.__version__}
    try:
        text = jax.jit(build(False)).trace().lower(lowering_platforms=("cuda",)).as_text()
        result["lowers_for_cuda"] = "mosaic_gpu" in text
    except Exception as e:  # noqa: BLE001 - the probe reports
        result["lowers_for_cuda"] = f"{type(e).__name__}: {str(e)[:600]}"
    try:
        y = np.asarray(build(True)())
        result["interpret_ok"] = bool(np.all(y[0] == 2.0) and np.all(y[1] == 1.0))
        result["interpret_values"] = [float(y[0, 0, 0]), float(y[1, 0, 0])]
    except Exception as e:  # noqa: BLE001
        result["interpret_ok"] = f"{type(e).__name__}: {str(e)[:600]}"
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
