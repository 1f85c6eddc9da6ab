"""`emulate`: the Mosaic GPU whole-stack kernel's algorithm in NumPy, with its rounding points and
accumulation orders (tests compare the kernel in interpret mode, and the fp32 reference, against it)."""

from __future__ import annotations

import numpy as np

from ttj_jax.kernels.fused_stack_mgpu_kernel import AS_COEFFICIENTS, AS_P, LOG2_E, LOG2_E_ERF, MASKED_SCORE
from ttj_jax.kernels.fused_stack_mgpu_layout import (
    B1,
    B2,
    BK,
    BOUT,
    BQ,
    BV,
    LN1_B,
    LN1_W,
    LN2_B,
    LN2_W,
    NUM_CONSUMERS,
    TILE_ROWS,
    WG_ROWS,
    MgpuStackWeights,
    default_fast_erf,
)
from ttj_jax.kernels.pallas_common import ERF_CLAMP, ERF_DENOMINATOR, ERF_NUMERATOR
from ttj_jax.numerics import LAYER_NORM_EPS


def np_erf(x):
    """pallas_common.erf in NumPy fp32 (same coefficients, same Horner order)."""
    x = np.clip(np.asarray(x, np.float32), np.float32(-ERF_CLAMP), np.float32(ERF_CLAMP))
    x2 = x * x
    numerator = np.full_like(x, ERF_NUMERATOR[0])
    for c in ERF_NUMERATOR[1:]:
        numerator = numerator * x2 + np.float32(c)
    denominator = np.full_like(x, ERF_DENOMINATOR[0])
    for c in ERF_DENOMINATOR[1:]:
        denominator = denominator * x2 + np.float32(c)
    return x * numerator / denominator


def np_one_plus_erf_fast(z):
    """one_plus_erf_fast in NumPy fp32 (same steps; exact rsqrt and exp2 where the GPU's are approximate)."""
    z = np.asarray(z, np.float32)
    a = np.abs(z)
    r = np.float32(1.0) / np.sqrt(np.float32(1.0) + np.float32(AS_P) * a)
    t = r * r
    poly = np.full_like(a, AS_COEFFICIENTS[0])
    for c in AS_COEFFICIENTS[1:]:
        poly = poly * t + np.float32(c)
    q = poly * t * np.exp2(a * a * np.float32(-LOG2_E_ERF))
    return np.where(z >= 0, np.float32(2.0) - q, q).astype(np.float32)


def emulate(weights: MgpuStackWeights, x, valid_token_mask=None, *, causal: bool = True,
            fast_erf: bool | None = None) -> np.ndarray:
    """The kernel's algorithm in NumPy, tile by tile and warpgroup by warpgroup, with its dtypes: fp16
    GEMM operands (rounded where the kernel rounds), fp32 accumulation, the out-projection and the
    MLP's second GEMM accumulated block by block onto x + bias, the 128-row tile's masked
    64 x 128 score blocks (the kernel's key blocks leave out only keys masked here: exact zeros in
    the sums), base-2 softmax normalised in fp32 before the fp16 rounding; packed heads per sub-head
    with q's other columns zeroed in fp16, the scale of the real head_dim, P v over the whole block in
    fp32 of which the sub-head's columns are selected into the block's context, then fp16; the GELU's
    erf as the kernel builds it for x's shape (fast_erf None) or as told (emulating a slice of a
    larger batch). With valid_token_mask ([B, S], nonzero = valid), as the masked build: MASKED_SCORE
    added to every invalid key's score before the (causal, block-diagonal) mask, invalid rows of y zeros."""
    if fast_erf is None:
        fast_erf = default_fast_erf(np.shape(x)[0], np.shape(x)[1], causal)
    mats = np.asarray(weights.mats).astype(np.float32)   # fp16 values, exactly representable
    vecs = np.asarray(weights.vecs, np.float32)
    x = np.asarray(x, np.float32)
    batch, seq_len, d = x.shape
    num_heads, hd = weights.num_heads, weights.head_dim
    num_blocks, width = mats.shape[2], mats.shape[-1]   # hd zero-padded to MIN_BLOCK, or packed heads
    heads_per_block = num_heads // num_blocks
    vecs = vecs[..., :max(d, num_blocks * width)]
    seqs_per_tile = TILE_ROWS // seq_len
    batch_pad = -batch % seqs_per_tile
    xp = np.concatenate([x, np.zeros((batch_pad, seq_len, d), np.float32)]) if batch_pad else x
    tiles = xp.reshape(-1, TILE_ROWS, d)
    if valid_token_mask is not None:
        valid = np.asarray(valid_token_mask) != 0
        valid = np.concatenate([valid, np.zeros((batch_pad, seq_len), bool)]) if batch_pad else valid
        key_bias = np.where(valid.reshape(-1, TILE_ROWS), np.float32(0.0), np.float32(MASKED_SCORE))
    f16 = lambda a: a.astype(np.float16).astype(np.float32)   # noqa: E731
    dot = lambda a, b: np.matmul(a, b, dtype=np.float32)        # noqa: E731  (operands already fp16 values)

    def ln(v, w, b):
        mean = v.sum(axis=-1, keepdims=True, dtype=np.float32) * np.float32(1.0 / d)
        c = v - mean
        var = (c * c).sum(axis=-1, keepdims=True, dtype=np.float32) * np.float32(1.0 / d)
        return c * (np.float32(1.0) / np.sqrt(var + np.float32(LAYER_NORM_EPS))) * w + b

    rows = np.arange(TILE_ROWS)
    allowed = np.ones((TILE_ROWS, TILE_ROWS), bool)
    if seq_len < TILE_ROWS:
        allowed &= (rows[:, None] // seq_len) == (rows[None, :] // seq_len)
    if causal:
        allowed &= rows[None, :] <= rows[:, None]
    scale = np.float32(hd ** -0.5 * LOG2_E)
    out = np.empty_like(tiles)
    for t, res in enumerate(tiles):
        res = res.copy()
        for layer in range(weights.num_layers):
            wq, wk, wv, wout_t, w1, w2_t = mats[layer]
            v_ = vecs[layer]
            whole = v_[:, :d]                           # the d-long vectors (LayerNorms, BOUT, B2)
            h = f16(ln(res, whole[LN1_W], whole[LN1_B]))
            heads = [slice(i * width, (i + 1) * width) for i in range(num_blocks)]   # blocks, in the vectors
            q = [f16(dot(h, wq[i]) + v_[BQ][s]) for i, s in enumerate(heads)]
            k = [f16(dot(h, wk[i]) + v_[BK][s]) for i, s in enumerate(heads)]
            v = [f16(dot(h, wv[i]) + v_[BV][s]) for i, s in enumerate(heads)]
            new = np.empty_like(res)

            def context(q_head, k_block, v_block, r):   # fp32 P v over the block's columns
                scores = dot(q_head, k_block.T)
                if valid_token_mask is not None:
                    scores = (scores + key_bias[t]).astype(np.float32)
                scores = np.where(allowed[r], scores, -np.inf).astype(np.float32)
                m = scores.max(axis=1, keepdims=True) * scale
                p = np.exp2(scores * scale - m).astype(np.float32)
                p = p * (np.float32(1.0) / p.sum(axis=1, keepdims=True, dtype=np.float32))
                return dot(f16(p), v_block)

            sub_heads = np.arange(width) // hd          # packed: the sub-head of each block column
            for wg in range(NUM_CONSUMERS):
                r = slice(wg * WG_ROWS, (wg + 1) * WG_ROWS)
                ctx = []
                for i in range(num_blocks):
                    if heads_per_block == 1:
                        ctx.append(f16(context(q[i][r], k[i], v[i], r)))
                        continue
                    selected = np.zeros((WG_ROWS, width), np.float32)
                    for sub in range(heads_per_block):
                        mine = sub_heads == sub
                        q_sub = np.where(mine, q[i][r], np.float32(0.0))   # fp16 values, zeros elsewhere
                        selected = np.where(mine, context(q_sub, k[i], v[i], r), selected)
                    ctx.append(f16(selected))
                xr = res[r] + whole[BOUT]
                for i in range(num_blocks):
                    xr = xr + dot(ctx[i], wout_t[i].T)
                h2 = f16(ln(xr, whole[LN2_W], whole[LN2_B]))
                xr = xr + whole[B2]
                for i, s in enumerate(heads):
                    pre = dot(h2, w1[i]) + v_[B1][s]
                    z = pre * np.float32(0.7071067811865476)
                    one_plus_erf = np_one_plus_erf_fast(z) if fast_erf else np.float32(1.0) + np_erf(z)
                    hidden = f16(np.float32(0.5) * pre * one_plus_erf)
                    xr = xr + dot(hidden, w2_t[i].T)
                new[r] = xr
            res = new
        out[t] = ln(res, vecs[-1][0][:d], vecs[-1][1][:d])
        if valid_token_mask is not None:
            out[t] = np.where(key_bias[t][:, None] == 0, out[t], np.float32(0.0))
    return out.reshape(-1, seq_len, d)[:batch]
