"""Mosaic GPU primitives the Hopper kernels use inside their bodies, built on jax's private Pallas Mosaic
GPU API (jax 0.10-0.11). Each raises RuntimeError where the installed jax lacks what it needs, and each
has an interpret-mode twin (plain jnp) so the kernels also run on a CPU."""

from __future__ import annotations

import jax


def plgpu_module():
    """`jax.experimental.pallas.mosaic_gpu`, imported on first use: it imports absl (layout inference logs
    through it), which a CPU environment may lack."""
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415 - see the docstring
    return plgpu


# PTX's packed 16-bit exponentials (two elements per special-function-unit instruction, sm_75+ for f16,
# sm_90 for bf16), by element type.
_HALF_EXP2_INSTRUCTIONS = {"float16": ("ex2.approx.f16x2", "ex2.approx.f16"),
                           "bfloat16": ("ex2.approx.ftz.bf16x2", "ex2.approx.ftz.bf16")}


def mosaic_half_exp2(x, *, interpret: bool = False):
    """exp2 of a float16 or bfloat16 array in the WGMMA register layout, inside a Mosaic GPU kernel: one
    packed `ex2.approx` per pair of elements (jax's own exp2 takes fp32 only under approx_math). Through
    `plgpu.inline_mgpu` and two private FragmentedArray helpers (jax 0.10-0.11); raises RuntimeError when
    this jax has neither. interpret: the kernel body runs in GPU interpret mode (XLA on a CPU): exp2 in
    fp32, rounded back to x's dtype."""
    instructions = _HALF_EXP2_INSTRUCTIONS.get(jax.numpy.dtype(x.dtype).name)
    if instructions is None:
        raise ValueError(f"mosaic_half_exp2 takes float16 or bfloat16, not {x.dtype}")
    if interpret:
        return jax.numpy.exp2(x.astype(jax.numpy.float32)).astype(x.dtype)
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415 - imports absl; lazily
    if not hasattr(plgpu, "inline_mgpu") or not hasattr(plgpu, "ShapeDtypeStruct"):
        raise RuntimeError(f"this jax ({jax.__version__}) has no plgpu.inline_mgpu")

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=plgpu.Layout.WGMMA))
    def exp2(_, array):
        lift = getattr(array, "_lift_fast_packed_instr", None)
        if lift is None or not hasattr(array, "_pointwise"):
            raise RuntimeError(f"this jax ({jax.__version__}) has no FragmentedArray._lift_fast_packed_instr")
        return array._pointwise(lift(*instructions))

    return exp2(x)


_CLUSTER_ARRIVE_FROM_WARP = None   # the primitive, built on first use (mosaic_cluster_arrive_from_warp)


def mosaic_cluster_arrive_from_warp(barrier_ref) -> None:
    """Arrive once on a `plgpu.ClusterBarrier` (in every member of the cluster, as `plgpu.barrier_arrive`
    does from a warpgroup), from inside `pl.core_map(plgpu.WarpMesh(...))` in warp 0 of a warpgroup.

    jax's own barrier_arrive refuses collective barriers in a warp context, because Mosaic GPU's cluster
    arrive signals from lanes 0 and 8 (one per member) of the warpgroup's first warp: from any other warp
    nothing would arrive. In warp 0 those lanes are this warp's, so the warpgroup's arrive is exactly
    right; this primitive lowers to it. The caller must be warp 0 (the kernel guards the warp-mapped body
    with `lax.axis_index(warp_axis) == 0`). Through jax's private Pallas Mosaic GPU lowering registry
    (jax 0.10-0.11); raises RuntimeError where this jax has none of it."""
    global _CLUSTER_ARRIVE_FROM_WARP
    if _CLUSTER_ARRIVE_FROM_WARP is None:
        try:
            import dataclasses  # noqa: PLC0415

            from jax._src import core as jax_core  # noqa: PLC0415
            from jax._src.pallas.mosaic_gpu import core as gpu_core  # noqa: PLC0415
            from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering  # noqa: PLC0415
            from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives  # noqa: PLC0415
            arrive_rule = mgpu_primitives._barrier_arrive_lowering
            abstract_eval = mgpu_primitives._barrier_arrive_abstract_eval
            warp_semantics = gpu_core.LANExWARP_SEMANTICS
            warpgroup = gpu_core.PrimitiveSemantics.Warpgroup
        except (ImportError, AttributeError) as e:   # pragma: no cover - depends on the installed jax
            raise RuntimeError(f"this jax ({jax.__version__}) has no Pallas Mosaic GPU lowering registry "
                               f"to arrive on a cluster barrier from a warp: {e}") from e
        primitive = jax_core.Primitive("ttj_cluster_arrive_from_warp")
        primitive.multiple_results = True
        primitive.def_effectful_abstract_eval(abstract_eval)

        def lower(ctx, barrier, *flat_transforms, transforms_treedef):
            if not isinstance(barrier, mgpu_primitives.mgpu.CollectiveBarrierRef):
                raise ValueError("mosaic_cluster_arrive_from_warp arrives on cluster barriers only")
            as_warpgroup = dataclasses.replace(
                ctx, module_ctx=dataclasses.replace(ctx.module_ctx, primitive_semantics=warpgroup))
            return arrive_rule(as_warpgroup, barrier, *flat_transforms, transforms_treedef=transforms_treedef)

        mgpu_lowering.register_lowering_rule(primitive, *warp_semantics)(lower)
        _CLUSTER_ARRIVE_FROM_WARP = primitive
    from jax._src.state import primitives as state_primitives  # noqa: PLC0415
    barrier, transforms = state_primitives.get_ref_and_transforms(barrier_ref, None, "cluster_arrive_from_warp")
    flat_transforms, transforms_treedef = jax.tree_util.tree_flatten(transforms)
    _CLUSTER_ARRIVE_FROM_WARP.bind(barrier, *flat_transforms, transforms_treedef=transforms_treedef)


class SlotRef:
    """q, k or v (or their gradients) inside a fused [B, S, 3, H, head_dim] GMEM ref: `.at[b, rows, h]`
    (all the attention kernels ask of such a ref) is the fused ref's `.at[b, rows, slot, h]`, one TMA
    copy into or out of the big array."""

    def __init__(self, ref, slot: int):
        self.ref, self.slot = ref, slot

    @property
    def at(self):
        return self

    def __getitem__(self, index):
        batch, rows, head = index
        return self.ref.at[batch, rows, self.slot, head]
