"""Flash attention forward pass as one generic (Triton-style) Pallas kernel.

On a GPU `pl.pallas_call` lowers this kernel through Triton; on a CPU it runs with `interpret=True`,
which is how CI checks it. Layout is `[B, S, H, head_dim]` (what a `[B, S, d]` projection reshapes to
for free); `flash_attention_fused_qkv` reads q, k and v straight out of a fused `[B, S, 3, H, head_dim]`
projection.

On a Hopper GPU (sm_90) `flash_attention` and `flash_attention_fused_qkv` hand mask-free fp16/bf16 calls
with head_dim 64, 128 or 256 and S >= `flash_attention_mgpu.MIN_SEQ_LEN` (fused-layout calls from the
shorter lengths of `FUSED_MIN_SEQ_LEN`; head_dim 32 from 8192, `UNFUSED_MIN_SEQ_LEN`; all in
`flash_attention_dispatch_min_seq_len`) to the Mosaic GPU kernel in
`flash_attention_mgpu.py` (wgmma, TMA, warp specialization), measured faster there; calls with a key mask
too where `KEY_MASK_DISPATCH` (its key-masked build), never calls with `kv_lengths`.
`implementation=` forces one kernel ("generic" or "mosaic"). Everything below describes the generic kernel.

Numerics (the dtype each stage uses):
- Both dots take fp16 operands for fp16 and fp32 inputs, bf16 operands for bf16 inputs, and accumulate
  in fp32. fp32 inputs are rounded to fp16 inside the kernel: fp16 keeps the same 10-bit mantissa as
  the TF32 that Triton would use for an fp32 dot, runs at twice the tensor-core rate, and rounds the
  operands the same way in interpret mode on a CPU as on the GPU (only the fp32 summation order differs),
  so CI pins the GPU's numerics. The cost is fp16's range: |q|, |k|, |v| must stay below 65504 (the
  scores themselves are fp32, the softmax scale applied after the dot).
- Softmax statistics (running max and sum) and the output accumulator are fp32 (online softmax); the
  output is cast to q's dtype once, at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ttj_jax.device import default_device_is_hopper
from ttj_jax.kernels.attention_common import attention_reference, check_causal_and_scale, check_qkv_layout, fused_qkv_view
from ttj_jax.kernels.flash_attention_mgpu import SUPPORTED_HEAD_DIMS as MOSAIC_HEAD_DIMS
from ttj_jax.kernels.flash_attention_mgpu import (
    dispatch_min_seq_len,
    flash_attention_mgpu,
    flash_attention_mgpu_fused_qkv,
)

__all__ = ["BlockSizes", "attention_reference", "check_causal_and_scale", "check_qkv_layout", "flash_attention",
           "flash_attention_fused_qkv", "use_mosaic_kernel"]

# A finite stand-in for -inf: exp2(_MASK_VALUE - m) is exactly 0 for any real score m, and unlike -inf
# it never makes `m_prev - m_next` a NaN (-inf - -inf) while a row has seen no allowed key yet.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256
# Triton's tensor-core dot needs every dimension >= 16, and every Triton tensor has power-of-two sizes.
_MIN_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int     # query rows per program (one program per (query block, batch, head))
    block_k: int     # keys per step of the inner loop
    num_warps: int   # Triton warps per program
    num_stages: int  # Triton software-pipelining depth of the key loop

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < _MIN_BLOCK or value & (value - 1):
                raise ValueError(f"BlockSizes.{name}={value!r} must be a power of two >= {_MIN_BLOCK}")
        if isinstance(self.num_warps, bool) or self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"BlockSizes.num_warps={self.num_warps!r} must be one of 1, 2, 4, 8, 16")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages!r} must be an int >= 1")


# Default block sizes, keyed by (padded head_dim, length bucket): "short" for S <= 256, "medium" for
# S <= 2048, "long" beyond (`seq_len_bucket`). Start points from Triton's Hopper flash-attention tutorial,
# checked on the H200 where measured (an earlier quick run of bench/bench_attention.py, fp16, causal): the
# short entries for head_dim 16 (8 padded), 32 and 256 and the long entry for 32 won against the variant
# tried; the long entry for 64 is the variant that won (346 against 325 TFLOP/s at S=16384). The short
# entry for 128 won in two runs (B=64, H=4, S=128: 74.3 and 68.2 TFLOP/s against 56.1 and 48.9 for 64x64 w4
# s2). The medium entry for 64: at bert-base's call (B=32, H=12, S=512, non-causal, fused qkv) on one H100
# (2026-12-07), 94.5 us mask-free and 117.1 us with a padded key mask, against the long entry's 111.6 and
# 146.9; the best masked tiling (64x64 w4 s2) took 114.4 and 100.8 mask-free (bench/flash_blocks.py). The
# other medium entries repeat the long ones, unmeasured at those lengths. Causal calls have their own
# entries where measured (_CAUSAL_BLOCK_SIZES). bench/flash_blocks.py sweeps tilings per call; update
# these tables from its JSON.
_SEQ_LEN_BUCKETS = ((256, "short"), (2048, "medium"))
_DEFAULT_BLOCK_SIZES: dict[tuple[int, str], BlockSizes] = {
    (16, "short"): BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2),
    (16, "medium"): BlockSizes(block_q=128, block_k=64, num_warps=4, num_stages=3),
    (16, "long"): BlockSizes(block_q=128, block_k=64, num_warps=4, num_stages=3),
    (32, "short"): BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2),
    (32, "medium"): BlockSizes(block_q=128, block_k=64, num_warps=4, num_stages=3),
    (32, "long"): BlockSizes(block_q=128, block_k=64, num_warps=4, num_stages=3),
    (64, "short"): BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2),
    (64, "medium"): BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3),
    (64, "long"): BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=3),
    (128, "short"): BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=2),
    (128, "medium"): BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3),
    (128, "long"): BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3),
    (256, "short"): BlockSizes(block_q=64, block_k=32, num_warps=4, num_stages=2),
    (256, "medium"): BlockSizes(block_q=64, block_k=64, num_warps=8, num_stages=2),
    (256, "long"): BlockSizes(block_q=64, block_k=64, num_warps=8, num_stages=2),
}


# Causal calls, where they differ from _DEFAULT_BLOCK_SIZES: a causal call skips the blocks above the
# diagonal, so the smaller tiles waste less on the diagonal's half-empty blocks. At 256 < S <= 2048 on one
# H100 (2026-12-07, bench/results/flash-blocks-2026-12-07-h100*.json) 64x64 blocks, 4 warps, 2 stages were
# the fastest of 6-7 tilings at every causal call tried: head_dim 64, S=512: 37.4 against the medium
# entry's 40.7 us (51.8 against 54.2 with a padded key mask); head_dim 32, S=1024, padded: 76.6 against
# 86.1; head_dim 64, S=2048: 135.7 against 136.9 (157.0 against 174.3 padded). Other head_dims unmeasured.
_CAUSAL_BLOCK_SIZES: dict[tuple[int, str], BlockSizes] = {
    (32, "medium"): BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2),
    (64, "medium"): BlockSizes(block_q=64, block_k=64, num_warps=4, num_stages=2),
}


# Whether a sequence that is not a multiple of the blocks runs without the padded copy of q, k, v (and of the
# key mask) and the sliced copy of the output: the last blocks overhang the arrays, read under masks (zeros
# past S) and stored under masks (power-of-two head_dims only; others still pad both dims). At clip-text-s77
# (B=64, S=77, 64-row blocks) on one H100 the pad and the slice took 17 and 4 us per layer beside the
# kernel's 15 (bench/results/infer-kernels-2026-12-07-h100.json). Checked in interpret mode, which fills
# what overhangs an array with NaN, and on one H100 (`python bench/bench_attention.py --ragged`,
# attention-ragged-2026-12-07-h100.json): outputs equal to the padded call's at six shapes, each call
# faster with its copies gone (S=77: 50.4 -> 39.4 us; S=197: 129.1 -> 63.3; S=1000: 141.0 -> 105.0).
# Through the harness with the measured planner (general-2026-12-07-h100-unpadded-{on,off}.json):
# peer/ttj 0.83 -> 0.95 at clip-text-s77, 0.94 -> 1.07 at vit-s197.
UNPADDED_SEQUENCE = True


def seq_len_bucket(seq_len: int) -> str:
    """The default table's length bucket of a call: "short", "medium" or "long"."""
    return next((name for limit, name in _SEQ_LEN_BUCKETS if seq_len <= limit), "long")


def padded_head_dim(head_dim: int) -> int:
    """The head_dim the kernel runs at: the next power of two, at least 16 (zero padding is exact)."""
    return max(_MIN_BLOCK, pl.next_power_of_2(head_dim))


def default_block_sizes(seq_len: int, head_dim: int, causal: bool = False) -> BlockSizes:
    """The table's tiling for a call (a causal call's own entry where it has one)."""
    key = (padded_head_dim(head_dim), seq_len_bucket(seq_len))
    return (_CAUSAL_BLOCK_SIZES.get(key) if causal else None) or _DEFAULT_BLOCK_SIZES[key]


def resolve_block_sizes(seq_len: int, head_dim: int, block_sizes: BlockSizes | None,
                        causal: bool = False) -> BlockSizes:
    """The block sizes a call runs with: the given or default ones, blocks clamped for a tiny S."""
    chosen = default_block_sizes(seq_len, head_dim, causal) if block_sizes is None else block_sizes
    longest_useful = max(_MIN_BLOCK, pl.next_power_of_2(seq_len))
    return dataclasses.replace(chosen, block_q=min(chosen.block_q, longest_useful),
                               block_k=min(chosen.block_k, longest_useful))


def _flash_attention_kernel(q_ref, k_ref, v_ref, kv_lengths_ref, key_mask_ref, o_ref, lse_ref=None, *,
                            causal: bool, sm_scale: float, block_q: int, block_k: int,
                            num_q_blocks: int, static_key_limit: int | None, dot_dtype,
                            ragged_len: int | None = None):
    # Refs: q (block_q, hd), k and v (S_pad, hd) for this (batch, head), kv_lengths (1,) int32 or None,
    # key_mask (S_pad,) int8 or None, o (block_q, hd), lse (block_q,) fp32 or None (return_lse).
    # ragged_len: the arrays hold only S = ragged_len < S_pad rows (no padded copy): the blocks that
    # overhang their end are read under masks (zeros past S) and the output rows past S never stored.
    q_block = pl.program_id(0)
    if causal:
        # Heaviest query blocks (most keys under the diagonal) first, so the light ones fill the tail.
        q_block = num_q_blocks - 1 - q_block
    q_start = q_block * block_q
    num_keys = k_ref.shape[0]

    # Keys at positions >= key_limit are excluded: the per-sequence length (already clamped to S by
    # the wrapper), else S itself when the sequence was padded to a block multiple.
    key_limit = kv_lengths_ref[0] if kv_lengths_ref is not None else static_key_limit

    # Fold the softmax scale and log2(e) into one multiply so the kernel can use exp2.
    score_scale = sm_scale * _LOG2_E
    if ragged_len is None:
        q = q_ref[...].astype(dot_dtype)
    else:
        q_rows = (q_start + jnp.arange(block_q, dtype=jnp.int32)) < ragged_len
        q = pltriton.load(q_ref, mask=q_rows[:, None], other=0).astype(dot_dtype)

    def load_keys(ref, key_start, ragged: bool):
        # (block_k, ...) rows of a per-key ref from key_start; under a mask where they may pass S
        if not ragged:
            return ref[pl.ds(key_start, block_k)]
        key_rows = (key_start + jnp.arange(block_k, dtype=jnp.int32)) < ragged_len
        block = ref.at[pl.ds(key_start, block_k)]
        return pltriton.load(block, mask=key_rows.reshape((block_k,) + (1,) * (len(block.shape) - 1)), other=0)

    def step(key_block, carry, *, mask_causal_and_limit: bool):
        o, m_prev, l_prev = carry
        key_start = pl.multiple_of(key_block * block_k, block_k)
        # only the masked steps can reach the block that overhangs S (its limit, S, makes them masked)
        ragged = ragged_len is not None and mask_causal_and_limit
        k = load_keys(k_ref, key_start, ragged).astype(dot_dtype)
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * score_scale  # (block_q, block_k)

        allowed = None
        if key_mask_ref is not None:
            allowed = (load_keys(key_mask_ref, key_start, ragged) != 0)[None, :]
        if mask_causal_and_limit:
            key_pos = key_start + jnp.arange(block_k, dtype=jnp.int32)
            if causal:
                query_pos = q_start + jnp.arange(block_q, dtype=jnp.int32)
                below_diagonal = query_pos[:, None] >= key_pos[None, :]
                allowed = below_diagonal if allowed is None else allowed & below_diagonal
            if key_limit is not None:
                in_length = (key_pos < key_limit)[None, :]
                allowed = in_length if allowed is None else allowed & in_length
        if allowed is not None:
            scores = jnp.where(allowed, scores, _MASK_VALUE)

        # Online softmax (FlashAttention-2): rescale what was accumulated under the old running max.
        m_next = jnp.maximum(m_prev, scores.max(axis=1))
        correction = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(scores - m_next[:, None])
        l_next = l_prev * correction + p.sum(axis=1)
        v = load_keys(v_ref, key_start, ragged).astype(dot_dtype)
        o = o * correction[:, None] + lax.dot_general(
            p.astype(dot_dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return o, m_next, l_next

    # Split the key loop in two. Blocks in [0, num_unmasked) lie entirely below the causal diagonal and
    # entirely inside key_limit, so they skip the elementwise causal/length mask (iota, compare, select
    # on block_q * block_k scores). Blocks in [num_unmasked, num_blocks) straddle the diagonal or the
    # limit and take the mask. Blocks from num_blocks on are wholly above the diagonal or past the limit
    # and are never visited: under causal attention a query block does about half the work.
    if causal:
        visible_end, unmasked_end = q_start + block_q, q_start
    else:
        visible_end, unmasked_end = num_keys, num_keys
    if key_limit is not None:
        visible_end = _int_min(visible_end, key_limit)
        unmasked_end = _int_min(unmasked_end, key_limit)
    num_blocks = _int_div(visible_end + block_k - 1, block_k)
    num_unmasked = _int_div(unmasked_end, block_k)

    carry = (jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32),  # output accumulator
             jnp.full((block_q,), _MASK_VALUE, jnp.float32),       # running max of scores (log2 units)
             jnp.zeros((block_q,), jnp.float32))                   # running sum of exp2(score - max)
    carry = _fori_loop(0, num_unmasked, functools.partial(step, mask_causal_and_limit=False), carry)
    if causal or key_limit is not None:
        carry = _fori_loop(num_unmasked, num_blocks, functools.partial(step, mask_causal_and_limit=True), carry)
    o, m, l = carry

    may_see_no_key = key_limit is not None or key_mask_ref is not None
    if may_see_no_key:
        # A row that never saw an allowed key still has m == _MASK_VALUE (its masked scores each
        # added exp2(0) = 1 to l): it must come out as zeros, not as a mean of v or 0/0.
        saw_a_key = m > _MASK_VALUE
        o = jnp.where(saw_a_key[:, None], o / jnp.where(saw_a_key, l, 1.0)[:, None], 0.0)
    else:
        o = o / l[:, None]
    if ragged_len is None:
        o_ref[...] = o.astype(o_ref.dtype)
    else:
        pltriton.store(o_ref, o.astype(o_ref.dtype), mask=q_rows[:, None])
    if lse_ref is not None:
        # log(sum_j exp(sm_scale q.k_j)) in natural units: m and l count in log2 units (the exp2 above)
        lse = (m + jnp.log2(l)) * _LN_2
        lse = jnp.where(saw_a_key, lse, -jnp.inf) if may_see_no_key else lse
        if ragged_len is None:
            lse_ref[...] = lse
        else:
            pltriton.store(lse_ref, lse, mask=q_rows)


def _fori_loop(lower, upper, body, carry):
    # Loop bounds stay Python ints when they are static; skip a statically empty loop outright.
    if isinstance(lower, int) and isinstance(upper, int) and lower >= upper:
        return carry
    return lax.fori_loop(lower, upper, body, carry)


def _int_min(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return jnp.minimum(a, b)


def _int_div(numerator, denominator: int):
    # lax.div truncates, which equals floor division for the non-negative values here; it lowers to one
    # Triton divide, where `//` on a traced program id adds sign fix-ups (and jax's own kernel avoids it).
    if isinstance(numerator, int):
        return numerator // denominator
    return lax.div(numerator, jnp.int32(denominator))


def _check_dtype_and_head_dim(name: str, x: jax.Array):
    if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype={jnp.dtype(x.dtype)} must be float16, bfloat16 or float32")
    head_dim = x.shape[-1]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name}.shape={x.shape}: head_dim={head_dim} must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if any(size < 1 for size in x.shape):
        raise ValueError(f"{name}.shape={x.shape} must have no empty dimension")


def _check_qkv(q, k, v):
    check_qkv_layout(q, k, v)
    _check_dtype_and_head_dim("q", q)


def _check_masks(kv_lengths, key_mask, batch: int, seq_len: int):
    if kv_lengths is not None:
        if kv_lengths.shape != (batch,) or not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
            raise ValueError(f"kv_lengths.shape={kv_lengths.shape}, kv_lengths.dtype={kv_lengths.dtype}: "
                             f"must be integer [batch]=({batch},)")
    if key_mask is not None:
        if key_mask.shape != (batch, seq_len) or key_mask.dtype != jnp.bool_:
            raise ValueError(f"key_mask.shape={key_mask.shape}, key_mask.dtype={key_mask.dtype}: "
                             f"must be bool [batch, seq_len]=({batch}, {seq_len})")


def _check_statics(causal, sm_scale, block_sizes):
    check_causal_and_scale(causal, sm_scale)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes={block_sizes!r} must be a BlockSizes or None")


IMPLEMENTATIONS = ("auto", "generic", "mosaic")


@functools.cache
def on_hopper() -> bool:
    """Whether jax's default backend is a CUDA GPU of compute capability 9.x, as planning sees it
    (TTJ_FORCE_DEVICE included; read once per process)."""
    return default_device_is_hopper()


# Whether "auto" sends key-masked calls to the Mosaic kernel as it does mask-free ones. On one H100
# (2026-12-06, `python3 bench/bench_attention_mgpu.py --key_mask` and `--key_mask_timing`) the key-masked
# build passed every check and ran 1.14x (B=64, S=1024) to 1.66x (S=100000) the generic kernel with the same
# mask, 0.75-0.85x its own mask-free build.
KEY_MASK_DISPATCH = True


def use_mosaic_kernel(dtype, seq_len: int, head_dim: int, *, masked: bool, block_sizes, interpret: bool,
                      implementation: str = "auto", fused: bool = False, key_mask: bool = False) -> bool:
    """The dispatch rule between the two kernels (module docstring); raises when `implementation`
    forces the Mosaic kernel onto a call it cannot take. masked: the call has kv_lengths (the Mosaic
    kernel has none); key_mask: it has a key mask (the Mosaic kernel's key-masked build, sent to by
    "auto" only where KEY_MASK_DISPATCH)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r} must be one of {IMPLEMENTATIONS}")
    if implementation == "generic":
        return False
    applicable = (not masked and block_sizes is None and not interpret
                  and jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
                  and head_dim in MOSAIC_HEAD_DIMS)
    if implementation == "mosaic":
        if not applicable:
            raise ValueError("implementation='mosaic' needs float16/bfloat16 q, k, v, head_dim in "
                             f"{MOSAIC_HEAD_DIMS}, no kv_lengths, no BlockSizes and no "
                             f"interpret mode; got dtype={jnp.dtype(dtype)}, head_dim={head_dim}, "
                             f"kv_lengths={masked}, block_sizes={block_sizes}, interpret={interpret}")
        return True
    return (applicable and (KEY_MASK_DISPATCH or not key_mask)
            and seq_len >= dispatch_min_seq_len(head_dim, fused) and on_hopper())


def pad_seq_and_head_dim(x: jax.Array, seq_pad: int, head_dim_pad: int) -> jax.Array:
    if not (seq_pad or head_dim_pad):
        return x
    widths = [(0, 0)] * x.ndim
    widths[1], widths[-1] = (0, seq_pad), (0, head_dim_pad)
    return jnp.pad(x, widths)


def _attention_pallas_call(q_src, k_src, v_src, kv_lengths, key_mask, *, fused: bool, causal: bool,
                           sm_scale, block_sizes, interpret: bool, return_lse: bool = False):
    """Pads to block multiples, runs the kernel, slices back. return_lse: also the rows' log-sum-exp
    [B, H, S] fp32 (see flash_attention).

    Separate layout: q_src, k_src, v_src are each [B, S, H, hd]. Fused layout: all three are the same
    [B, S, 3, H, hd] array and the BlockSpecs pick slot 0, 1 or 2, so nothing is sliced out in HBM.
    """
    batch, seq_len = q_src.shape[:2]
    num_heads, head_dim = q_src.shape[-2:]
    sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    blocks = resolve_block_sizes(seq_len, head_dim, block_sizes, causal)
    block_q, block_k = blocks.block_q, blocks.block_k

    # Both blocks are powers of two, so a multiple of the larger one is a multiple of both. These pads
    # are the only copies the wrapper makes; shapes that need neither read the inputs in place. With
    # UNPADDED_SEQUENCE and a power-of-two head_dim, a sequence that is not a block multiple is not
    # copied either: the kernel's last blocks overhang the arrays and are read and written under masks.
    seq_pad = -seq_len % max(block_q, block_k)
    head_dim_pad = padded_head_dim(head_dim) - head_dim
    padded_len, padded_hd = seq_len + seq_pad, head_dim + head_dim_pad
    ragged = bool(seq_pad) and not head_dim_pad and UNPADDED_SEQUENCE
    copied_pad = 0 if ragged else seq_pad
    if fused:
        q_src = k_src = v_src = pad_seq_and_head_dim(q_src, copied_pad, head_dim_pad)
    else:
        q_src, k_src, v_src = (pad_seq_and_head_dim(x, copied_pad, head_dim_pad) for x in (q_src, k_src, v_src))

    num_q_blocks = padded_len // block_q
    if causal:
        q_block_index = lambda i: num_q_blocks - 1 - i  # same reversal as in the kernel
    else:
        q_block_index = lambda i: i

    def seq_spec(block_len, block_index, slot):
        # Grid is (query block i, batch b, head h); `None` squeezes a dimension out of the kernel's ref.
        if fused:
            return pl.BlockSpec((None, block_len, None, None, padded_hd),
                                lambda i, b, h: (b, block_index(i), slot, h, 0))
        return pl.BlockSpec((None, block_len, None, padded_hd), lambda i, b, h: (b, block_index(i), h, 0))

    whole_sequence = lambda i: 0
    in_specs = [seq_spec(block_q, q_block_index, 0),
                seq_spec(padded_len, whole_sequence, 1),
                seq_spec(padded_len, whole_sequence, 2)]

    static_key_limit = seq_len if seq_pad else None
    if kv_lengths is not None:
        kv_lengths = jnp.clip(kv_lengths.astype(jnp.int32), 0, seq_len).reshape(batch, 1)
        in_specs.append(pl.BlockSpec((None, 1), lambda i, b, h: (b, 0)))
    else:
        in_specs.append(None)
    if key_mask is not None:
        # int8 rather than bool (Triton's i1 memory type is awkward): the bool mask's own bytes, which the
        # bridge's launch of a program's kernels reads in place (bridge/triton_launch.py), padded only
        # where the sequence is.
        key_mask = key_mask.astype(jnp.int8)
        if copied_pad:
            key_mask = jnp.pad(key_mask, ((0, 0), (0, copied_pad)))
        in_specs.append(pl.BlockSpec((None, padded_len), lambda i, b, h: (b, 0)))
    else:
        in_specs.append(None)

    dtype = jnp.dtype(q_src.dtype)
    kernel = functools.partial(
        _flash_attention_kernel, causal=causal, sm_scale=sm_scale, block_q=block_q, block_k=block_k,
        num_q_blocks=num_q_blocks, static_key_limit=static_key_limit,
        dot_dtype=jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float16, ragged_len=seq_len if ragged else None)
    out_len = seq_len + copied_pad
    out_spec = pl.BlockSpec((None, block_q, None, padded_hd), lambda i, b, h: (b, q_block_index(i), h, 0))
    out_shape = jax.ShapeDtypeStruct((batch, out_len, num_heads, padded_hd), dtype)
    if return_lse:
        out_spec = (out_spec, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, q_block_index(i))))
        out_shape = (out_shape, jax.ShapeDtypeStruct((batch, num_heads, out_len), jnp.float32))
    out = pl.pallas_call(
        kernel,
        grid=(num_q_blocks, batch, num_heads),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="ttj_flash_attention",
    )(q_src, k_src, v_src, kv_lengths, key_mask)
    out, lse = out if return_lse else (out, None)
    if copied_pad or head_dim_pad:
        out = out[:, :seq_len, :, :head_dim]
    if return_lse:
        return out, lse[:, :, :seq_len]
    return out


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "interpret", "implementation",
                                             "return_lse"))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                    kv_lengths: jax.Array | None = None, key_mask: jax.Array | None = None,
                    sm_scale: float | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool = False, implementation: str = "auto", return_lse: bool = False):
    """Softmax attention `softmax(q k^T * sm_scale) v` per (batch, head), fused in one kernel.

    Args:
      q, k, v: [B, S, H, head_dim], one dtype among float16, bfloat16, float32; 8 <= head_dim <= 256.
        Any S >= 1 (padded internally to a block multiple) and any head_dim in range (padded to a
        power of two >= 16; zero padding is exact).
      causal: key j is excluded for query i when j > i.
      kv_lengths: optional integer [B]; keys at positions >= kv_lengths[b] are excluded.
      key_mask: optional bool [B, S]; keys with key_mask[b, j] == False are excluded. May be combined
        with kv_lengths.
      sm_scale: Python float, default head_dim ** -0.5.
      block_sizes: BlockSizes or None for the per-shape default; blocks are clamped for a tiny S.
      interpret: run the kernel in Pallas interpret mode (CPU).
      implementation: "auto" (the Hopper kernel where the module docstring's rule sends a call, else
        the generic one), "generic", or "mosaic" (raises where the Hopper kernel does not apply).
      return_lse: also return each row's log-sum-exp, log(sum_j exp(sm_scale q.k_j)) over its allowed
        keys, [B, H, S] fp32 (-inf for a query with no allowed key): what merging attention over
        several key sets needs (ring_attention.py). Both kernels (the Hopper one from its running max
        and sum).

    Returns:
      [B, S, H, head_dim] in q's dtype (and the log-sum-exp with return_lse). A query with no allowed
      key gets zeros. See the module
      docstring for the dtype of each stage. Copies: none when S is a multiple of the larger block and
      head_dim a power of two >= 16; otherwise one padded copy of q, k and v, and one of the output.
    """
    _check_statics(causal, sm_scale, block_sizes)
    _check_qkv(q, k, v)
    _check_masks(kv_lengths, key_mask, q.shape[0], q.shape[1])
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse={return_lse!r} must be a bool")
    if use_mosaic_kernel(
            q.dtype, q.shape[1], q.shape[-1], masked=kv_lengths is not None, key_mask=key_mask is not None,
            block_sizes=block_sizes, interpret=interpret, implementation=implementation):
        return flash_attention_mgpu(q, k, v, causal=causal, sm_scale=sm_scale, return_lse=return_lse,
                                    key_mask=key_mask)
    return _attention_pallas_call(q, k, v, kv_lengths, key_mask, fused=False, causal=causal,
                                  sm_scale=sm_scale, block_sizes=block_sizes, interpret=interpret,
                                  return_lse=return_lse)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "interpret", "implementation",
                                             "return_lse"))
def flash_attention_fused_qkv(qkv: jax.Array, *, causal: bool, kv_lengths: jax.Array | None = None,
                              key_mask: jax.Array | None = None, sm_scale: float | None = None,
                              block_sizes: BlockSizes | None = None, interpret: bool = False,
                              implementation: str = "auto", return_lse: bool = False):
    """`flash_attention` on q, k, v read straight out of one fused projection.

    Args:
      qkv: [B, S, 3, H, head_dim], the free reshape of a `[B, S, 3 * d]` output of `x @ W_qkv` whose
        columns are ordered (q | k | v), each head-major. The kernel's BlockSpecs index slot 0, 1, 2 in
        place, so this layout costs no copy (except the padding copy described in `flash_attention`,
        made once for the whole qkv array). A `[3, B, S, H, hd]` or `[B, S, H, 3, hd]` layout would need
        a transpose first; give those to `flash_attention` as three arrays instead. The Hopper kernel
        (where the dispatch rule picks it: from the lengths of flash_attention_mgpu.FUSED_MIN_SEQ_LEN,
        shorter than `flash_attention`'s) reads this layout in place too (`flash_attention_mgpu_fused_qkv`).
      return_lse: also return the rows' log-sum-exp, as `flash_attention` does (either kernel).
      Other arguments: as in `flash_attention`.

    Returns:
      [B, S, H, head_dim] in qkv's dtype (and the log-sum-exp with return_lse).
    """
    _check_statics(causal, sm_scale, block_sizes)
    fused_qkv_view(qkv)
    _check_dtype_and_head_dim("qkv", qkv)
    _check_masks(kv_lengths, key_mask, qkv.shape[0], qkv.shape[1])
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse={return_lse!r} must be a bool")
    if use_mosaic_kernel(qkv.dtype, qkv.shape[1], qkv.shape[-1], masked=kv_lengths is not None,
                         key_mask=key_mask is not None, block_sizes=block_sizes,
                         interpret=interpret, implementation=implementation, fused=True):
        return flash_attention_mgpu_fused_qkv(qkv, causal=causal, sm_scale=sm_scale, key_mask=key_mask,
                                              return_lse=return_lse)
    return _attention_pallas_call(qkv, qkv, qkv, kv_lengths, key_mask, fused=True, causal=causal,
                                  sm_scale=sm_scale, block_sizes=block_sizes, interpret=interpret,
                                  return_lse=return_lse)
