"""Stand-ins that let the Hopper attention kernel body run in jax's Mosaic GPU interpret mode on a CPU.

jax's GPU interpret mode (0.10.2) runs a kernel body with warpgroups as threads, SMEM with the
tiling/swizzle transforms, TMA copies, barriers with phase checks, and synchronous wgmma. Where it lacks
what the kernel uses, the kernel body takes `InterpretPlgpu` and `InterpretPallas` for `plgpu` and `pl`,
chosen at trace time, so the GPU kernel's code and its lowering stay untouched
(tests/test_flash_attention_mgpu.py pins the lowered kernel by hash):
- `layout_cast`: no layouts in the interpreter; the value is returned as is.
- `broadcasted_iota(..., layout=)`: `lax.broadcasted_iota`.
- wgmma operands: A must be an SMEM ref that is not a transposed view (the kernel's P is in registers; the
  backward's dS^T is read transposed) and B cannot be a transposed view (the kernel's K^T): they are
  staged in untiled SMEM buffers of the warpgroup first (`StagingPlgpu`).
- `pl.run_state` with accumulator initial values, and the accumulator store of the overlapped softmax:
  a zero accumulator whose result is added to the initial value (the same fp32 sum: init + (0 + P @ V)).
- TMA: zero fill past the array and partial out-of-bounds writes (see `interpret_params`).
What interpret mode leaves to lowering and the H200: the register-A and transposed-view wgmma paths,
layouts, asynchronous wgmma (`wgmma_accumulator_load(wait_n=1)` orders nothing here), register
allocation, clusters, the one-warp producer. Three consumer warpgroups can hang the interpreter, so
defaults run with two there (`launch_block_sizes`).
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl

from ttj_jax.kernels.flash_attention_mgpu_config import ROWS_PER_CONSUMER
from ttj_jax.kernels.mosaic_primitives import plgpu_module


class StagingPlgpu:
    """`plgpu` in interpret mode: the real module, but for the substitutes above, with wgmma's operands the
    interpreter cannot take staged in plain shared memory first: A from registers or a transposed view
    into `a_stage`, a transposed B into `b_stage` (each [warpgroups, rows, columns], large enough)."""

    def __init__(self, a_stage, b_stage):
        self._a_stage, self._b_stage = a_stage, b_stage
        self._plgpu = plgpu_module()

    def __getattr__(self, name):
        return getattr(self._plgpu, name)

    @staticmethod
    def layout_cast(value, layout):
        del layout
        return value

    @staticmethod
    def broadcasted_iota(dtype, shape, dimension, *, layout=None):
        del layout
        return lax.broadcasted_iota(dtype, shape, dimension)

    def wgmma(self, acc, a, b):
        from jax._src.state.types import TransformedRef, TransposeTransform  # noqa: PLC0415
        wg = lax.axis_index("wg")

        def untransposed(ref):   # the value a transposed view shows, or None for any other operand
            if isinstance(ref, TransformedRef) and ref.transforms and isinstance(ref.transforms[-1], TransposeTransform):
                return TransformedRef(ref.ref, ref.transforms[:-1])[...].T
            return None

        def staged(stage, value):
            view = stage.at[wg, pl.ds(0, value.shape[0]), pl.ds(0, value.shape[1])]
            view[...] = value
            return view
        if not isinstance(a, TransformedRef):   # in registers
            a = staged(self._a_stage, a)
        elif (value := untransposed(a)) is not None:
            a = staged(self._a_stage, value)
        if (value := untransposed(b)) is not None:
            b = staged(self._b_stage, value)
        self._plgpu.wgmma(acc, a, b)


class InterpretPlgpu(StagingPlgpu):
    """The forward kernel's `plgpu` in interpret mode: its stages are P's and K^T's (`interpret_smem`)."""

    def __init__(self, scoped):
        (_, _, _, p_stage, kt_stage, *_), *_ = scoped   # see `interpret_smem`
        super().__init__(p_stage, kt_stage)


class InterpretPallas:
    """`pl` for the kernel body in interpret mode: the real module, but for `run_state` (see above)."""

    def __getattr__(self, name):
        return getattr(pl, name)

    @staticmethod
    def run_state(body):
        def run(inits):
            single = not isinstance(inits, tuple)
            inits = (inits,) if single else inits

            def scoped(*refs):
                body(refs[0] if single else refs)
                return tuple(ref[...] for ref in refs)
            accs = pl.run_scoped(scoped, *(plgpu_module().ACC(init.shape, init.dtype) for init in inits))
            outs = tuple(init._init + acc for init, acc in zip(inits, accs))
            return outs[0] if single else outs
        return run


def interpret_smem(interpret, num_wgs: int, head_dim: int, block_kv: int, dtype) -> tuple:
    """The SMEM the interpret-mode wgmma staging adds (P and K^T per consumer warpgroup); none on the GPU."""
    if interpret not in (False, True, "detect_races"):
        raise ValueError(f"interpret={interpret!r} must be False, True or 'detect_races'")
    if interpret:
        plgpu = plgpu_module()
        return (plgpu.SMEM((num_wgs, ROWS_PER_CONSUMER, block_kv), dtype),
                plgpu.SMEM((num_wgs, head_dim, block_kv), dtype))
    return ()


def interpret_params(interpret):
    """`plgpu.kernel(interpret=...)`'s parameters: None on the GPU."""
    if interpret:
        from ttj_jax.compat import mosaic_gpu_interpret_params  # noqa: PLC0415
        # TMA's zero fill past the array (OOBFillMode.ZEROS, which the kernel relies on) is the
        # interpreter's out-of-bounds read returning "uninitialized" memory set to zero. The interpreter
        # drops a TMA write that is partly out of bounds (the GPU writes the part in bounds), so in
        # interpret mode the arrays are padded to whole query tiles (flash_attention_mgpu).
        return mosaic_gpu_interpret_params(detect_races=interpret == "detect_races",
                                           out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    return None
