"""Flash attention backward pass (FlashAttention-2) as two generic (Triton-style) Pallas kernels, and a
differentiable attention (`flash_attention_vjp`) whose forward is our flash kernel and whose backward
is this one.

From the forward's output o and per-row log-sum-exp (`flash_attention(..., return_lse=True)`), with
delta_i = sum_d o_id * do_id computed once outside the kernels:
- the dk/dv kernel, one program per key block: for each query block that can see it, recompute
  p = exp(sm_scale q k^T - lse), accumulate dv += p^T do and dk += sm_scale ds^T q with
  ds = p * (do v^T - delta);
- the dq kernel, one program per query block: the same p and ds over the visible key blocks,
  dq += sm_scale ds k.
Nothing of size [S, S] is stored. Causal attention visits only blocks on or under the diagonal; a key
mask, and padding to a block multiple, exclude keys exactly (p = 0, so masked keys get zero dk and dv);
a row with no allowed key (lse = -inf) contributes nothing.

Numerics: the dots take fp16 operands (bf16 for bf16 inputs) with fp32 accumulation, like the forward;
p, ds and the accumulators are fp32. On a CPU the kernels run with `interpret=True` (CI's check).

On Hopper (sm_90), `flash_attention_vjp`'s backward takes the Mosaic GPU kernel of
flash_attention_mgpu_bwd.py instead where `mgpu_backward_applies` (MGPU_BACKWARD_DISPATCH, head_dim in
MGPU_BACKWARD_HEAD_DIMS, S >= MGPU_BACKWARD_MIN_SEQ_LEN, fp16/bf16 operands), with or without a key mask.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ttj_jax.kernels.flash_attention import flash_attention, flash_attention_fused_qkv, on_hopper, pad_seq_and_head_dim, padded_head_dim
from ttj_jax.kernels.flash_attention_mgpu_bwd import MgpuBwdConfig, flash_attention_mgpu_bwd, flash_attention_mgpu_bwd_fused_qkv


class BwdBlocks(NamedTuple):
    """Tile sizes and Triton launch options of the two backward kernels (static)."""
    dkdv_q: int = 64       # query rows per inner step of the dk/dv kernel
    dkdv_k: int = 64       # keys per dk/dv program
    dq_q: int = 64         # queries per dq program
    dq_k: int = 64         # keys per inner step of the dq kernel
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_BLOCKS = BwdBlocks()
# Whether the fused layout's backward (flash_attention_bwd_fused_qkv) has the dk/dv kernel write slots 1
# and 2 of one [B, S, 3, H, hd] gradient and the dq kernel slot 0 of the same buffer (aliased), instead of
# three arrays stacked after: at shape 8 that stacking is a 100 MB pass of 42 us per layer on an H100
# (train-2026-12-07-h100-8-kernels.json). Predicted ~0.17 ms of shape 8's step; measured on one H100
# (train-programs-2026-12-07-h100-cuts.json, `python3 -m bench.train_programs`, variant "dqkv-in-place"):
# shape 8's backward 3.227 -> 3.087 ms; bert-base 3.496 -> 3.515 and gpt2-s4096 1.532 -> 1.533 (within their
# spread; there the Hopper backward or a 12-head layout leaves little stacking). The Hopper backward is not
# affected.
GRADIENT_IN_PLACE = True

# Per padded head_dim where measured better than DEFAULT_BLOCKS. head_dim 256: a 64-key block's dk and dv
# accumulators (64 x 256 x 2 fp32) overflow 4 warps' registers; 32 x 32 tiles took 0.129 ms against 0.178
# at B=64 H=4 S=128 causal (shape 8's call; cuDNN 0.154) on one H100, 2026-12-07
# (attention-bwd-2026-12-07-h100-small-tiles.json). head_dim 128 (B=8 H=2 S=512): every tiling tried within
# 6% of the default; head_dim 32 (B=64 H=4 S=1024): the default the fastest by 19% or more.
_BLOCKS_BY_HEAD_DIM = {256: BwdBlocks(32, 32, 32, 32, num_warps=4, num_stages=2)}


def default_bwd_blocks(head_dim: int) -> BwdBlocks:
    """The backward kernels' tiles for a head_dim (padded as the kernels run it)."""
    return _BLOCKS_BY_HEAD_DIM.get(padded_head_dim(head_dim), DEFAULT_BLOCKS)


_LOG2E = 1.4426950408889634

# The Hopper backward (flash_attention_mgpu_bwd.py) in flash_attention_vjp. Measured on one H100 (2026-12-06,
# `python3 -m bench.bench_attention_bwd`, attention-bwd-2026-12-06-h100-*.json) against these kernels at
# head_dim 64: 1.33-1.44x faster at S 2048-16384, causal and not, with and without prefix padding masks
# (pad ratio 0.3); at head_dim 128 0.96x (not dispatched). The build: 128-query blocks with dS^T stored
# before the dV and dK GEMMs (`eager_ds`), causal or not: 1.01-1.02x cuDNN at S=16384 causal (three runs;
# 1.08-1.10x the same blocks without eager_ds), 1.05x cuDNN at B=4 S=4096 causal and 0.99x non-causal, where
# 64-query blocks were 0.81x; with padding it is within 5% of 64-query blocks (0.95x at S=2048 non-causal).
MGPU_BACKWARD_DISPATCH = True
MGPU_BACKWARD_CONFIG = MgpuBwdConfig(block_q=128, eager_ds=True)
MGPU_BACKWARD_HEAD_DIMS = (64,)
# The shortest measured: at B=32 H=12 S=512 (bert-base's attention) on one H100, 0.273 ms against these
# kernels' 0.311 non-causal and 0.219 against 0.219 causal (attention-bwd-2026-12-06-h100-s512.json).
MGPU_BACKWARD_MIN_SEQ_LEN = 512
# Whether the fused layout's Hopper backward (flash_attention_fused_vjp where mgpu_backward_applies) reads q,
# k and v in place from the [B, S, 3, H, hd] projection and writes its gradient in that layout
# (flash_attention_mgpu_bwd_fused_qkv), instead of slicing q, k and v out and stacking dq, dk and dv after:
# at bert-base on one H100 the stacking took 67 us per layer and each slice ~19 us
# (train-2026-12-07-h100-kernels-bert-gpt2.json). Predicted ~0.24 ms of bert-base's step and ~0.07 ms of
# gpt2-s4096's. Measured on one H100 (`python3 -m bench.train_programs`, variant "mgpu-in-place",
# train-programs-2026-12-07-h100-residuals-a.json, -b.json): bert-base's backward 3.425 -> 3.315 and 3.393 ->
# 3.276 ms in two runs (half the prediction), gpt2-s4096's 1.516 -> 1.522 (level), gradients within 5e-6.
MGPU_BACKWARD_IN_PLACE = True


# flash_attention_vjp's forward: "generic" (our generic kernel), or "auto" (flash_attention's dispatch, which
# takes the Hopper forward where it is measured faster, key-masked calls included; its log-sum-exp has the
# same meaning). Once "generic": the fused entry then returned a log-sum-exp only from the generic kernel, so
# "auto" meant q, k, v sliced out first (the GPT-2-like step at S=4096: 2.854 ms against 2.760, one H100,
# train-2026-12-06-h100-vjp-forward-*.json). The Hopper kernel's fused entry returns it too (bench/lse_check.py
# on one H100, lse-check-2026-12-07-h100-fused.json); with it, on one H100 (train-programs-2026-12-07-h100-
# hopper-forward.json): gpt2-s4096's training forward 0.806 -> 0.781 ms, bert-base, shapes 8 and 13 unchanged
# (the dispatch keeps their S <= 1024 calls on the generic kernel). ~0.18 ms was predicted at gpt2-s4096 from
# the generic kernel's 157 us per layer there: the key-masked Hopper build with its log-sum-exp takes ~145 us
# at B=1, H=12, S=4096 (cuDNN's forward: 84 us).
VJP_FORWARD_IMPLEMENTATION = "auto"
# Whether, where the Hopper backward runs (mgpu_backward_applies), the forward is the Hopper kernel too,
# whatever the inference dispatch says for that length (its log-sum-exp and key mask included). Timed alone
# on one H100 (2026-12-07, attention-fwd-sweep-2026-12-07-h100.json: the fused entry, key-masked, with the
# log-sum-exp): at bert-base's attention
# (B=32, H=12, S=512) 103.0 us against the generic kernel's 116.5, which "auto" runs there (cuDNN through
# jax.nn.dot_product_attention 154.9 with its layout copies); at gpt2-s4096's (S=4096, causal), where "auto"
# already takes it, 117.0 against 161.0. Predicted ~0.03 ms of bert-base's training forward. Off until the
# training programs are timed and compared with it (`python3 -m bench.train_programs`, variant
# "forward-with-hopper-backward"). Its log-sum-exp at S=512 checked on one H100 (lse-check-2026-12-07-h100-s512.json);
# timed there in the programs (train-programs-2026-12-07-h100-command-buffers.json): bert-base's forward 1.747 ->
# 1.734 ms, its two programs 5.007 -> 5.036 (noise in the backward), gpt2-s4096 level (it runs the Hopper
# forward already). Half the predicted 0.03 ms, inside the run's noise: stays off.
VJP_FORWARD_WITH_HOPPER_BACKWARD = False


def mgpu_backward_applies(q, interpret: bool) -> bool:
    """Whether flash_attention_vjp's backward of q ([B, S, H, hd]) runs the Hopper kernel."""
    return (MGPU_BACKWARD_DISPATCH and not interpret and q.shape[-1] in MGPU_BACKWARD_HEAD_DIMS
            and q.shape[1] >= MGPU_BACKWARD_MIN_SEQ_LEN
            and jnp.dtype(q.dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)) and on_hopper())


def _allowed(q_start, k_start, block_q: int, block_k: int, *, causal: bool, key_limit: int | None, key_mask):
    """(block_q, block_k) bool: which (query, key) pairs attend, or None when all do."""
    allowed = None
    key_pos = k_start + jnp.arange(block_k, dtype=jnp.int32)
    if causal:
        query_pos = q_start + jnp.arange(block_q, dtype=jnp.int32)
        allowed = query_pos[:, None] >= key_pos[None, :]
    if key_limit is not None:
        inside = (key_pos < key_limit)[None, :]
        allowed = inside if allowed is None else allowed & inside
    if key_mask is not None:
        keys = (key_mask != 0)[None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def _probabilities(q, k, lse2, allowed, scale2: float):
    # exp2 with log2(e) folded into the scale and the log-sum-exp (lse2 = lse * log2 e)
    scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale2
    p = jnp.exp2(scores - lse2[:, None])          # lse = +inf on rows with no allowed key: p = 0
    return p if allowed is None else jnp.where(allowed, p, 0.0)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, key_mask_ref, dk_ref, dv_ref=None, *,
                 causal: bool, sm_scale: float, block_q: int, block_k: int, key_limit, dot_dtype):
    # Refs: q, do (S_pad, hd), lse (log2 units), delta (S_pad,) for this (batch, head); k, v (block_k, hd)
    # this program's keys; key_mask (block_k,) int32 or None; dk, dv (block_k, hd), or dk the whole fused
    # gradient [B, S_pad, 3, H, hd] and dv None (the in-place layout, GRADIENT_IN_PLACE).
    k_start = pl.program_id(0) * block_k
    k = k_ref[...].astype(dot_dtype)
    v = v_ref[...].astype(dot_dtype)
    key_mask = key_mask_ref[...] if key_mask_ref is not None else None
    num_q_blocks = q_ref.shape[0] // block_q

    def step(diagonal: bool):
        def body(q_block, carry):
            dk, dv = carry
            q_start = pl.multiple_of(q_block * block_q, block_q)
            q = q_ref[pl.ds(q_start, block_q), :].astype(dot_dtype)
            do = do_ref[pl.ds(q_start, block_q), :].astype(dot_dtype)
            allowed = _allowed(q_start, k_start, block_q, block_k, causal=causal and diagonal,
                               key_limit=key_limit, key_mask=key_mask)
            p = _probabilities(q, k, lse_ref[pl.ds(q_start, block_q)], allowed, sm_scale * _LOG2E)
            dv = dv + lax.dot_general(p.astype(dot_dtype), do, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
            dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            ds = p * (dp - delta_ref[pl.ds(q_start, block_q)][:, None])
            dk = dk + lax.dot_general(ds.astype(dot_dtype), q, (((0,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
            return dk, dv
        return body

    zeros = jnp.zeros((block_k, k_ref.shape[-1]), jnp.float32)
    carry = (zeros, zeros)
    if causal:
        # query blocks before `first` never see these keys; from `full` on they see all of them
        first = lax.div(k_start, jnp.int32(block_q))
        full = jnp.minimum(lax.div(k_start + block_k - 1 + block_q - 1, jnp.int32(block_q)), num_q_blocks)
        carry = lax.fori_loop(first, full, step(True), carry)
        carry = lax.fori_loop(full, num_q_blocks, step(False), carry)
    else:
        carry = lax.fori_loop(0, num_q_blocks, step(False), carry)
    dk, dv = carry
    if dv_ref is None:   # dk_ref: the whole [B, S_pad, 3, H, hd] gradient; this program's keys in slots 1, 2
        rows = pl.ds(pl.multiple_of(k_start, block_k), block_k)
        b, h = pl.program_id(1), pl.program_id(2)
        dk_ref[b, rows, 1, h, :] = (dk * sm_scale).astype(dk_ref.dtype)
        dk_ref[b, rows, 2, h, :] = dv.astype(dk_ref.dtype)
        return
    dk_ref[...] = (dk * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel_into(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, key_mask_ref, gradient_ref, dq_ref, **statics):
    """_dq_kernel writing slot 0 of the fused gradient that the dk/dv kernel filled (gradient_ref, the
    same buffer as dq_ref's, aliased: its other slots stay as they are)."""
    del gradient_ref
    _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, key_mask_ref, dq_ref, **statics)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, key_mask_ref, dq_ref, *,
               causal: bool, sm_scale: float, block_q: int, block_k: int, key_limit, dot_dtype):
    # Refs: q, do (block_q, hd), lse (log2 units), delta (block_q,) this program's queries; k, v (S_pad, hd);
    # key_mask (S_pad,) int32 or None; dq (block_q, hd).
    q_start = pl.program_id(0) * block_q
    q = q_ref[...].astype(dot_dtype)
    do = do_ref[...].astype(dot_dtype)
    lse, delta = lse_ref[...], delta_ref[...]
    num_k_blocks = k_ref.shape[0] // block_k

    def step(diagonal: bool):
        def body(k_block, dq):
            k_start = pl.multiple_of(k_block * block_k, block_k)
            k = k_ref[pl.ds(k_start, block_k), :].astype(dot_dtype)
            v = v_ref[pl.ds(k_start, block_k), :].astype(dot_dtype)
            key_mask = key_mask_ref[pl.ds(k_start, block_k)] if key_mask_ref is not None else None
            allowed = _allowed(q_start, k_start, block_q, block_k, causal=causal and diagonal,
                               key_limit=key_limit, key_mask=key_mask)
            p = _probabilities(q, k, lse, allowed, sm_scale * _LOG2E)
            dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            ds = p * (dp - delta[:, None])
            return dq + lax.dot_general(ds.astype(dot_dtype), k, (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)
        return body

    dq = jnp.zeros(dq_ref.shape, jnp.float32)
    if causal:
        # key blocks before `full` are seen by every query here; those up to `last` by some
        full = jnp.minimum(lax.div(q_start + 1, jnp.int32(block_k)), num_k_blocks)
        last = jnp.minimum(lax.div(q_start + block_q + block_k - 1, jnp.int32(block_k)), num_k_blocks)
        dq = lax.fori_loop(0, full, step(False), dq)
        dq = lax.fori_loop(full, last, step(True), dq)
    else:
        dq = lax.fori_loop(0, num_k_blocks, step(False), dq)
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "interpret", "blocks"))
def flash_attention_bwd(q, k, v, o, lse, do, *, causal: bool, key_mask=None, sm_scale: float | None = None,
                        interpret: bool = False, blocks: BwdBlocks | None = None):
    """(dq, dk, dv) for o = softmax(sm_scale q k^T) v, [B, S, H, hd] each in q's dtype, given the forward's
    o and lse ([B, H, S] fp32, natural log, -inf on rows with no allowed key) and do = dL/do."""
    return _bwd_pallas_calls(q, k, v, o, lse, do, fused=False, causal=causal, key_mask=key_mask,
                             sm_scale=sm_scale, interpret=interpret, blocks=blocks)


def flash_attention_bwd_fused_qkv(qkv, o, lse, do, *, causal: bool, key_mask=None, sm_scale: float | None = None,
                                  interpret: bool = False, blocks: BwdBlocks | None = None,
                                  in_place: bool | None = None):
    """flash_attention_bwd with q, k and v read in place from one [B, S, 3, H, hd] array (the fused
    projection's layout, flash_attention_fused_qkv's): dL/dqkv in that layout, the three gradients
    stacked (the one copy; reading q, k and v out of qkv would be a second), or written by the kernels
    into their slots of one buffer (in_place; None: GRADIENT_IN_PLACE, read here, outside the jit)."""
    return _fused_qkv_bwd(qkv, o, lse, do, causal=causal, key_mask=key_mask, sm_scale=sm_scale,
                          interpret=interpret, blocks=blocks,
                          in_place=GRADIENT_IN_PLACE if in_place is None else bool(in_place))


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "interpret", "blocks", "in_place"))
def _fused_qkv_bwd(qkv, o, lse, do, *, causal, key_mask, sm_scale, interpret, blocks, in_place):
    gradient = _bwd_pallas_calls(qkv, qkv, qkv, o, lse, do, fused=True, causal=causal, key_mask=key_mask,
                                 sm_scale=sm_scale, interpret=interpret, blocks=blocks, in_place=in_place)
    return gradient if in_place else jnp.stack(gradient, axis=2)


def _bwd_pallas_calls(q_src, k_src, v_src, o, lse, do, *, fused: bool, causal: bool, key_mask, sm_scale,
                      interpret: bool, blocks: BwdBlocks | None, in_place: bool = False):
    """The two backward kernels. Separate layout: q_src, k_src, v_src [B, S, H, hd] each. Fused: all three
    the same [B, S, 3, H, hd] array, whose slots the BlockSpecs pick. blocks None: default_bwd_blocks.
    Returns (dq, dk, dv), or with fused and in_place the [B, S, 3, H, hd] gradient the kernels wrote
    their slots of."""
    batch, seq_len = q_src.shape[:2]
    num_heads, head_dim = q_src.shape[-2:]
    blocks = default_bwd_blocks(head_dim) if blocks is None else blocks
    sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    block = math.lcm(blocks.dkdv_q, blocks.dkdv_k, blocks.dq_q, blocks.dq_k)
    seq_pad = -seq_len % block
    hd_pad = padded_head_dim(head_dim) - head_dim
    padded_len, padded_hd = seq_len + seq_pad, head_dim + hd_pad

    # delta_i = sum_d o_id do_id, per (batch, head, row), in fp32; rows with no allowed key get lse = +inf
    # (p = 0 there), padded rows too. The kernels take lse in log2 units (exp2).
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    lse = jnp.where(jnp.isfinite(lse), lse * _LOG2E, jnp.inf)
    pad_rows = lambda a, value: jnp.pad(a, ((0, 0), (0, 0), (0, seq_pad)), constant_values=value)  # noqa: E731
    lse, delta = pad_rows(lse, jnp.inf), pad_rows(delta, 0.0)
    pad = lambda a: pad_seq_and_head_dim(a, seq_pad, hd_pad)  # noqa: E731
    if fused:
        q_p = k_p = v_p = pad(q_src)
    else:
        q_p, k_p, v_p = pad(q_src), pad(k_src), pad(v_src)
    do_p = pad(do)
    mask_p = None
    if key_mask is not None:
        mask_p = jnp.pad(key_mask.astype(jnp.int32), ((0, 0), (0, seq_pad)))
    key_limit = seq_len if seq_pad else None
    dtype = jnp.dtype(q_src.dtype)
    dot_dtype = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float16
    statics = dict(causal=causal, sm_scale=sm_scale, key_limit=key_limit, dot_dtype=dot_dtype)
    params = pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)

    whole = lambda length: pl.BlockSpec((None, length, None, padded_hd), lambda i, b, h: (b, 0, h, 0))  # noqa: E731
    blocked = lambda length: pl.BlockSpec((None, length, None, padded_hd), lambda i, b, h: (b, i, h, 0))  # noqa: E731

    def source(length, slot, per_block: bool):   # q (slot 0), k (1) or v (2): whole sequences, or blocks of it
        if not fused:
            return blocked(length) if per_block else whole(length)
        return pl.BlockSpec((None, length, None, None, padded_hd),
                            lambda i, b, h: (b, i if per_block else 0, slot, h, 0))
    rows_whole = pl.BlockSpec((None, None, padded_len), lambda i, b, h: (b, h, 0))
    rows_blocked = pl.BlockSpec((None, None, blocks.dq_q), lambda i, b, h: (b, h, i))
    mask_whole = pl.BlockSpec((None, padded_len), lambda i, b, h: (b, 0)) if mask_p is not None else None
    mask_blocked = pl.BlockSpec((None, blocks.dkdv_k), lambda i, b, h: (b, i)) if mask_p is not None else None

    dkdv_inputs = [source(padded_len, 0, False), source(blocks.dkdv_k, 1, True), source(blocks.dkdv_k, 2, True),
                   whole(padded_len), rows_whole, rows_whole, mask_blocked]
    dq_inputs = [source(blocks.dq_q, 0, True), source(padded_len, 1, False), source(padded_len, 2, False),
                 blocked(blocks.dq_q), rows_blocked, rows_blocked, mask_whole]
    if fused and in_place:   # one [B, S_pad, 3, H, hd] gradient: dk, dv into slots 1, 2, then dq into slot 0
        gradient_shape = jax.ShapeDtypeStruct(q_p.shape, dtype)
        gradient = pl.pallas_call(
            functools.partial(_dkdv_kernel, block_q=blocks.dkdv_q, block_k=blocks.dkdv_k, **statics),
            grid=(padded_len // blocks.dkdv_k, batch, num_heads), in_specs=dkdv_inputs,
            out_specs=pl.BlockSpec(memory_space=pl.ANY), out_shape=gradient_shape,
            compiler_params=params, interpret=interpret, name="ttj_flash_attention_dkdv",
        )(q_p, k_p, v_p, do_p, lse, delta, mask_p)
        gradient = pl.pallas_call(
            functools.partial(_dq_kernel_into, block_q=blocks.dq_q, block_k=blocks.dq_k, **statics),
            grid=(padded_len // blocks.dq_q, batch, num_heads),
            in_specs=[*dq_inputs, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, blocks.dq_q, None, None, padded_hd), lambda i, b, h: (b, i, 0, h, 0)),
            out_shape=gradient_shape,
            input_output_aliases={len(jax.tree.leaves((q_p, k_p, v_p, do_p, lse, delta, mask_p))): 0},
            compiler_params=params, interpret=interpret, name="ttj_flash_attention_dq",
        )(q_p, k_p, v_p, do_p, lse, delta, mask_p, gradient)
        return gradient[:, :seq_len, :, :, :head_dim] if seq_pad or hd_pad else gradient
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=blocks.dkdv_q, block_k=blocks.dkdv_k, **statics),
        grid=(padded_len // blocks.dkdv_k, batch, num_heads), in_specs=dkdv_inputs,
        out_specs=(blocked(blocks.dkdv_k), blocked(blocks.dkdv_k)),
        out_shape=(jax.ShapeDtypeStruct(do_p.shape, dtype), jax.ShapeDtypeStruct(do_p.shape, dtype)),
        compiler_params=params, interpret=interpret, name="ttj_flash_attention_dkdv",
    )(q_p, k_p, v_p, do_p, lse, delta, mask_p)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_q=blocks.dq_q, block_k=blocks.dq_k, **statics),
        grid=(padded_len // blocks.dq_q, batch, num_heads), in_specs=dq_inputs,
        out_specs=blocked(blocks.dq_q),
        out_shape=jax.ShapeDtypeStruct(do_p.shape, dtype),
        compiler_params=params, interpret=interpret, name="ttj_flash_attention_dq",
    )(q_p, k_p, v_p, do_p, lse, delta, mask_p)
    unpad = lambda a: a[:, :seq_len, :, :head_dim]  # noqa: E731
    return unpad(dq), unpad(dk), unpad(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def flash_attention_vjp(q, k, v, causal: bool, interpret: bool, key_mask=None):
    """Our flash attention ([B, S, H, hd]; key_mask bool [B, S] or None), differentiable: its backward is
    flash_attention_bwd, or the Hopper kernel where mgpu_backward_applies. The key mask gets no gradient."""
    return flash_attention(q, k, v, causal=causal, key_mask=key_mask, interpret=interpret,
                           implementation=VJP_FORWARD_IMPLEMENTATION)


def _vjp_fwd(q, k, v, causal, interpret, key_mask=None):
    o, lse = flash_attention(q, k, v, causal=causal, key_mask=key_mask, interpret=interpret,
                             implementation=_vjp_forward_implementation(q, interpret), return_lse=True)
    return o, (q, k, v, o, lse, key_mask)


def _vjp_bwd(causal, interpret, residuals, do):
    q, k, v, o, lse, key_mask = residuals
    if mgpu_backward_applies(q, interpret):
        dq, dk, dv = flash_attention_mgpu_bwd(q, k, v, o, lse, do.astype(q.dtype), causal=causal, key_mask=key_mask,
                                              interpret=interpret, config=MGPU_BACKWARD_CONFIG)
        return dq, dk, dv, None
    dq, dk, dv = flash_attention_bwd(q, k, v, o, lse, do.astype(q.dtype), causal=causal, key_mask=key_mask,
                                     interpret=interpret)
    return dq, dk, dv, None


flash_attention_vjp.defvjp(_vjp_fwd, _vjp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def flash_attention_fused_vjp(qkv, causal: bool, interpret: bool, key_mask=None):
    """flash_attention_vjp on q, k, v read in place from the fused projection's [B, S, 3, H, hd] layout
    (flash_attention_fused_qkv): the forward slices nothing out of qkv, and the backward's dL/dqkv comes
    in that layout. The Hopper backward, where it applies, takes q, k and v sliced out."""
    return flash_attention_fused_qkv(qkv, causal=causal, key_mask=key_mask, interpret=interpret,
                                     implementation=VJP_FORWARD_IMPLEMENTATION)


def _vjp_forward_implementation(q, interpret: bool) -> str:
    if VJP_FORWARD_WITH_HOPPER_BACKWARD and VJP_FORWARD_IMPLEMENTATION == "auto" and mgpu_backward_applies(q, interpret):
        return "mosaic"
    return VJP_FORWARD_IMPLEMENTATION


def _fused_vjp_fwd(qkv, causal, interpret, key_mask=None):
    o, lse = flash_attention_fused_qkv(qkv, causal=causal, key_mask=key_mask, interpret=interpret,
                                       implementation=_vjp_forward_implementation(qkv[:, :, 0], interpret),
                                       return_lse=True)
    return o, (qkv, o, lse, key_mask)


def _fused_vjp_bwd(causal, interpret, residuals, do):
    qkv, o, lse, key_mask = residuals
    if mgpu_backward_applies(qkv[:, :, 0], interpret):
        if MGPU_BACKWARD_IN_PLACE:
            return flash_attention_mgpu_bwd_fused_qkv(qkv, o, lse, do.astype(qkv.dtype), causal=causal,
                                                      key_mask=key_mask, interpret=interpret,
                                                      config=MGPU_BACKWARD_CONFIG), None
        q, k, v = (qkv[:, :, i] for i in range(3))   # flash_attention_vjp's backward on the slices
        *grads, _ = _vjp_bwd(causal, interpret, (q, k, v, o, lse, key_mask), do)
        return jnp.stack(grads, axis=2), None
    return flash_attention_bwd_fused_qkv(qkv, o, lse, do.astype(qkv.dtype), causal=causal, key_mask=key_mask,
                                         interpret=interpret), None


flash_attention_fused_vjp.defvjp(_fused_vjp_fwd, _fused_vjp_bwd)
