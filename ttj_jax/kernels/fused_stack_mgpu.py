"""The whole pre-LN layer stack as ONE Mosaic GPU (Hopper, sm_90) kernel, for the launch-bound shapes.

Same model as `fused_stack.py` (docs/spec.md), written with Pallas' Mosaic GPU backend so that the
bridge can also launch it on torch tensors without JAX dispatch (`launch_spec`).

Files: this one is the interface (argument checks, the jax entry point, the launch spec);
`fused_stack_mgpu_layout.py` the limits, block layout and weights; `fused_stack_mgpu_kernel.py` the
kernel body and build; `fused_stack_mgpu_reference.py` `emulate`, its algorithm in NumPy.

Scope: d_model = ffn_dim = 128 (or 32: shape 7), num_heads in {1, 2, 4} (and 8 or 16 at d_model 128,
packed: see the layout module), seq_len in {32, 64, 128}, 1 to 5 layers (all layers' vectors sit in
shared memory), causal or not, any batch; x and y fp32, or both fp16 or bf16 (computed as for fp32 x:
x converted exactly, y rounded once). A token mask (any: prefix or with holes) takes the masked build:
the producer copies the tile's mask bytes to shared memory, every score block adds MASKED_SCORE at
invalid keys, and the epilogue zeroes invalid rows. Everything else belongs to `fused_stack.py` (see
`supports`).

Design (one CUDA block per 128-row tile; three warpgroups):
- Tile. 128 rows: one sequence (S=128) or 128 // S whole sequences (S=32: 4, S=64: 2), with a
  block-diagonal (causal) mask. Grid = cdiv(B, 128 // S); `fused_stack_mgpu_forward` pads the batch
  to a multiple of 128 // S (one copy, only when needed), `kernel_function` refuses other batches.
- Warpgroups. Consumers 0 and 1 own rows 0-63 and 64-127 (one wgmma M=64 tile each); warpgroup 2 is
  the producer: it streams the weights with TMA and gives its registers to the consumers.
- Weights (`MgpuStackWeights`). Every weight matrix of a layer is a "chunk" [N, d, w] fp16, six per
  layer in the order used; the producer streams them through a ring of NUM_SLOTS = 2 chunk slots
  (ready barrier: the TMA; consumed barrier: one arrival per consumer). The MLP runs over w-wide
  blocks of its hidden layer, which is why ffn_dim must equal d_model. All vectors are one fp32 array
  copied to shared memory once.
- Residual. fp32 in shared memory (the TMA target for x and source for y), which leaves registers for
  the attention. Half builds copy x in, and y out, in their dtype over the first half of each
  consumer's own residual rows (a RefUnion: no shared memory added), converted in registers.
- Per layer and consumer: h = LN1(x) (fp16 registers, the wgmma A operand); q per block in registers;
  k and v to shared memory for both consumers (a barrier pair orders writes against the other
  consumer's reads). Per head: scores over the keys it may see (`layout.key_blocks`: at S < 128 its
  own 64 keys; at S = 128 causal in grids up to SPLIT_MAX_TILES tiles consumer 0 scores keys 0-63 and
  consumer 1 keys 0-127, its two blocks' wgmmas chained; else all 128), mask, base-2 softmax in fp32,
  P normalised in fp32 then fp16, ctx = P v. Then x + bout + sum_b ctx_b Wout_b with x itself the
  initial value of one chained wgmma accumulator, LN2, the MLP blocks (GELU in fp32), and the same
  chained accumulation for the second GEMM. Finally LN of the residual -> y.
- Every other wgmma is waited for at once; the two consumers overlap each other. Elementwise work
  (softmax, GELU, LayerNorm) is about half a tile's time, hence the key blocks that skip masked keys.
- Shared memory: x 64 KB + k, v 64 KB + ring 64 KB + vectors 25 KB (L=4) = ~217 KiB of 227 KiB.
- Layers run in a `pl.loop` (not unrolled): chunk j of every layer sits in ring slot j % 2, so the slots
  and barrier indices are static.

Numerics (MIXED_FP16): fp16 GEMM operands, fp32 accumulation, fp32 residual, LayerNorm (eps 1e-5, biased
variance) and softmax in fp32, probabilities normalised before the fp16 rounding (as the XLA path and
`fused_stack_reference`); GELU with `pallas_common.erf`, or where the key blocks are split the fast erf
(A&S 7.1.26, within 1.5e-7); exp2 under `approx_math`. `emulate` models exactly these rounding points.

Checked on a CPU (tests/test_fused_stack_mgpu*.py): lowering for CUDA (layout inference, wgmma and TMA
checks), the weights layout, `emulate` against the fp32 reference, and the body in Mosaic GPU's
interpret mode against `emulate`. Interpret mode stages wgmma's register-A and transposed-B operands
through shared memory, so those GPU paths are checked only by lowering (their lowering is pinned).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ttj_jax.kernels.fused_stack_mgpu_kernel import IO_DTYPES, kernel_function
from ttj_jax.kernels.fused_stack_mgpu_layout import (
    B1,
    B2,
    BK,
    BOUT,
    BQ,
    BV,
    CHUNKS_PER_LAYER,
    D_MODEL,
    LN1_B,
    LN1_W,
    LN2_B,
    LN2_W,
    MIN_BLOCK,
    NUM_CONSUMERS,
    NUM_SLOTS,
    NUM_VECS,
    PACKED_BLOCK,
    PACKED_NUM_HEADS,
    SMEM_BUDGET_BYTES,
    SPLIT_MAX_TILES,
    SUPPORTED_D_MODELS,
    SUPPORTED_NUM_HEADS,
    SUPPORTED_SEQ_LENS,
    TILE_ROWS,
    WG_ROWS,
    MgpuStackWeights,
    blocks,
    default_fast_erf,
    key_blocks,
    model_error,
    smem_bytes,
    stack_weights_mgpu,
    supports,
    tile_count,
    weight_shapes,
    widths,
)
from ttj_jax.kernels.fused_stack_mgpu_reference import emulate
from ttj_jax.kernels.pallas_common import GEMM_DTYPE

__all__ = [
    "IO_DTYPES", "B1", "B2", "BK", "BOUT", "BQ", "BV", "CHUNKS_PER_LAYER", "D_MODEL", "LN1_B", "LN1_W", "LN2_B", "LN2_W",
    "MIN_BLOCK", "NUM_CONSUMERS", "NUM_SLOTS", "NUM_VECS", "PACKED_BLOCK", "PACKED_NUM_HEADS", "SMEM_BUDGET_BYTES",
    "SPLIT_MAX_TILES", "SUPPORTED_D_MODELS", "SUPPORTED_NUM_HEADS", "SUPPORTED_SEQ_LENS", "TILE_ROWS", "WG_ROWS",
    "LaunchSpec", "MgpuStackWeights", "blocks", "default_fast_erf", "emulate", "fused_stack_mgpu_forward",
    "kernel_function", "key_blocks", "launch_spec", "model_error", "smem_bytes", "stack_weights_mgpu",
    "supports", "tile_count", "weight_shapes", "widths"]


def _check_call(weights, x, num_heads, causal):
    if not isinstance(weights, MgpuStackWeights):
        raise ValueError(f"weights={type(weights).__name__} must be MgpuStackWeights (see stack_weights_mgpu)")
    if not isinstance(causal, bool):
        raise ValueError(f"causal={causal!r} must be a bool")
    if isinstance(num_heads, bool) or num_heads != weights.num_heads:
        raise ValueError(f"num_heads={num_heads!r} must match the weights' num_heads={weights.num_heads}")
    if x.ndim != 3:
        raise ValueError(f"x.shape={x.shape} must be [batch, seq_len, d_model] (rank 3)")
    batch, seq_len, d_model = x.shape
    if d_model != weights.d_model:
        raise ValueError(f"x.shape={x.shape}: d_model={d_model} must be the weights' {weights.d_model}")
    error = model_error(d_model, num_heads, d_model)
    if error:
        raise ValueError(error)
    if weights.num_blocks != blocks(d_model, num_heads)[0]:   # e.g. 16 heads' weights built one chunk per head
        raise ValueError(f"weights.mats.shape={weights.mats.shape}: {num_heads} heads at d_model={d_model} "
                         f"need {blocks(d_model, num_heads)[0]} head blocks (see stack_weights_mgpu)")
    if jnp.dtype(x.dtype).name not in IO_DTYPES:
        raise ValueError(f"x.dtype={jnp.dtype(x.dtype)} must be one of {IO_DTYPES}")
    if seq_len not in SUPPORTED_SEQ_LENS:
        raise ValueError(f"{seq_len=} must be one of {SUPPORTED_SEQ_LENS}")
    if batch < 1:
        raise ValueError(f"x.shape={x.shape} must have batch >= 1")


@functools.partial(jax.jit, static_argnames=("num_heads", "causal", "interpret"))
def fused_stack_mgpu_forward(weights: MgpuStackWeights, x: jax.Array, valid_token_mask: jax.Array | None = None,
                             *, num_heads: int, causal: bool = True, interpret: bool = False) -> jax.Array:
    """y = LN_final(layers(x)) (docs/spec.md) in one Mosaic GPU kernel; [B, S, d] in x's dtype (float32,
    or float16 / bfloat16 read and written as they are, computed as the float32 build computes).

    valid_token_mask: None, or [B, S] bool, int8 or uint8 (nonzero = valid): invalid keys are left out
    of every softmax and invalid rows of y are zeros, for any mask (the masked build).
    S in {32, 64, 128}; any B (for S < 128 a B that is not a multiple of 128 // S is padded: one copy
    in, one slice out). Runs on Hopper; `interpret=True` runs the kernel body in Mosaic GPU's interpret
    mode on a CPU (slow; wgmma operands staged through shared memory there)."""
    _check_call(weights, x, num_heads, causal)
    batch, seq_len, _ = x.shape
    inputs = [x]
    if valid_token_mask is not None:
        if tuple(valid_token_mask.shape) != (batch, seq_len):
            raise ValueError(f"valid_token_mask.shape={tuple(valid_token_mask.shape)} must be [batch, seq_len] "
                             f"= {(batch, seq_len)}")
        if jnp.dtype(valid_token_mask.dtype) not in (jnp.dtype(jnp.bool_), jnp.dtype(jnp.int8), jnp.dtype(jnp.uint8)):
            raise ValueError(f"valid_token_mask.dtype={jnp.dtype(valid_token_mask.dtype)} must be bool, int8 or uint8")
        inputs.append((valid_token_mask != 0).astype(jnp.uint8))
    batch_pad = -batch % (TILE_ROWS // seq_len)
    if batch_pad:   # padding sequences: zeros, and with a mask all invalid
        inputs = [jnp.pad(a, ((0, batch_pad),) + ((0, 0),) * (a.ndim - 1)) for a in inputs]
    if len(inputs) == 2:   # the kernel reads the mask as one 128-byte row per tile (the same bytes)
        inputs[1] = inputs[1].reshape(-1, TILE_ROWS)
    y = kernel_function(batch + batch_pad, seq_len, num_heads, weights.num_layers, causal, interpret,
                        d_model=weights.d_model, masked=len(inputs) == 2,
                        io_dtype=jnp.dtype(x.dtype).name)(*inputs, weights.mats, weights.vecs)
    return y[:batch] if batch_pad else y


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """Everything a launcher outside jax needs for one input shape. `function(x, mats, vecs) -> y` (masked:
    `function(x, mask, mats, vecs)`, the mask [B, S] uint8) holds nothing but the Mosaic GPU call; its
    arguments are `arg_structs` (x, the mask if masked, then MgpuStackWeights' mats and vecs as
    `stack_weights_mgpu` lays them out), its one output `out_shape` of `out_dtype`."""
    function: Callable
    arg_structs: tuple[jax.ShapeDtypeStruct, ...]
    out_shape: tuple[int, ...]
    out_dtype: np.dtype


def launch_spec(config: Any, batch: int, seq_len: int, masked: bool = False, dtype: str = "float32") -> LaunchSpec:
    """The LaunchSpec of the kernel for `config` (d_model, num_heads, num_layers, causal) on x
    [batch, seq_len, d_model] of `dtype` (IO_DTYPES; y the same) (and, masked, the [batch, seq_len]
    uint8 mask's bytes as [batch * seq_len // 128, 128]: a contiguous torch bool mask as it is). Raises ValueError for
    what the kernel does not run, including a batch that is not a multiple of 128 // seq_len (callers pad
    or go through fused_stack_mgpu_forward)."""
    function = kernel_function(batch, seq_len, config.num_heads, config.num_layers, config.causal,
                               d_model=config.d_model, masked=masked, io_dtype=jnp.dtype(dtype).name)
    mats, vecs = weight_shapes(config.num_layers, config.d_model, config.num_heads)
    x = jax.ShapeDtypeStruct((batch, seq_len, config.d_model), jnp.dtype(dtype))
    mask = (jax.ShapeDtypeStruct((batch * seq_len // TILE_ROWS, TILE_ROWS), jnp.uint8),) if masked else ()
    return LaunchSpec(function, (x, *mask, jax.ShapeDtypeStruct(mats, GEMM_DTYPE),
                                 jax.ShapeDtypeStruct(vecs, jnp.float32)), x.shape, np.dtype(x.dtype))
