"""Flash attention forward pass for Hopper (sm_90), written with Pallas' Mosaic GPU backend.

The generic kernel in `flash_attention.py` lowers through Triton and runs everywhere. This one is the
H200 path for head_dim 32, 64, 128 and 256: tensor-core `wgmma`, TMA bulk copies into a ring of
shared-memory stages, and warp specialization in the FlashAttention-3 style (the kernel body and its
design: `flash_attention_mgpu_kernel.py`; block sizes: `flash_attention_mgpu_config.py`). It takes a key
mask (`key_mask`, read per KV block), not `kv_lengths`: `flash_attention` sends calls with `kv_lengths`,
other head sizes, float32 inputs or non-Hopper devices to the generic kernel, mask-free ones to this
kernel from `dispatch_min_seq_len` on, and key-masked ones only where its `KEY_MASK_DISPATCH` says.
`interpret=True` runs the body in Mosaic GPU's CPU interpreter.

Layouts: q, k, v are read in place from their `[B, S, H, head_dim]` arrays (the free reshape of a
`[B, S, d]` projection), or out of one fused `[B, S, 3, H, head_dim]` array
(`flash_attention_mgpu_fused_qkv`), and the output is written in place: no transposes, and no padding
when S is a multiple of 8 (Mosaic GPU's TMA tiles the sequence axis by 8 rows; other S are padded once).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ttj_jax.kernels.attention_common import attention_reference, check_causal_and_scale, check_qkv_layout, fused_qkv_view
from ttj_jax.kernels.flash_attention_mgpu_config import (
    LOWERING_SEMANTICS,
    ROWS_PER_CONSUMER,
    SUPPORTED_HEAD_DIMS,
    MgpuBlockSizes,
    default_block_sizes,
    default_lowering_semantics,
    launch_block_sizes,
    swizzle_bytes,
)
from ttj_jax.kernels.flash_attention_mgpu_interpret import interpret_params, interpret_smem
from ttj_jax.kernels.flash_attention_mgpu_kernel import (
    BOUNDS_ROW,
    CLUSTER_AXIS,
    HEAD_AXIS,
    Q_TILE_AXIS,
    SEQUENCE_AXIS,
    attention_kernel,
    interpret_kernel,
    mask_slot_bytes,
)
from ttj_jax.kernels.mosaic_primitives import SlotRef, plgpu_module

__all__ = ["FUSED_MIN_SEQ_LEN", "LOWERING_SEMANTICS", "MIN_SEQ_LEN", "SUPPORTED_HEAD_DIMS", "UNFUSED_MIN_SEQ_LEN",
           "MgpuBlockSizes", "attention_flops", "default_block_sizes", "default_lowering_semantics",
           "dispatch_min_seq_len", "flash_attention_mgpu", "flash_attention_mgpu_fused_qkv",
           "flash_attention_mgpu_reference", "padded_seq_len"]

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

# Key-masked builds read per-sequence clean-block bounds and add the mask's bias only from the first KV block
# holding an invalid key on (the kernel's docstring). Measured on one H100 (2026-12-06,
# `bench/bench_attention_mgpu.py --key_mask_clean`, attention-mgpu-2026-12-06-h100-key-mask-clean.json): all-True
# and padding masks run at 0.81-0.94x the mask-free build (0.75-0.85x without the bounds), masks with holes
# within 3% of the build without them.
KEY_MASK_CLEAN_BLOCKS = True


def clean_block_bounds(key_mask: jax.Array, block_kv: int) -> jax.Array:
    """[B, BOUNDS_ROW] int32, column 0 the count of leading KV blocks of `block_kv` keys with no invalid key
    in each sequence of key_mask (bool [B, S]; keys past S count as valid: the kernel masks them by
    position)."""
    batch, seq_len = key_mask.shape
    num_blocks = pl.cdiv(seq_len, block_kv)
    padded = jnp.pad(key_mask, ((0, 0), (0, num_blocks * block_kv - seq_len)), constant_values=True)
    clean = padded.reshape(batch, num_blocks, block_kv).all(axis=-1)
    leading = jnp.cumprod(clean.astype(jnp.int32), axis=-1).sum(axis=-1, dtype=jnp.int32)
    return jnp.zeros((batch, BOUNDS_ROW), jnp.int32).at[:, 0].set(leading)


# From this sequence length on `flash_attention` sends mask-free fp16/bf16 calls to this kernel on sm_90:
# faster than the generic kernel at S=16384 (head_dim 128: 553 against 416 TFLOP/s; 256: 577 against 226)
# and S=100000 (head_dim 64: 476 against 350), level at S=1024.
MIN_SEQ_LEN = 4096
# Fused-layout calls, read in place, from these lengths on: faster at S=128 for head_dim 128 and 256
# (shape 8's call: 24.3 against 27.9 us) and at S=1024 for 64 (146 against 165 us; slower at S=128).
FUSED_MIN_SEQ_LEN = {64: 1024, 128: 1, 256: 1}
# head_dims whose own threshold replaces MIN_SEQ_LEN. head_dim 32: 273 against the generic kernel's 234
# TFLOP/s at S=8192, slower at S=1024 (134 against 165); nothing between measured.
UNFUSED_MIN_SEQ_LEN = {32: 8192}


def dispatch_min_seq_len(head_dim: int, fused: bool) -> int:
    """From which sequence length `ttj_jax.kernels.flash_attention` sends a mask-free fp16/bf16 call at
    this head_dim to this kernel on sm_90; fused: the call reads a [B, S, 3, H, hd] array."""
    if fused and head_dim in FUSED_MIN_SEQ_LEN:
        return FUSED_MIN_SEQ_LEN[head_dim]
    return UNFUSED_MIN_SEQ_LEN.get(head_dim, MIN_SEQ_LEN)


def attention_flops(batch: int, seq_len: int, num_heads: int, head_dim: int, causal: bool) -> float:
    """Matmul FLOPs of the forward pass: 4 * B * H * S^2 * hd, halved under causal attention."""
    flops = 4.0 * batch * num_heads * seq_len * seq_len * head_dim
    return flops / 2 if causal else flops


def padded_seq_len(seq_len: int) -> int:
    """The sequence length the kernel's arrays have: S itself when S % 8 == 0 or S < 8, else the next
    multiple of 8 (Mosaic GPU's TMA path tiles the sequence axis by 8 rows and needs whole tiles)."""
    return seq_len if seq_len < 8 or seq_len % 8 == 0 else seq_len + (-seq_len % 8)


def _check_inputs(q, k, v, causal, sm_scale, block_sizes, return_lse, lowering_semantics, key_mask=None):
    check_causal_and_scale(causal, sm_scale)
    if key_mask is not None and (key_mask.shape != q.shape[:2] or jnp.dtype(key_mask.dtype) != jnp.bool_):
        raise ValueError(f"key_mask.shape={key_mask.shape}, key_mask.dtype={key_mask.dtype}: must be bool "
                         f"[batch, seq_len] = {q.shape[:2]}")
    if block_sizes is not None and not isinstance(block_sizes, MgpuBlockSizes):
        raise ValueError(f"block_sizes={block_sizes!r} must be an MgpuBlockSizes or None")
    check_qkv_layout(q, k, v)
    if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype={jnp.dtype(q.dtype)} must be float16 or bfloat16")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q.shape={q.shape}: head_dim={q.shape[-1]} must be one of {SUPPORTED_HEAD_DIMS}")
    if any(size < 1 for size in q.shape):
        raise ValueError(f"q.shape={q.shape} must have no empty dimension")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse={return_lse!r} must be a bool")
    if lowering_semantics is not None and lowering_semantics not in LOWERING_SEMANTICS:
        raise ValueError(f"lowering_semantics={lowering_semantics!r} must be None, 'warpgroup' or 'lane'")


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "lowering_semantics",
                                             "interpret", "return_lse", "clean_blocks"))
def flash_attention_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, interpret: bool | str = False,
                         sm_scale: float | None = None, block_sizes: MgpuBlockSizes | None = None,
                         lowering_semantics: str | None = None, return_lse: bool = False,
                         key_mask: jax.Array | None = None, clean_blocks: bool | None = None):
    """Softmax attention `softmax(q k^T * sm_scale) v` per (batch, head) on Hopper, in one kernel.

    Args:
      q, k, v: [B, S, H, head_dim], all float16 or all bfloat16; head_dim 32, 64, 128 or 256; any S >= 1.
      causal: key j is excluded for query i when j > i.
      sm_scale: Python float, default head_dim ** -0.5.
      key_mask: optional bool [B, S]; keys with key_mask[b, j] == False are excluded. A query with no
        allowed key gets zeros (and a log-sum-exp of -inf), as from the generic kernel.
      clean_blocks: with key_mask, whether the kernel skips the mask's bias in each sequence's leading
        KV blocks with no invalid key (`clean_block_bounds`); None: KEY_MASK_CLEAN_BLOCKS.
      block_sizes: MgpuBlockSizes, or None for the per-head_dim and length default (`default_block_sizes`).
      lowering_semantics: "warpgroup" or "lane" (Mosaic GPU's two lowering modes), or None for the
        per-head_dim default (`default_lowering_semantics`).
      interpret: True or "detect_races" (with its race detector): Mosaic GPU's interpret mode on a CPU.
      return_lse: also return each row's log-sum-exp, log(sum_j exp(sm_scale q.k_j)) over its allowed keys,
        [B, H, S] fp32, from the kernel's running max and sum.

    Returns:
      [B, S, H, head_dim] in q's dtype (and the log-sum-exp with return_lse).
    """
    _check_inputs(q, k, v, causal, sm_scale, block_sizes, return_lse, lowering_semantics, key_mask)
    return _launch((q, k, v), q.shape, causal=causal, interpret=interpret, sm_scale=sm_scale,
                   block_sizes=block_sizes, lowering_semantics=lowering_semantics, return_lse=return_lse,
                   key_mask=key_mask, clean_blocks=clean_blocks)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "lowering_semantics", "interpret",
                                             "clean_blocks", "return_lse"))
def flash_attention_mgpu_fused_qkv(qkv: jax.Array, *, causal: bool, interpret: bool | str = False,
                                   sm_scale: float | None = None, block_sizes: MgpuBlockSizes | None = None,
                                   lowering_semantics: str | None = None, key_mask: jax.Array | None = None,
                                   clean_blocks: bool | None = None, return_lse: bool = False):
    """`flash_attention_mgpu` on q, k, v read in place out of one fused projection: qkv [B, S, 3, H,
    head_dim] (the free reshape of a [B, S, 3 d] output of x @ W_qkv, columns ordered q | k | v, each
    head-major). The TMA copies index slot 0, 1 or 2 of the array itself: slicing q, k and v out first
    cost more than the kernel at shape 8's call (3 x 11.4 us against 22.4). key_mask, clean_blocks,
    return_lse: as in `flash_attention_mgpu`. Returns [B, S, H, head_dim] (and the log-sum-exp [B, H, S]
    with return_lse)."""
    view = fused_qkv_view(qkv)
    _check_inputs(view, view, view, causal, sm_scale, block_sizes, return_lse, lowering_semantics, key_mask)
    return _launch((qkv,), view.shape, causal=causal, interpret=interpret, sm_scale=sm_scale,
                   block_sizes=block_sizes, lowering_semantics=lowering_semantics, return_lse=return_lse,
                   key_mask=key_mask, clean_blocks=clean_blocks)


def _launch(operands: tuple, shape: tuple, *, causal, interpret, sm_scale, block_sizes, lowering_semantics,
            return_lse, key_mask=None, clean_blocks=None):
    """The kernel call: operands are (q, k, v) [B, S, H, hd] or (qkv,) [B, S, 3, H, hd] (fused);
    shape is q's [B, S, H, hd]; key_mask bool [B, S] or None; clean_blocks: flash_attention_mgpu's."""
    plgpu = plgpu_module()
    fused = len(operands) == 1
    batch, seq_len, num_heads, head_dim = shape
    dtype = jnp.dtype(operands[0].dtype)
    sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    blocks = launch_block_sizes(seq_len, head_dim, dtype.itemsize, block_sizes, interpret)
    if blocks.kv_multicast and interpret:
        raise ValueError("MgpuBlockSizes.kv_multicast runs on the GPU only (2-block clusters): "
                         f"interpret={interpret!r}")
    if lowering_semantics is None:
        lowering_semantics = default_lowering_semantics(head_dim)
    if blocks.warp_producer and lowering_semantics == "warpgroup":
        if block_sizes is not None:
            raise ValueError("MgpuBlockSizes.warp_producer needs lowering_semantics='lane' (Mosaic GPU's "
                             "warpgroup lowering has no warp-level copies)")
        blocks = dataclasses.replace(blocks, warp_producer=False)   # a default tiling runs either way
    num_q_tiles = pl.cdiv(seq_len, blocks.block_q)
    num_wgs, num_stages = blocks.num_compute_wgs, blocks.num_stages

    # Tiles of (8 rows, 128 bytes), 128-byte swizzle: wgmma reads them without bank conflicts, TMA writes
    # them. Rows narrower than 128 bytes (head_dim 32 in fp16: 64) take the swizzle of their width.
    swizzle = swizzle_bytes(head_dim, dtype.itemsize)
    transforms = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    smem = (plgpu.SMEM((num_wgs, ROWS_PER_CONSUMER, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, blocks.block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, blocks.block_kv, head_dim), dtype, transforms=transforms)) \
        + interpret_smem(interpret, num_wgs, head_dim, blocks.block_kv, dtype)   # () for the GPU kernel
    if return_lse:   # last: the kernel finds each consumer's log-sum-exp rows at scoped[0][-1]
        smem += (plgpu.SMEM((num_wgs, ROWS_PER_CONSUMER), jnp.float32),)
    barriers = (plgpu.Barrier(num_arrivals=1, num_barriers=num_wgs),             # q_ready
                plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),          # k_ready
                plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),          # v_ready
                plgpu.Barrier(num_arrivals=num_wgs, num_barriers=num_stages),    # k_consumed
                plgpu.Barrier(num_arrivals=num_wgs, num_barriers=num_stages),    # v_consumed
                plgpu.Barrier(num_arrivals=1, num_barriers=num_wgs))             # tokens
    if blocks.kv_multicast:   # k_peer_free, v_peer_free (the producers'), cluster_done (all warpgroups')
        cluster_barrier = functools.partial(plgpu.ClusterBarrier, collective_axes=(CLUSTER_AXIS,))
        barriers += (cluster_barrier(num_arrivals=1, num_barriers=num_stages),
                     cluster_barrier(num_arrivals=1, num_barriers=num_stages),
                     cluster_barrier(num_arrivals=num_wgs + 1, num_barriers=1))
    kernel = functools.partial(interpret_kernel if interpret else attention_kernel, causal=causal,
                               sm_scale=sm_scale, seq_len=seq_len, num_q_tiles=num_q_tiles, head_dim=head_dim,
                               blocks=blocks, dtype=dtype)
    masked = key_mask is not None
    bounded = masked and (KEY_MASK_CLEAN_BLOCKS if clean_blocks is None else bool(clean_blocks))
    # with a key mask: a ring slot of mask bytes per K/V slot, and its barriers (the kernel's docstring);
    # with clean-block bounds also a row of them per consumer, and their barriers
    mask_scoped = (plgpu.SMEM((num_stages * mask_slot_bytes(blocks.block_kv),), jnp.uint8),
                   plgpu.Barrier(num_arrivals=1, num_barriers=num_stages))
    if bounded:
        mask_scoped += (plgpu.SMEM((num_wgs * BOUNDS_ROW,), jnp.int32),
                        plgpu.Barrier(num_arrivals=1, num_barriers=num_wgs))
    mask_scoped = (mask_scoped,) if masked else ()
    num_mask_refs = int(masked) + int(bounded)

    def entry(q_ref, k_ref, v_ref, *refs):   # refs: (mask_ref, (bounds_ref,)) out_ref, (lse_ref,)
        mask_refs, (out_ref, *lse_ref) = refs[:num_mask_refs], refs[num_mask_refs:]
        mask_ref, bounds_ref = (tuple(mask_refs) + (None, None))[:2]
        pl.run_scoped(lambda *scoped: kernel(q_ref, k_ref, v_ref, out_ref, scoped,
                                             lse_ref=lse_ref[0] if lse_ref else None, mask_ref=mask_ref,
                                             bounds_ref=bounds_ref),
                      smem, barriers, *mask_scoped, collective_axes="wg")

    def fused_entry(qkv_ref, *refs):
        entry(SlotRef(qkv_ref, 0), SlotRef(qkv_ref, 1), SlotRef(qkv_ref, 2), *refs)

    # The interpreter drops a partly out-of-bounds TMA write: there arrays are whole query tiles long.
    array_len = num_q_tiles * blocks.block_q if interpret else padded_seq_len(seq_len)
    if array_len != seq_len:   # the padded keys are masked in the kernel (seq_len is the true S)
        operands = tuple(jnp.pad(x, ((0, 0), (0, array_len - seq_len)) + ((0, 0),) * (x.ndim - 2))
                         for x in operands)
    if masked:   # every KV block any tile loads, whole: keys past S are 0 (invalid) here too
        mask_len = pl.cdiv(seq_len, blocks.block_kv) * blocks.block_kv
        operands += (jnp.pad(key_mask.astype(jnp.uint8), ((0, 0), (0, mask_len - seq_len))),)
    if bounded:
        operands += (clean_block_bounds(key_mask, blocks.block_kv),)
    out_type = jax.ShapeDtypeStruct((batch, array_len, num_heads, head_dim), dtype)
    if return_lse:
        # Whole query tiles long, so every consumer's 64 rows are in bounds: with [B, H, S] the TMA stores
        # of rows past S landed in the next head's first rows on the H200.
        out_type = (out_type, jax.ShapeDtypeStruct((batch, num_heads, num_q_tiles * blocks.block_q), jnp.float32))
    # Row-major grid, the query tiles fastest: blocks launched together are tiles of one head and read
    # the same K/V from L2 (481 against 405 TFLOP/s for tiles-outermost at shape 14's call).
    cluster = {}
    if blocks.kv_multicast:   # the tile axis counts 2-block clusters (multicast_pair)
        grid = (batch, num_heads, pl.cdiv(num_q_tiles, 2))
        cluster = dict(cluster=(2,), cluster_names=(CLUSTER_AXIS,))
    else:
        grid = (batch, num_heads, num_q_tiles)
    out = plgpu.kernel(
        fused_entry if fused else entry,
        out_type=out_type,
        grid=grid,
        grid_names=(SEQUENCE_AXIS, HEAD_AXIS, Q_TILE_AXIS),
        num_threads=num_wgs + 1,
        thread_name="wg",
        compiler_params=_compiler_params(lowering_semantics), interpret=interpret_params(interpret),
        **cluster,
    )(*operands)
    if not return_lse:
        return out[:, :seq_len] if array_len != seq_len else out
    out, lse = out
    return (out[:, :seq_len] if array_len != seq_len else out), lse[:, :, :seq_len]


def _compiler_params(lowering_semantics: str):
    # Always passed: jax's default lowering changed from Lane (0.10) to Warpgroup (0.11).
    plgpu = plgpu_module()
    semantics = {"lane": plgpu.LoweringSemantics.Lane,
                 "warpgroup": plgpu.LoweringSemantics.Warpgroup}[lowering_semantics]
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics)


def flash_attention_mgpu_reference(q, k, v, *, causal: bool, sm_scale: float | None = None):
    """What `flash_attention_mgpu` computes, in plain jnp and fp32 (the shared `attention_reference`)."""
    return attention_reference(q, k, v, causal=causal, sm_scale=sm_scale)
