"""The Mosaic GPU whole-stack kernel's limits, block layout and weights (`fused_stack_mgpu.py` says what the
kernel does). Pure shape logic and the jitted weight builder; nothing here needs a GPU.

Column blocks: every weight chunk, k and v in shared memory and every projection's wgmma works in
blocks of `width` columns. 1, 2 or 4 heads: one block per head, head_dim zero-padded to MIN_BLOCK when
smaller (padded q/k columns add 0 to every score, padded v columns meet zero rows of the out-projection,
padded MLP columns get GELU(0) = 0 against zero rows of W2). 8 or 16 heads at d_model 128: packed 2 or
4 to a PACKED_BLOCK-column block, exactly the 4-head model's layout; only the attention differs.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ttj_jax.kernels.pallas_common import GEMM_DTYPE, checked_prepared
from ttj_jax.params import PreparedWeights

D_MODEL = 128                        # the default width (shapes 1-6, 9, 10, 12)
SUPPORTED_D_MODELS = (32, 128)       # d_model = ffn_dim; 32 is shape 7's (see MIN_BLOCK)
SUPPORTED_NUM_HEADS = (1, 2, 4)      # at every supported d_model: one head per block
PACKED_NUM_HEADS = (8, 16)           # at D_MODEL only: heads packed several to a block (see `blocks`)
# Narrower blocks are zero-padded to this: wgmma's fp16 contraction depth (32-byte swizzle).
MIN_BLOCK = 16
# Packed heads (8 or 16 at d_model 128) sit in blocks of this width: the 4-head model's layout.
PACKED_BLOCK = 32
SUPPORTED_SEQ_LENS = (32, 64, 128)
TILE_ROWS = 128              # rows per CUDA block
WG_ROWS = 64                 # rows per consumer warpgroup (wgmma M)
NUM_CONSUMERS = 2
NUM_SLOTS = 2                # weight chunks in flight (ring); a third does not fit in shared memory
CHUNKS_PER_LAYER = 6         # Wq, Wk, Wv, Wout^T, W1, W2^T
NUM_VECS = 10                # vecs rows per layer, in this order:
LN1_W, LN1_B, BQ, BK, BV, BOUT, LN2_W, LN2_B, B1, B2 = range(NUM_VECS)
SMEM_BUDGET_BYTES = 227 * 1024 - 2 * 1024
# S = 128 causal grids up to this many tiles split the key blocks (and use the fast erf); larger grids
# score all keys: on the H200 the split build was faster up to 64 tiles and slower at 128.
SPLIT_MAX_TILES = 64


def model_error(d_model: int, num_heads: int, ffn_dim: int) -> str | None:
    """Why the kernel cannot run a model of these widths, or None."""
    if d_model not in SUPPORTED_D_MODELS:
        return f"d_model={d_model} must be one of {SUPPORTED_D_MODELS}"
    if ffn_dim != d_model:
        return f"ffn_dim={ffn_dim} must equal d_model={d_model} (the MLP runs in the head blocks' width)"
    if num_heads in PACKED_NUM_HEADS and d_model != D_MODEL:
        return (f"num_heads={num_heads} must be one of {SUPPORTED_NUM_HEADS} at d_model={d_model} "
                f"({PACKED_NUM_HEADS} heads are packed into {PACKED_BLOCK}-column blocks at d_model={D_MODEL} only)")
    if num_heads not in SUPPORTED_NUM_HEADS + PACKED_NUM_HEADS:
        return (f"num_heads={num_heads} must be one of {SUPPORTED_NUM_HEADS} (or {PACKED_NUM_HEADS}, packed, "
                f"at d_model={D_MODEL})")
    if (d_model // num_heads) % 8:
        return f"head_dim={d_model // num_heads} must be a multiple of 8"
    return None


def blocks(d_model: int, num_heads: int) -> tuple[int, int]:
    """(num_blocks, heads_per_block): how the heads sit in the kernel's column blocks. 1, 2 or 4 heads:
    one block per head. 8 or 16 heads at d_model 128: PACKED_BLOCK-column blocks of 2 or 4 whole heads,
    block b = columns 32 b .. 32 b + 31, the 4-head model's layout."""
    if num_heads in SUPPORTED_NUM_HEADS:
        return num_heads, 1
    heads_per_block = PACKED_BLOCK // (d_model // num_heads)
    return num_heads // heads_per_block, heads_per_block


def widths(d_model: int, num_heads: int) -> tuple[int, int, int]:
    """(head_dim, the block width in the weights and shared memory, the vectors' row length). Per-block
    biases sit at block * width in the vectors (so packed heads' biases are the unpadded vector)."""
    head_dim = d_model // num_heads
    num_blocks, heads_per_block = blocks(d_model, num_heads)
    width = max(head_dim * heads_per_block, MIN_BLOCK)
    return head_dim, width, max(d_model, num_blocks * width)


def weight_shapes(num_layers: int, d_model: int, num_heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of MgpuStackWeights' mats (fp16) and vecs (fp32), as `stack_weights_mgpu` builds them:
    [L, 6, num_blocks, d, width] and [L + 1, 10, vec_len]."""
    _, width, vec_len = widths(d_model, num_heads)
    num_blocks, _ = blocks(d_model, num_heads)
    return ((num_layers, CHUNKS_PER_LAYER, num_blocks, d_model, width),
            (num_layers + 1, NUM_VECS, vec_len))


def smem_bytes(num_layers: int, num_slots: int = NUM_SLOTS, *, d_model: int = D_MODEL, num_heads: int = 4,
               masked: bool = False) -> int:
    """Shared memory of one block: residual, k, v, weight ring, vectors, barriers (and, masked, the
    tile's token mask, one byte a row, and its barrier)."""
    _, width, vec_len = widths(d_model, num_heads)
    num_blocks, _ = blocks(d_model, num_heads)
    chunk = num_blocks * d_model * width * 2
    kv = 2 * num_blocks * TILE_ROWS * width * 2
    return (TILE_ROWS * d_model * 4 + kv + num_slots * chunk
            + (num_layers + 1) * NUM_VECS * vec_len * 4 + 8 * (2 + 1 + 2 * num_slots + 2)
            + (TILE_ROWS + 8 if masked else 0))


def supports(config: Any, seq_len: int, masked: bool = False) -> bool:
    """Whether this kernel runs the model (anything with d_model, num_heads, ffn_dim and, if it has
    one, num_layers) at seq_len; masked: in its masked build (a token mask in shared memory too)."""
    num_layers = getattr(config, "num_layers", 1)
    return (seq_len in SUPPORTED_SEQ_LENS
            and model_error(config.d_model, config.num_heads, config.ffn_dim) is None
            and smem_bytes(num_layers, d_model=config.d_model, num_heads=config.num_heads,
                           masked=masked) <= SMEM_BUDGET_BYTES)


def tile_count(batch: int, seq_len: int) -> int:
    """CUDA blocks of TILE_ROWS rows for `batch` sequences (128 // seq_len whole sequences per tile)."""
    return -(-batch // (TILE_ROWS // seq_len))


def key_blocks(seq_len: int, causal: bool, tiles: int) -> str:
    """Which keys each consumer scores. "own": S < 128, its 64 rows hold 64 // S whole sequences, so it
    scores only its own 64 keys (the other consumer's are all masked). "split" (S = 128, causal, up to
    SPLIT_MAX_TILES tiles): keys in two 64-row blocks, consumer 0 scores block 0 only (block 1 is all in
    its future), consumer 1 both. "all": every query row scores all 128 keys, masked where not allowed.
    k and v sit in shared memory as [N, 2, 64, w] for "own" and "split", [N, 128, w] for "all"."""
    if seq_len < TILE_ROWS:
        return "own"
    return "split" if causal and tiles <= SPLIT_MAX_TILES else "all"


def default_fast_erf(batch: int, seq_len: int, causal: bool) -> bool:
    """Whether the kernel's GELU takes the fast erf: exactly where the key blocks are split."""
    return key_blocks(seq_len, causal, tile_count(batch, seq_len)) == "split"


@jax.tree_util.register_pytree_node_class
class MgpuStackWeights:
    """mats [L, 6, N, d, w] fp16 and vecs [L + 1, 10, max(d, N w)] fp32 with (N, w) the blocks and their
    width (`blocks`, `widths`). Chunks in the order the kernel uses them: Wq, Wk, Wv (per block,
    [in, out]), Wout^T (per block, [out, in]), W1 (column blocks, [in, out]), W2^T (row blocks,
    [out, in]); vecs' last entry is the final LayerNorm. num_heads is the model's real head count
    (head_dim, the attention's sub-heads); num_blocks is mats' chunk dimension."""

    def __init__(self, mats, vecs, *, num_heads: int):
        self.mats, self.vecs, self.num_heads = mats, vecs, num_heads

    def tree_flatten(self):
        return (self.mats, self.vecs), self.num_heads

    @classmethod
    def tree_unflatten(cls, num_heads, children):
        return cls(*children, num_heads=num_heads)

    @property
    def num_layers(self) -> int:
        return self.mats.shape[0]

    @property
    def d_model(self) -> int:
        return self.mats.shape[3]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def num_blocks(self) -> int:
        return self.mats.shape[2]


def stack_weights_mgpu(prepared: PreparedWeights | dict, num_heads: int) -> MgpuStackWeights:
    """MgpuStackWeights from PreparedWeights (mixed_fp16) or raw params; once, outside the hot path."""
    prepared, _, _ = checked_prepared(prepared, num_heads, model_error)
    return _build_weights(prepared, num_heads)


@functools.partial(jax.jit, static_argnums=(1,))
def _build_weights(prepared: PreparedWeights, num_heads: int) -> MgpuStackWeights:
    d_model = prepared.layers[0]["ffn_in_weight"].shape[0]
    _, width, vec_len = widths(d_model, num_heads)
    # N blocks of `cols` real columns each: one head each, or heads_per_block packed heads.
    num_blocks, _ = blocks(d_model, num_heads)
    cols = d_model // num_blocks

    def pad_last(a, size):
        return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, size - a.shape[-1])]) if a.shape[-1] < size else a

    def column_blocks(w):   # [in, out] -> [N, in, width]: block b = w[:, b*cols:(b+1)*cols], zero-padded
        return pad_last(jnp.asarray(w).reshape(w.shape[0], num_blocks, cols).transpose(1, 0, 2), width)

    def row_blocks_t(w):    # [in, out] -> [N, out, width]: block b = w[b*cols:(b+1)*cols, :]^T, zero-padded
        return pad_last(jnp.asarray(w).reshape(num_blocks, cols, w.shape[1]).transpose(0, 2, 1), width)

    def per_head(b):        # [N cols] -> [vec_len]: block b at b * width, zeros after it
        return pad_last(pad_last(jnp.asarray(b).reshape(num_blocks, cols), width).reshape(-1), vec_len)

    def whole(v):           # [d] -> [vec_len]
        return pad_last(jnp.asarray(v), vec_len)

    mats, vecs = [], []
    for layer in prepared.layers:
        qkv = jnp.asarray(layer["qkv_weight"])
        bias = jnp.asarray(layer["qkv_bias"])
        mats.append(jnp.stack([
            column_blocks(qkv[:, :d_model]), column_blocks(qkv[:, d_model:2 * d_model]),
            column_blocks(qkv[:, 2 * d_model:]), row_blocks_t(layer["out_weight"]),
            column_blocks(layer["ffn_in_weight"]), row_blocks_t(layer["ffn_out_weight"])]).astype(GEMM_DTYPE))
        vecs.append(jnp.stack([
            whole(layer["norm1_weight"]), whole(layer["norm1_bias"]), per_head(bias[:d_model]),
            per_head(bias[d_model:2 * d_model]), per_head(bias[2 * d_model:]), whole(layer["out_bias"]),
            whole(layer["norm2_weight"]), whole(layer["norm2_bias"]), per_head(layer["ffn_in_bias"]),
            whole(layer["ffn_out_bias"])]).astype(jnp.float32))
    final = jnp.zeros((NUM_VECS, vec_len), jnp.float32)
    final = final.at[0].set(whole(prepared.final_norm["weight"])).at[1].set(whole(prepared.final_norm["bias"]))
    return MgpuStackWeights(jnp.stack(mats), jnp.stack(vecs + [final]), num_heads=num_heads)
