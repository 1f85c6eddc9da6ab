"""The layer stacks a plan can run, by name (`Plan.stack`): the layer-by-layer XLA program and our
whole-stack and row-tile kernels.

Each `Stack` says how to run it (`run`), which weight layout it takes (`build_weights`, built once per
PreparedWeights; None: the PreparedWeights themselves), and, for the kernels the torch bridge launches
itself without JAX dispatch, which shapes it can launch (`bridge_launch`: the Mosaic GPU kernel;
`kernels_only`: a program of Triton kernels) and the weight arrays that launch reads (`weight_arrays`).
model.py and the bridge look a plan's stack up here instead of testing its name. Kernel modules are
imported on first use: importing Pallas' GPU backends costs seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable

import jax

from ttj_jax.config import Config
from ttj_jax.layers import key_mask_for, run_layers, split_qkv
from ttj_jax.numerics import get_policy
from ttj_jax.params import PreparedWeights, StackedWeights, prepare_weights, stack_layer_weights
from ttj_jax.planner import KEY_MASK_MODES, ROWS_BLOCK, Plan
from ttj_jax.planner import STACKS as PLANNED_STACKS


@dataclasses.dataclass(frozen=True)
class Stack:
    name: str
    run: Callable                                  # run(weights, x, mask, *, config, plan) -> y
    build_weights: Callable | None = None          # (prepared, config) -> the kernel's weight layout
    weight_arrays: Callable | None = None          # that layout -> the arrays a bridge launch reads
    bridge_launch: Callable | None = None          # (config, batch, seq_len) -> None, or why not
    # Its program is Pallas Triton kernels joined by reshapes: the torch bridge may launch those kernels
    # itself (bridge/triton_launch.py), reading the weight layout's leaves (`weight_arrays`).
    kernels_only: bool = False


def _run_fused(weights, x, mask, *, config: Config, plan: Plan):
    """The fused whole-stack kernel (plan.stack == "fused"); a mask, when the plan passes one, is applied
    inside the kernel in full (key masking and row zeroing, whatever the mask mode). weights: FusedWeights
    (the fast path, see `kernel_weights`), PreparedWeights or raw params (stacked inside this call)."""
    from ttj_jax.kernels.fused_stack import FusedWeights, StackBlocks, fused_stack_forward, stack_weights
    if not isinstance(weights, FusedWeights):
        if not isinstance(weights, PreparedWeights):
            weights = prepare_weights(weights, get_policy(plan.policy))
        weights = stack_weights(weights, num_heads=config.num_heads)
    blocks = StackBlocks()
    return fused_stack_forward(weights, x, mask, num_heads=config.num_heads, causal=config.causal,
                               block_sequences=blocks.block_sequences, ffn_block=blocks.ffn_block,
                               num_warps=blocks.num_warps, num_stages=blocks.num_stages, unroll=blocks.unroll,
                               interpret=jax.default_backend() == "cpu")


def _run_fused_mgpu(weights, x, mask, *, config: Config, plan: Plan):
    """The whole stack as one Mosaic GPU kernel (plan.stack == "fused_mgpu"): mask-free plans, "rows"
    plans (a prefix mask under causal attention) with the mask-free kernel and their invalid rows zeroed
    after it (zero_invalid_rows), and "keys" or "device" plans with the masked build, which takes any
    mask. weights: MgpuStackWeights (the fast path, see `kernel_weights`), PreparedWeights or raw
    params."""
    from ttj_jax.kernels.fused_stack_mgpu import MgpuStackWeights, fused_stack_mgpu_forward, stack_weights_mgpu
    if not isinstance(weights, MgpuStackWeights):
        if not isinstance(weights, PreparedWeights):
            weights = prepare_weights(weights, get_policy(plan.policy))
        weights = stack_weights_mgpu(weights, config.num_heads)
    masked = plan.mask_mode in KEY_MASK_MODES and mask is not None
    y = fused_stack_mgpu_forward(weights, x, mask if masked else None, num_heads=config.num_heads,
                                 causal=config.causal, interpret=jax.default_backend() == "cpu")
    return zero_invalid_rows(y, mask) if plan.mask_mode == "rows" and mask is not None else y


def zero_invalid_rows(y, mask):
    """y with the rows of invalid tokens set to 0 (a NaN there included). After a mask-free stack this is
    the whole of a prefix mask's work under causal attention: each valid query attends only to earlier
    keys, all valid, so no valid row depends on an invalid one (docs/spec.md)."""
    return jax.numpy.where(mask[..., None], y, 0.0)


def _run_rows(weights, x, mask, *, config: Config, plan: Plan):
    """Per layer our flash attention and one row-tile kernel for everything else (plan.stack == "rows")."""
    from ttj_jax.kernels.row_block import RowsWeights, rows_forward
    if not isinstance(weights, (PreparedWeights, RowsWeights)):
        weights = prepare_weights(weights, get_policy(plan.policy))
    row_valid = mask if plan.mask_mode != "none" else None
    key_valid = key_mask_for(mask, mode=plan.mask_mode)
    return rows_forward(weights, x, row_valid, key_valid, num_heads=config.num_heads, causal=config.causal,
                        block_rows=ROWS_BLOCK, interpret=jax.default_backend() == "cpu")


def _mgpu_bridge_launch(config: Config, batch: int, seq_len: int) -> str | None:
    from ttj_jax.kernels.fused_stack_mgpu import TILE_ROWS, supports
    if not supports(config, seq_len):
        return f"the Mosaic GPU stack kernel does not take this model at S={seq_len}"
    if batch % (TILE_ROWS // seq_len):
        return (f"batch {batch} at S={seq_len} needs padding to fill the kernel's {TILE_ROWS}-row tiles "
                "(the jax path pads)")
    return None


def _layers_weights(prepared, config: Config):
    return _stack_jitted(prepared)


_stack_jitted = jax.jit(stack_layer_weights)


@jax.jit
def _stack_split_qkv(prepared):
    stacked = stack_layer_weights(prepared)
    weight, bias = split_qkv(stacked.layers["qkv_weight"], stacked.layers["qkv_bias"])
    return StackedWeights({**stacked.layers, "qkv_weight": weight, "qkv_bias": bias}, stacked.final_norm,
                          stacked.policy_name)


def _layers_qkv3_weights(prepared, config: Config):
    """The XLA program's stacked weights with q/k/v's split apart ([L, 3, d, d], [L, 3, d]): each of the
    three GEMMs (Plan.qkv_gemms = 3) reads a contiguous slice, no copy."""
    return _stack_split_qkv(prepared)


def _rows_weights(prepared, config: Config):
    from ttj_jax.kernels.row_block import rows_weights
    return jax.jit(functools.partial(rows_weights, num_heads=config.num_heads))(prepared)


def _fused_weights(prepared, config: Config):
    from ttj_jax.kernels.fused_stack import stack_weights
    return jax.jit(functools.partial(stack_weights, num_heads=config.num_heads))(prepared)


def _mgpu_weights(prepared, config: Config):
    from ttj_jax.kernels.fused_stack_mgpu import stack_weights_mgpu  # jitted inside
    return stack_weights_mgpu(prepared, config.num_heads)


STACKS: dict[str, Stack] = {stack.name: stack for stack in (
    Stack("layers", run_layers, build_weights=_layers_weights),
    Stack("fused", _run_fused, build_weights=_fused_weights, weight_arrays=jax.tree_util.tree_leaves,
          kernels_only=True),
    Stack("rows", _run_rows, build_weights=_rows_weights, weight_arrays=jax.tree_util.tree_leaves,
          kernels_only=True),
    Stack("fused_mgpu", _run_fused_mgpu, build_weights=_mgpu_weights,
          weight_arrays=lambda weights: [weights.mats, weights.vecs], bridge_launch=_mgpu_bridge_launch),
)}
assert tuple(STACKS) == PLANNED_STACKS, "the planner's stack names and this registry must agree"


def get(name: str) -> Stack:
    try:
        return STACKS[name]
    except KeyError:
        raise ValueError(f"no stack {name!r}; the stacks are {sorted(STACKS)}") from None


_KERNEL_WEIGHTS: weakref.WeakKeyDictionary[PreparedWeights, dict] = weakref.WeakKeyDictionary()


# Weight layouts beyond the stacks' own, by name (`weights_layout`).
_LAYOUTS: dict[str, Callable] = {"layers-qkv3": _layers_qkv3_weights}


def weights_layout(plan: Plan) -> str:
    """The name of the weight layout `plan`'s executable takes: its stack's, or the XLA program's with the
    q/k/v weight split for three GEMMs (Plan.qkv_gemms)."""
    return "layers-qkv3" if plan.qkv_gemms == 3 else plan.stack


def layout_builder(layout: str | Plan) -> Callable | None:
    """(prepared, config) -> the layout's weights, or None where the executable takes PreparedWeights."""
    layout = weights_layout(layout) if isinstance(layout, Plan) else layout
    return _LAYOUTS[layout] if layout in _LAYOUTS else get(layout).build_weights


def kernel_weights(prepared: PreparedWeights, config: Config, layout: str | Plan):
    """What a plan's executable takes for `prepared`: its weight layout (a plan, or a layout's name: a
    stack's, see `weights_layout`), built once per PreparedWeights object (they are immutable) and kept
    as long as it lives; `prepared` itself for stacks without one."""
    layout = weights_layout(layout) if isinstance(layout, Plan) else layout
    build = layout_builder(layout)
    if build is None:
        return prepared
    cached = _KERNEL_WEIGHTS.setdefault(prepared, {})
    if layout not in cached:
        cached[layout] = build(prepared, config)
    return cached[layout]
