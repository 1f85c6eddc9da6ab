"""The body of the Hopper (sm_90) flash-attention kernel, in Pallas' Mosaic GPU dialect.

One CUDA block per (query tile, head, batch element), FlashAttention-3 style:
- Warpgroups. `num_compute_wgs` consumer warpgroups (2 or 3) each own 64 consecutive query rows; one
  more warpgroup is the producer. The producer gives up registers (`set_max_registers`), the consumers
  take them.
- Producer. Issues the TMA copies of K and V blocks of `block_kv` keys into a ring of `num_stages`
  slots, each slot with a "ready" barrier (completed by the copy) and a "consumed" barrier (one arrival
  per consumer). K and V have separate barriers, because a consumer is done with K_j one GEMM phase
  before it is done with V_j.
- Consumers. Each loads its own 64 rows of Q once. Its loop is software-pipelined: one GEMM phase
  issues P_{j-1} @ V_{j-1} and Q @ K_j^T together, then the warpgroup does the softmax of block j. A
  token ring of barriers orders the consumers' GEMM phases round-robin, so while one warpgroup runs
  its softmax on the ALU/SFU another's GEMMs run on the tensor core (FA3's ping-pong).
- Causal attention. Tiles are launched heaviest first. A tile only visits KV blocks that start at or
  before its last row; a consumer masks only the blocks that straddle its own diagonal, and consumers
  whose rows end earlier than the tile's last block wait for and release the blocks past their
  diagonal, so the ring's phases stay in step.
- Any sequence length. TMA reads past the end are zero-filled and writes past it dropped; keys past S
  are masked with `key < S` (non-causal) or are never visible (causal).
- Output. Each consumer normalises its rows, writes them over its own Q buffer and stores them with one
  TMA copy.
- Key mask (key-masked builds, `mask_ref`). The producer copies each KV block's mask bytes into a ring
  of its own (one copy per block, with V, on a barrier per slot that every consumer waits on once); a
  consumer adds MASKED_SCORE to the scores of invalid keys in every block it visits (finite: a row with no
  valid key stays finite) and writes zeros for a row that saw no valid key (its running max stays near
  MASKED_SCORE), as the generic kernel does. With clean-block bounds (`bounds_ref`), each consumer first
  reads its sequence's count of leading KV blocks with no invalid key, and adds no bias in those: the
  add is one more instruction per score in a softmax of about four and a half, ~20% at head_dim 64.

Numerics: both GEMMs take the input dtype and accumulate in fp32; P is rounded to the input dtype for
P @ V. The softmax runs in base 2 (running max in units of log2(e) * sm_scale * score, so each
probability is one FMA and one `ex2.approx`, a few fp32 ulps off, far below P's 2^-11 rounding). Running
max, sum and output are fp32. Scores masked by causality or past S are -inf; every visited row has key 0
in its first block, so its running max is finite from the first block on and no NaN can arise. A key
mask adds the finite MASKED_SCORE instead, which keeps that so.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ttj_jax.kernels.attention_common import MASKED_SCORE
from ttj_jax.kernels.flash_attention_mgpu_config import REGISTERS_PER_THREAD, ROWS_PER_CONSUMER, MgpuBlockSizes
from ttj_jax.kernels.flash_attention_mgpu_interpret import InterpretPallas, InterpretPlgpu
from ttj_jax.kernels.mosaic_primitives import mosaic_cluster_arrive_from_warp, plgpu_module

_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)
# Grid axis names share a namespace with the axes of an enclosing mesh: inside a shard_map over a mesh
# axis "batch", `lax.axis_index("batch")` resolved to the mesh axis and a two-GPU split gave wrong
# outputs. Names no mesh will use:
Q_TILE_AXIS, HEAD_AXIS, SEQUENCE_AXIS = "ttj_mgpu_q_tile", "ttj_mgpu_head", "ttj_mgpu_sequence"
PRODUCER_WARP_AXIS = "ttj_mgpu_producer_warp"   # warp_producer: the warps of the producer's warpgroup
CLUSTER_AXIS = "ttj_mgpu_pair_member"           # kv_multicast: 0 or 1 within a 2-block cluster


# --- The schedule, in plain integers (Python ints or traced int32 scalars) -----------------------------

def _cdiv(a, b: int):
    return -(-a // b) if isinstance(a, int) else lax.div(a + (b - 1), jnp.int32(b))


def _floordiv(a, b: int):
    # Only for a >= 0, where truncation equals floor division.
    return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _where(condition, a, b):
    return (a if condition else b) if isinstance(condition, bool) else jnp.where(condition, a, b)


def _minimum(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def kv_block_range(row_start, num_rows: int, seq_len: int, block_kv: int, causal: bool):
    """KV blocks that rows [row_start, row_start + num_rows) visit: (num_unmasked, num_visited).

    Blocks [0, num_unmasked) need no mask for any of these rows; blocks [num_unmasked, num_visited)
    need the causal mask (causal) or the `key < seq_len` mask (otherwise); later blocks hold no key
    these rows may see.
    """
    num_kv_blocks = _cdiv(seq_len, block_kv)
    if not causal:
        return seq_len // block_kv, num_kv_blocks
    # Block j is below the diagonal of every row when its last key (j + 1) * block_kv - 1 < row_start.
    num_unmasked = _minimum(_floordiv(row_start, block_kv), num_kv_blocks)
    num_visited = _minimum(_cdiv(row_start + num_rows, block_kv), num_kv_blocks)
    return num_unmasked, num_visited


class ConsumerPlan(NamedTuple):
    """The KV blocks one consumer warpgroup handles, in order."""
    prologue_masked: bool  # block 0 takes the mask (static: whenever any block of any row might need it)
    first_masked: Any      # blocks [1, first_masked) skip the mask, [first_masked, num_visited) take it
    num_visited: Any       # blocks [0, num_visited) are computed
    tile_blocks: Any       # blocks [num_visited, tile_blocks) are loaded for other rows: wait, release


def consumer_plan(tile_start, wg, seq_len: int, blocks: MgpuBlockSizes, causal: bool) -> ConsumerPlan:
    """What consumer `wg` of the query tile starting at row `tile_start` does with the KV ring."""
    rows = ROWS_PER_CONSUMER
    _, tile_blocks = kv_block_range(tile_start, blocks.block_q, seq_len, blocks.block_kv, causal)
    num_unmasked, num_visited = kv_block_range(tile_start + wg * rows, rows, seq_len, blocks.block_kv, causal)
    first_masked = max(num_unmasked, 1) if isinstance(num_unmasked, int) else jnp.maximum(num_unmasked, 1)
    return ConsumerPlan(causal or seq_len % blocks.block_kv != 0, first_masked, num_visited, tile_blocks)


def multicast_pair(pair, member, num_q_tiles: int, seq_len: int, blocks: MgpuBlockSizes, causal: bool):
    """kv_multicast: member `member` (0 or 1) of the cluster `pair` -> (valid, tile, shared_blocks).

    The pair's grid positions 2 * pair and 2 * pair + 1 map to query tiles as without clusters (causal:
    heaviest first, so member 0 has the upper tile). valid is False for a position past the last tile.
    shared_blocks: the KV blocks [0, shared_blocks) both members load together, those of member 1's tile
    (0 if it has none); member 0's tile may need a block or two more, which it loads alone."""
    def tile_of(position):
        tile = num_q_tiles - 1 - position if causal else position
        valid = (tile >= 0) & (tile < num_q_tiles)
        return valid, _where(valid, tile, 0)
    valid, tile = tile_of(2 * pair + member)
    partner_valid, partner_tile = tile_of(2 * pair + 1)
    _, partner_blocks = kv_block_range(partner_tile * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv,
                                       causal)
    return valid, tile, _where(partner_valid, partner_blocks, 0)


def loop_segments(plan: ConsumerPlan, clean=None) -> list:
    """The main loop's blocks [1, num_visited) in order, as (lower, upper, masked, key_bias) segments:
    masked from plan.first_masked on; with `clean` (the count of leading KV blocks with no invalid key,
    an int32 scalar; None: no clean-block bounds) key_bias from max(clean, 1) on, else everywhere."""
    first, visited = plan.first_masked, plan.num_visited
    if clean is None:
        return [(1, first, False, True), (first, visited, True, True)]
    clean = jnp.maximum(clean, 1)
    split_unmasked = jnp.minimum(first, clean)                           # in [1, first]
    split_masked = jnp.maximum(first, jnp.minimum(clean, visited))       # in [first, visited]
    return [(1, split_unmasked, False, False), (split_unmasked, first, False, True),
            (first, split_masked, True, False), (split_masked, visited, True, True)]


def _fori_loop(lower, upper, body, carry):
    if isinstance(lower, int) and isinstance(upper, int) and lower >= upper:
        return carry
    return lax.fori_loop(lower, upper, body, carry)


# --- The kernel body -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Kernel:
    """What every stage of one CUDA block's trace needs: the (possibly interpret-mode) modules, the
    statics, the refs, and this warpgroup's index."""
    plgpu: Any
    pl: Any
    causal: bool
    sm_scale: float
    seq_len: int
    head_dim: int
    blocks: MgpuBlockSizes
    dtype: Any
    interpret: Any
    q_ref: Any
    k_ref: Any
    v_ref: Any
    out_ref: Any
    lse_ref: Any
    smem: tuple       # (q [wgs, 64, hd], k ring, v ring, *interpret staging, lse [wgs, 64] if lse_ref)
    barriers: tuple   # (q_ready, k_ready, v_ready, k_consumed, v_consumed, tokens, *cluster barriers)
    wg: Any
    mask_ref: Any = None    # key-masked builds: [B, mask_len] uint8 in GMEM, nonzero = valid key
    mask_smem: Any = None   # (num_stages * mask_slot_bytes(block_kv),) uint8: one slot per ring slot
    mask_ready: Any = None  # num_stages barriers, completed by the mask copies
    bounds_ref: Any = None  # clean-block bounds: [B, BOUNDS_ROW] int32 in GMEM, column 0 the count of
                            # leading KV blocks of the sequence with no invalid key
    bounds_smem: Any = None   # (num_wgs * BOUNDS_ROW,) int32: each consumer's copy of its sequence's row
    bounds_ready: Any = None  # num_wgs barriers, completed by those copies

    @property
    def key_masked(self) -> bool:
        return self.mask_ref is not None

    def slot_of(self, block):
        return lax.rem(block, jnp.int32(self.blocks.num_stages))

    def pass_token(self):
        if self.blocks.pingpong:
            tokens = self.barriers[5]
            self.plgpu.barrier_arrive(tokens.at[lax.rem(self.wg + 1, jnp.int32(self.blocks.num_compute_wgs))])

    def wait_token(self):
        if self.blocks.pingpong:
            self.plgpu.barrier_wait(self.barriers[5].at[self.wg])

    def wgmma_zeros(self, shape):
        return self.plgpu.layout_cast(jnp.zeros(shape, jnp.float32), self.plgpu.Layout.WGMMA)

    def rescale(self, acc, alpha):
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    @property
    def one_accumulator(self):
        # The interpreter cannot store into an accumulator: there the overlapped P @ V goes into a zero
        # one and is added after (the same fp32 sum, init + (0 + P @ V)).
        return self.blocks.overlap_softmax and not self.interpret


# int32 per sequence in the clean-block bounds: one 128-byte row, a TMA copy's unit (the bound in column 0)
BOUNDS_ROW = 32


def mask_slot_bytes(block_kv: int) -> int:
    """Bytes between two slots of the key mask's ring: a TMA copy's shared-memory destination must be
    128-byte aligned."""
    return -(-block_kv // 128) * 128


def _key_bias(kernel: _Kernel, block):
    """Block `block`'s key mask as a score bias, (block_kv,) fp32 in the columns' layout: 0 for a valid
    key, MASKED_SCORE for an invalid one. Waits for the block's mask copy (once per block and consumer)."""
    plgpu, block_kv = kernel.plgpu, kernel.blocks.block_kv
    slot = kernel.slot_of(block)
    plgpu.barrier_wait(kernel.mask_ready.at[slot])
    valid = kernel.mask_smem[kernel.pl.ds(slot * mask_slot_bytes(block_kv), block_kv)]
    valid = plgpu.layout_cast(valid, plgpu.Layout.WGMMA.reduce(0))
    return jnp.where(valid != 0, 0.0, MASKED_SCORE).astype(jnp.float32)


def _softmax(kernel: _Kernel, scores, block, row_start, m_prev, l_prev, masked: bool, p_dtype,
             key_bias: bool = True):
    """Online softmax of one block's raw (64, block_kv) fp32 scores. Returns the new running max and
    sum, P in p_dtype, and alpha = exp2(m_prev - m_new), the factor for what was accumulated before.
    key_bias=False (key-masked builds): the block holds no invalid key; its mask copy is waited for (every
    consumer observes every phase of the mask's barriers) and not read."""
    plgpu, block_kv = kernel.plgpu, kernel.blocks.block_kv
    score_scale = kernel.sm_scale * _LOG2_E
    if kernel.key_masked and key_bias:
        scores = scores + lax.broadcast_in_dim(_key_bias(kernel, block), scores.shape, [1])
    elif kernel.key_masked:
        plgpu.barrier_wait(kernel.mask_ready.at[kernel.slot_of(block)])
    if masked:
        key = block * block_kv + plgpu.broadcasted_iota(jnp.int32, scores.shape, 1, layout=plgpu.Layout.WGMMA)
        if kernel.causal:
            query = row_start + plgpu.broadcasted_iota(jnp.int32, scores.shape, 0, layout=plgpu.Layout.WGMMA)
            allowed = key <= query
        else:
            allowed = key < kernel.seq_len
        scores = jnp.where(allowed, scores, -jnp.inf)
    m_new = jnp.maximum(m_prev, scores.max(axis=1) * score_scale)
    alpha = jnp.exp2(m_prev - m_new)
    p = jnp.exp2(scores * score_scale - lax.broadcast_in_dim(m_new, scores.shape, [0]))
    return m_new, l_prev * alpha + p.sum(axis=1), p.astype(p_dtype), alpha


def _consumer_prologue(kernel: _Kernel, q_wg, row_start, prologue_masked: bool):
    """S_0 = Q @ K_0^T alone and its softmax. Consumer 0 holds the token first. Returns the loop carry
    (acc, m, l, p, alpha)."""
    plgpu, pl, rows = kernel.plgpu, kernel.pl, ROWS_PER_CONSUMER
    q_ready, k_ready, _, k_consumed, _, _, *_ = kernel.barriers
    k_smem = kernel.smem[1]
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
    l = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
    acc = kernel.wgmma_zeros((rows, kernel.head_dim))
    plgpu.barrier_wait(q_ready.at[kernel.wg])
    plgpu.barrier_wait(k_ready.at[0])
    pl.when(kernel.wg > 0)(kernel.wait_token)

    def first_scores(s_ref):
        plgpu.wgmma(s_ref, q_wg, k_smem.at[0].transpose((1, 0)))
        kernel.pass_token()
        return s_ref[...]

    scores = pl.run_scoped(first_scores, plgpu.ACC((rows, kernel.blocks.block_kv), jnp.float32))
    plgpu.barrier_arrive(k_consumed.at[0])
    # The prologue block takes the mask whenever any block might: a no-op where it is not needed.
    m, l, p, alpha = _softmax(kernel, scores, 0, row_start, m, l, prologue_masked, kernel.dtype)
    if not kernel.blocks.overlap_softmax:
        acc = kernel.rescale(acc, alpha)
    return acc, m, l, p, alpha


def _main_loop_step(kernel: _Kernel, q_wg, row_start, block, carry, *, masked: bool, key_bias: bool = True):
    """One GEMM phase (P_{block-1} @ V_{block-1} and Q @ K_block^T), then the softmax of `block` (masked:
    the causal or `key < S` mask; key_bias: the key mask's bias, in key-masked builds)."""
    plgpu, pl, rows, block_kv = kernel.plgpu, kernel.pl, ROWS_PER_CONSUMER, kernel.blocks.block_kv
    _, k_ready, v_ready, k_consumed, v_consumed, *_ = kernel.barriers
    _, k_smem, v_smem, *_ = kernel.smem
    acc, m, l, p, alpha = carry
    prev_slot, slot = kernel.slot_of(block - 1), kernel.slot_of(block)
    plgpu.barrier_wait(v_ready.at[prev_slot])
    plgpu.barrier_wait(k_ready.at[slot])
    kernel.wait_token()
    k_t, v = k_smem.at[slot].transpose((1, 0)), v_smem.at[prev_slot]
    if kernel.blocks.overlap_softmax:
        def overlapped_gemms(s_ref, pv_ref):
            if kernel.one_accumulator:   # the output, rescaled by the previous alpha, before the GEMMs
                pv_ref[...] = kernel.rescale(acc, alpha)
            plgpu.wgmma(s_ref, q_wg, k_t)
            plgpu.wgmma(pv_ref, p, v)   # returns once Q @ K^T is done; P @ V keeps running
            kernel.pass_token()
            scores = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
            plgpu.barrier_arrive(k_consumed.at[slot])
            # P stays fp32 until P @ V has completed: registers that feed a later wgmma, written while
            # one is in flight, made ptxas serialize every wgmma (C7513)
            softmax_out = _softmax(kernel, scores, block, row_start, m, l, masked, jnp.float32, key_bias)
            return softmax_out, pv_ref[...]
        (m, l, p_next, alpha_next), pv = pl.run_scoped(
            overlapped_gemms, plgpu.ACC((rows, block_kv), jnp.float32),
            plgpu.ACC((rows, kernel.head_dim), jnp.float32))
        p_next = p_next.astype(kernel.dtype)
        plgpu.barrier_arrive(v_consumed.at[prev_slot])
        # alpha of block - 1: P_{block-1} is relative to its max
        return _merge_pv(kernel, acc, alpha, pv), m, l, p_next, alpha_next

    def gemms(refs):
        acc_ref, s_ref = refs
        plgpu.wgmma(acc_ref, p, v)
        plgpu.wgmma(s_ref, q_wg, k_t)
        kernel.pass_token()
    acc, scores = pl.run_state(gemms)((plgpu.ACC.init(acc), plgpu.ACC.init(kernel.wgmma_zeros((rows, block_kv)))))
    plgpu.barrier_arrive(k_consumed.at[slot])
    plgpu.barrier_arrive(v_consumed.at[prev_slot])
    m, l, p_next, alpha_next = _softmax(kernel, scores, block, row_start, m, l, masked, kernel.dtype, key_bias)
    return kernel.rescale(acc, alpha_next), m, l, p_next, alpha_next


def _merge_pv(kernel: _Kernel, acc, alpha, pv):
    return pv if kernel.one_accumulator else kernel.rescale(acc, alpha) + pv


def _consumer_epilogue(kernel: _Kernel, plan: ConsumerPlan, acc, p, alpha):
    """The last P @ V, then the blocks this tile loads but these rows never see (causal only): wait for
    each, release it, and pass the token on, so the ring and the token order stay the same for every
    consumer. Returns the unnormalised output."""
    plgpu, pl = kernel.plgpu, kernel.pl
    _, k_ready, v_ready, k_consumed, v_consumed, *_ = kernel.barriers
    v_smem = kernel.smem[2]
    last_slot = kernel.slot_of(plan.num_visited - 1)
    plgpu.barrier_wait(v_ready.at[last_slot])
    kernel.wait_token()
    if kernel.blocks.overlap_softmax:
        def last_overlapped_pv(pv_ref):
            if kernel.one_accumulator:
                pv_ref[...] = kernel.rescale(acc, alpha)
            plgpu.wgmma(pv_ref, p, v_smem.at[last_slot])
            kernel.pass_token()
            return pv_ref[...]
        pv = pl.run_scoped(last_overlapped_pv, plgpu.ACC((ROWS_PER_CONSUMER, kernel.head_dim), jnp.float32))
        acc = _merge_pv(kernel, acc, alpha, pv)
    else:
        def last_pv(acc_ref):
            plgpu.wgmma(acc_ref, p, v_smem.at[last_slot])
            kernel.pass_token()
        acc = pl.run_state(last_pv)(plgpu.ACC.init(acc))
    plgpu.barrier_arrive(v_consumed.at[last_slot])

    def skip(block, _):
        slot = kernel.slot_of(block)
        plgpu.barrier_wait(k_ready.at[slot])
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])
        if kernel.key_masked:   # every consumer observes every phase of the mask's barriers
            plgpu.barrier_wait(kernel.mask_ready.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])
        kernel.wait_token()
        kernel.pass_token()
    if kernel.causal:
        lax.fori_loop(plan.num_visited, plan.tile_blocks, skip, None)
    return acc


def _store_output(kernel: _Kernel, q_wg, batch, head, row_start, acc, m, l):
    """Normalise, write over this warpgroup's Q buffer (every wgmma reading Q has completed) and store
    with one TMA copy; with return_lse also the rows' log-sum-exp."""
    plgpu, pl, rows = kernel.plgpu, kernel.pl, ROWS_PER_CONSUMER
    inverse = 1.0 / l
    saw_a_key = None
    if kernel.key_masked:   # a row that saw no valid key: its max is MASKED_SCORE's, far below a real one
        saw_a_key = m > 0.5 * MASKED_SCORE * kernel.sm_scale * _LOG2_E
        inverse = jnp.where(saw_a_key, inverse, 0.0)
    acc = acc * lax.broadcast_in_dim(inverse, acc.shape, [0])
    q_wg[...] = acc.astype(kernel.dtype)
    if kernel.lse_ref is not None:   # log(sum_j exp(sm_scale q.k_j)) = (m + log2 l) ln 2: m and l are in base 2
        lse_wg = kernel.smem[-1].at[kernel.wg]
        lse = (m + jnp.log2(l)) * _LN_2
        lse_wg[...] = lse if saw_a_key is None else jnp.where(saw_a_key, lse, -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_wg, kernel.out_ref.at[batch, pl.ds(row_start, rows), head])
    if kernel.lse_ref is not None:
        plgpu.copy_smem_to_gmem(lse_wg, kernel.lse_ref.at[batch, head, pl.ds(row_start, rows)])
    plgpu.wait_smem_to_gmem(0)


def _consumer(kernel: _Kernel, batch, head, tile_start):
    """One consumer warpgroup's 64 rows of the query tile."""
    plgpu, pl, rows = kernel.plgpu, kernel.pl, ROWS_PER_CONSUMER
    row_start = tile_start + kernel.wg * rows
    q_wg = kernel.smem[0].at[kernel.wg]
    plgpu.copy_gmem_to_smem(kernel.q_ref.at[batch, pl.ds(row_start, rows), head], q_wg,
                            kernel.barriers[0].at[kernel.wg], oob_mode=plgpu.OOBFillMode.ZEROS)
    plan = consumer_plan(tile_start, kernel.wg, kernel.seq_len, kernel.blocks, kernel.causal)
    clean = None
    if kernel.bounds_ref is not None:   # this sequence's leading clean KV blocks (the kernel's docstring)
        row = kernel.bounds_smem.at[pl.ds(kernel.wg * BOUNDS_ROW, BOUNDS_ROW)]
        plgpu.copy_gmem_to_smem(kernel.bounds_ref.at[batch], row, kernel.bounds_ready.at[kernel.wg])
        plgpu.barrier_wait(kernel.bounds_ready.at[kernel.wg])
        clean = row[0]
    carry = _consumer_prologue(kernel, q_wg, row_start, plan.prologue_masked)
    step = functools.partial(_main_loop_step, kernel, q_wg, row_start)
    for lower, upper, masked, key_bias in loop_segments(plan, clean):
        carry = _fori_loop(lower, upper, functools.partial(step, masked=masked, key_bias=key_bias), carry)
    acc, m, l, p, alpha = carry
    acc = _consumer_epilogue(kernel, plan, acc, p, alpha)
    _store_output(kernel, q_wg, batch, head, row_start, acc, m, l)


def _producer(kernel: _Kernel, batch, head, tile_blocks, shared_blocks):
    """Fills the ring with the tile's first blocks, then loads each next block into a slot once every
    consumer (and with kv_multicast, the partner block's consumers too) has released it."""
    plgpu, pl, blocks = kernel.plgpu, kernel.pl, kernel.blocks
    _, k_ready, v_ready, k_consumed, v_consumed, _, *cluster_barriers = kernel.barriers
    _, k_smem, v_smem, *_ = kernel.smem
    block_kv, num_stages = blocks.block_kv, blocks.num_stages

    def load(block, slot, what_ref, smem, ready):
        def copy(**collective):
            plgpu.copy_gmem_to_smem(what_ref.at[batch, pl.ds(block * block_kv, block_kv), head], smem.at[slot],
                                    ready.at[slot], oob_mode=plgpu.OOBFillMode.ZEROS, **collective)
        if not blocks.kv_multicast:
            copy()
            return
        together = block < shared_blocks   # each member loads half the rows, into both blocks
        pl.when(together)(functools.partial(copy, collective_axes=CLUSTER_AXIS))
        pl.when(jnp.logical_not(together))(copy)

    def load_mask(block, slot):   # not multicast: each member of a pair loads its own (same) bytes
        if kernel.key_masked:
            plgpu.copy_gmem_to_smem(kernel.mask_ref.at[batch, pl.ds(block * block_kv, block_kv)],
                                    kernel.mask_smem.at[pl.ds(slot * mask_slot_bytes(block_kv), block_kv)],
                                    kernel.mask_ready.at[slot])

    def fill(block):
        load(jnp.int32(block), block, kernel.k_ref, k_smem, k_ready)
        load(jnp.int32(block), block, kernel.v_ref, v_smem, v_ready)
        load_mask(jnp.int32(block), block)

    in_one_warp = blocks.warp_producer and not kernel.interpret
    # jax refuses a cluster arrive in a warp context; from warp 0 the warpgroup's arrive is right
    cluster_arrive = mosaic_cluster_arrive_from_warp if in_one_warp else plgpu.barrier_arrive

    def wait_free(consumed, peer_free, block, slot):
        plgpu.barrier_wait(consumed.at[slot])
        if blocks.kv_multicast:
            @pl.when(block < shared_blocks)
            def _():
                cluster_arrive(peer_free.at[slot])   # in both members
                plgpu.barrier_wait(peer_free.at[slot])

    k_peer_free, v_peer_free = cluster_barriers[:2] if blocks.kv_multicast else (None, None)

    def loads():
        for block in range(num_stages):   # fill the ring (tile_blocks >= 1: block 0 always exists)
            if block == 0:
                fill(0)
            elif isinstance(tile_blocks, int):
                if block < tile_blocks:
                    fill(block)
            else:
                pl.when(block < tile_blocks)(functools.partial(fill, block))

        @pl.loop(num_stages, tile_blocks)
        def _(block):
            slot = kernel.slot_of(block)
            wait_free(k_consumed, k_peer_free, block, slot)
            load(block, slot, kernel.k_ref, k_smem, k_ready)
            wait_free(v_consumed, v_peer_free, block, slot)
            load(block, slot, kernel.v_ref, v_smem, v_ready)
            load_mask(block, slot)   # its slot is free once V's is: consumers read it before releasing V

    if in_one_warp:   # warp 0 loads, the other three wait after the map
        @pl.core_map(plgpu.WarpMesh(axis_name=PRODUCER_WARP_AXIS))
        def _():
            pl.when(lax.axis_index(PRODUCER_WARP_AXIS) == 0)(loads)
    else:
        loads()


def _query_tile(num_q_tiles: int, causal: bool):
    tile = lax.axis_index(Q_TILE_AXIS)
    return num_q_tiles - 1 - tile if causal else tile   # causal: heaviest tiles first


def attention_kernel(q_ref, k_ref, v_ref, out_ref, scoped, *, causal: bool, sm_scale: float, seq_len: int,
                     num_q_tiles: int, head_dim: int, blocks: MgpuBlockSizes, dtype, interpret=False,
                     lse_ref=None, mask_ref=None, bounds_ref=None):
    """One CUDA block. q, k, v, out: [B, S, H, hd] refs in GMEM; lse_ref: [B, H, S] fp32 or None;
    mask_ref: [B, mask_len] uint8 (nonzero = valid key) or None; bounds_ref (with mask_ref only): [B,
    BOUNDS_ROW] int32, the clean-block bounds, or None; scoped: (shared memory, barriers) of all
    warpgroups, and with mask_ref (the mask's ring, its barriers, and with bounds_ref the bounds' SMEM and
    barriers)."""
    plgpu, pl_module = (InterpretPlgpu(scoped), InterpretPallas()) if interpret else (plgpu_module(), pl)
    wg = lax.axis_index("wg")
    mask_smem, mask_ready, *bounds_scoped = scoped[2] if mask_ref is not None else (None, None)
    bounds_smem, bounds_ready = bounds_scoped if bounds_ref is not None else (None, None)
    kernel = _Kernel(plgpu, pl_module, causal, sm_scale, seq_len, head_dim, blocks, dtype, interpret,
                     q_ref, k_ref, v_ref, out_ref, lse_ref, scoped[0], scoped[1], wg, mask_ref, mask_smem, mask_ready,
                     bounds_ref, bounds_smem, bounds_ready)
    num_wgs = blocks.num_compute_wgs
    batch, head = lax.axis_index(SEQUENCE_AXIS), lax.axis_index(HEAD_AXIS)
    if blocks.kv_multicast:   # the grid's tile axis counts pairs (see multicast_pair)
        tile_valid, tile, shared_blocks = multicast_pair(
            lax.axis_index(Q_TILE_AXIS), lax.axis_index(CLUSTER_AXIS), num_q_tiles, seq_len, blocks, causal)
    else:
        tile_valid, shared_blocks = None, None
        tile = _query_tile(num_q_tiles, causal)
    tile_start = tile * blocks.block_q

    def with_tile(condition):   # kv_multicast: a member with no tile only waits, below
        return condition & tile_valid if blocks.kv_multicast else condition

    @pl_module.when(with_tile(wg < num_wgs))
    def _():
        plgpu.set_max_registers(REGISTERS_PER_THREAD[num_wgs][0], action="increase")
        _consumer(kernel, batch, head, tile_start)

    _, tile_blocks = kv_block_range(tile_start, blocks.block_q, seq_len, blocks.block_kv, causal)

    @pl_module.when(with_tile(wg == num_wgs))
    def _():
        plgpu.set_max_registers(REGISTERS_PER_THREAD[num_wgs][1], action="decrease")
        _producer(kernel, batch, head, tile_blocks, shared_blocks)

    if blocks.kv_multicast:   # every warpgroup of both members: no block exits while its partner may
        done = scoped[1][-1]  # still arrive on its barriers or write into its shared memory
        plgpu.barrier_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])


def interpret_kernel(q_ref, k_ref, v_ref, out_ref, scoped, *, causal: bool, seq_len: int, num_q_tiles: int,
                     blocks: MgpuBlockSizes, **kwargs):
    """The kernel body in interpret mode, then waits for the barrier phases it leaves unobserved.

    The interpreter raises when a barrier is freed before every thread that waits on it has observed
    all its phases. On the GPU the kernel ends without waiting for the last token pass to consumer 0
    nor for the releases of the ring's last blocks (the producer has nothing left to load): harmless.
    """
    attention_kernel(q_ref, k_ref, v_ref, out_ref, scoped, causal=causal, seq_len=seq_len,
                     num_q_tiles=num_q_tiles, blocks=blocks, interpret=True, **kwargs)
    plgpu = plgpu_module()
    _, (_, _, _, k_consumed, v_consumed, tokens, *_), *_ = scoped
    num_stages = blocks.num_stages
    wg = lax.axis_index("wg")
    tile = _query_tile(num_q_tiles, causal)
    _, tile_blocks = kv_block_range(tile * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv, causal)

    if blocks.pingpong:
        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(tokens.at[0])

    @pl.when(wg == blocks.num_compute_wgs)
    def _():
        def drain(block, _):
            slot = lax.rem(block, jnp.int32(num_stages))
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])
        first = max(tile_blocks - num_stages, 0) if isinstance(tile_blocks, int) else jnp.maximum(
            tile_blocks - num_stages, 0)
        lax.fori_loop(first, tile_blocks, drain, None)
