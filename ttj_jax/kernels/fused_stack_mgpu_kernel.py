"""The Mosaic GPU whole-stack kernel: its body, in stages, and its build (`kernel_function`).

`fused_stack_mgpu.py` describes the design; the layout and limits live in `fused_stack_mgpu_layout.py`.
Stages of one CUDA block (three warpgroups): the producer (`_produce`) streams weight chunks through
the shared-memory ring; each consumer (`_Consumer.run`) loads its 64 rows, runs every layer
(`_layer`: LN1, q/k/v projection, attention, out-projection, LN2, MLP) and the epilogue (final
LayerNorm, store).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ttj_jax.kernels.attention_common import MASKED_SCORE
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
    NUM_CONSUMERS,
    NUM_SLOTS,
    NUM_VECS,
    SMEM_BUDGET_BYTES,
    SUPPORTED_SEQ_LENS,
    TILE_ROWS,
    WG_ROWS,
    blocks,
    default_fast_erf,
    key_blocks,
    model_error,
    smem_bytes,
    tile_count,
    widths,
)
from ttj_jax.kernels.pallas_common import GEMM_DTYPE, erf
from ttj_jax.numerics import LAYER_NORM_EPS

# Registers per thread, consumer and producer: 2 * 232 + 40 = 504 = 3 * 168, the launch allotment
# (240 and 32 hung).
_REGISTERS = (232, 40)
LOG2_E = math.log2(math.e)
# Masked builds with at most this many heads branch once per tile on whether its tokens are all valid
# (_Consumer.run). With both layer loops in it, the 16-head packed build's layout inference recursed past
# Python's limit while lowering (Mosaic GPU, jax 0.10.2); more heads than 4 take the rows stack anyway
# (planner), so those builds keep the single masked loop.
ALL_VALID_BRANCH_MAX_HEADS = 4
# x's and y's dtypes a build reads and writes (kernel_function's io_dtype).
IO_DTYPES = ("float32", "float16", "bfloat16")
# Grid axis names share a namespace with enclosing mesh axes (see flash_attention_mgpu.py): never "batch".
GRID_AXIS = "ttj_fsm_sequence"
# Profiler regions per warpgroup (profile_dir builds): 16 bytes each in shared memory, of the ~8 KB the
# kernel leaves; a consumer records 17 per layer plus 2, so room for 9 layers.
PROFILE_SPACE = 160


def _plgpu():
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415 - imports absl; lazily
    return plgpu


# --- GELU -------------------------------------------------------------------------------------------
# The fast erf (Abramowitz & Stegun 7.1.26): erf(a) = 1 - t P(t) exp(-a^2), t = 1 / (1 + p a),
# |error| <= 1.5e-7 for a >= 0 (odd symmetry below 0), with t = rsqrt(1 + p a)^2 and a base-2
# exponential, both on the special-function unit: 8 multiply-adds and two MUFU operations instead of
# the rational erf's 13 multiply-adds and a divide. Its error is far below the fp16 rounding of the
# GELU's output.
AS_P = 0.3275911
AS_COEFFICIENTS = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)   # a5 .. a1
LOG2_E_ERF = 1.4426950408889634


def one_plus_erf_fast(z):
    """1 + erf(z) by A&S 7.1.26; jnp, so it runs in the kernel and in interpret mode."""
    a = jnp.abs(z)
    r = lax.rsqrt(1.0 + AS_P * a)
    t = r * r
    poly = jnp.float32(AS_COEFFICIENTS[0])
    for c in AS_COEFFICIENTS[1:]:
        poly = poly * t + c
    q = poly * t * jnp.exp2(a * a * -LOG2_E_ERF)      # 1 - erf(|z|)
    return jnp.where(z >= 0.0, 2.0 - q, q)


def gelu(pre, fast_erf: bool):
    """0.5 pre (1 + erf(pre / sqrt 2)) in fp32, with the rational or the fast erf."""
    if not fast_erf:
        return 0.5 * pre * (1.0 + erf(pre * 0.7071067811865476))
    return 0.5 * pre * one_plus_erf_fast(pre * 0.7071067811865476)


# --- The kernel body ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Build:
    """The static facts one kernel build is traced with."""
    num_layers: int
    num_heads: int
    seq_len: int
    causal: bool
    d_model: int
    fast_erf: bool
    key_blocks: str        # "own", "split" or "all" (layout.key_blocks)
    interpret: bool | str  # False, True or "detect_races"
    profile: bool
    masked: bool = False   # a token mask: invalid keys left out of every softmax, invalid rows of y zeroed
    io_dtype: str = "float32"   # x's and y's dtype: "float32", or a half dtype staged through the residual

    def phase(self, name):
        """A named region for Mosaic GPU's profiler; nothing at all otherwise (the lowering is pinned)."""
        return jax.named_scope(name) if self.profile else contextlib.nullcontext()


def _stack_kernel(x_ref, mask_ref, mats_ref, vecs_ref, y_ref, scoped, *, build: _Build):
    """mask_ref: None, or (masked builds) the token mask [batch, seq_len] uint8, nonzero = valid."""
    (x_smem, k_smem, v_smem, w_smem, vec_smem, *stages), barriers = scoped
    io_smem = None
    if build.io_dtype != "float32":   # the residual's union: (fp32 residual, half x / y staging over it)
        x_smem, io_smem = x_smem
    mask_smem = mask_ready = None
    if build.masked:   # kernel_function adds the mask's buffer before the staging ones, its barrier last
        mask_smem, mask_ready, barriers = stages.pop(0), barriers[-1], barriers[:-1]
    wg = lax.axis_index("wg")
    tile = lax.axis_index(GRID_AXIS)

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        _Consumer(build, wg, tile, (x_ref, y_ref), (x_smem, k_smem, v_smem, w_smem, vec_smem), stages,
                  barriers, (mask_smem, mask_ready), io_smem).run()

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        _produce(build, mats_ref, vecs_ref, w_smem, vec_smem, barriers, (mask_ref, mask_smem, mask_ready), tile)


def _produce(build: _Build, mats_ref, vecs_ref, w_smem, vec_smem, barriers, mask=(None, None, None), tile=None):
    """The producer warpgroup: the tile's token mask (masked builds) and the vectors once, then every
    layer's six chunks through the two-slot ring, each as soon as both consumers released its slot
    (chunk j of every layer sits in slot j % 2)."""
    plgpu = _plgpu()
    _, vec_ready, w_ready, w_consumed, _, _ = barriers
    plgpu.set_max_registers(_REGISTERS[1], action="decrease")
    mask_ref, mask_smem, mask_ready = mask
    if build.masked:   # the tile's 128 mask bytes (its sequences' rows, contiguous): one copy
        # (One copy per sequence put the second one at shared-memory byte 32 or 64 for S < 128, and a bulk
        # tensor copy's destination must be 128-byte aligned: CUDA_ERROR_MISALIGNED_ADDRESS on the H200 at
        # S=32, which GPU interpret mode does not model.)
        plgpu.copy_gmem_to_smem(mask_ref.at[tile], mask_smem, mask_ready.at[0])
    plgpu.copy_gmem_to_smem(vecs_ref, vec_smem, vec_ready.at[0])
    for which in range(NUM_SLOTS):   # layer 0 fills the ring
        plgpu.copy_gmem_to_smem(mats_ref.at[0, which], w_smem.at[which], w_ready.at[which])

    @pl.loop(0, build.num_layers)
    def _(layer):
        for which in range(CHUNKS_PER_LAYER):
            # the chunk NUM_SLOTS after this one goes into this one's slot once both consumers are done
            later_layer, later = divmod(which + NUM_SLOTS, CHUNKS_PER_LAYER)
            slot = which % NUM_SLOTS

            def load(slot=slot, later=later, later_layer=later_layer):
                with build.phase("producer_wait_consumed"):
                    plgpu.barrier_wait(w_consumed.at[slot])
                plgpu.copy_gmem_to_smem(mats_ref.at[layer + later_layer, later], w_smem.at[slot],
                                        w_ready.at[slot])
            if later_layer == 0:
                load()
            else:
                pl.when(layer + 1 < build.num_layers)(load)

    for which in range(CHUNKS_PER_LAYER - NUM_SLOTS, CHUNKS_PER_LAYER):   # drain: observe the last releases
        plgpu.barrier_wait(w_consumed.at[which % NUM_SLOTS])


class _Consumer:
    """One consumer warpgroup's 64 rows through every layer. Its residual lives in shared memory (leaving
    registers for the attention); h, q and the contexts are fp16 registers (wgmma A operands)."""

    def __init__(self, build: _Build, wg, tile, gmem, smem, stages, barriers, mask=(None, None), io_smem=None):
        self.plgpu = _plgpu()
        self.b = build
        self.wg, self.tile = wg, tile
        self.x_ref, self.y_ref = gmem
        self.x_smem, self.k_smem, self.v_smem, self.w_smem, self.vec_smem = smem
        self.stages = stages
        (self.x_ready, self.vec_ready, self.w_ready, self.w_consumed, self.kv_written,
         self.kv_free) = barriers
        self.mask_smem, self.mask_ready = mask   # masked builds: the tile's token mask, uint8 per row
        # Half-dtype builds: this consumer's x and y in their own dtype, [64, d], over the first half of
        # its own fp32 residual rows (the union's [consumer, 2, 64, d] view), which the residual takes
        # over once x is read and gives back once the final LayerNorm has read it.
        self.io_smem = None if io_smem is None else io_smem.at[wg, 0]
        self.hd, self.width, _ = widths(build.d_model, build.num_heads)
        self.num_blocks, self.heads_per_block = blocks(build.d_model, build.num_heads)
        self.seqs_per_tile = TILE_ROWS // build.seq_len
        self.keys = TILE_ROWS if build.key_blocks == "all" else WG_ROWS   # keys per score tile
        self.wgmma_layout = self.plgpu.Layout.WGMMA
        self.col_layout = self.plgpu.Layout.WGMMA.reduce(0)
        self.row_layout = self.plgpu.Layout.WGMMA.reduce(1)
        self.score_scale = self.hd ** -0.5 * LOG2_E
        # Two key blocks: both Q @ K^T issued before either is read, both P @ V in one accumulator.
        # GPU interpret mode cannot (see chained_products): one at a time there, the same fp32 values.
        self.chain = not build.interpret

    # --- stages ---

    def run(self):
        plgpu, b = self.plgpu, self.b
        plgpu.set_max_registers(_REGISTERS[0], action="increase")
        self.rows_smem = self.x_smem.at[self.wg]
        io_smem = self.rows_smem if self.io_smem is None else self.io_smem
        for src, dst in self.row_copies(self.x_ref, io_smem):
            plgpu.copy_gmem_to_smem(src, dst, self.x_ready.at[self.wg])
        with b.phase("wait_inputs"):
            plgpu.barrier_wait(self.vec_ready.at[0])
            plgpu.barrier_wait(self.x_ready.at[self.wg])
            if b.masked:
                plgpu.barrier_wait(self.mask_ready.at[0])
        if self.io_smem is not None:   # x to fp32, in place: every thread's loads before any store over them
            x = self.cast(self.io_smem[...], self.wgmma_layout).astype(jnp.float32)
            plgpu.commit_smem()
            self.rows_smem[...] = x
        assert CHUNKS_PER_LAYER % NUM_SLOTS == 0
        # Both consumers arrive once before the loop, so that every layer can start with a wait for
        # the other consumer to be done reading the previous layer's k and v.
        plgpu.barrier_arrive(self.kv_free.at[0])

        if b.masked and b.num_heads <= ALL_VALID_BRANCH_MAX_HEADS:
            # One branch per tile around the whole layer loop: a tile whose tokens are all valid (the
            # harness's mask at padding 0) runs the mask-free build's layers, with no key bias.
            all_valid = self.tile_all_valid()
            pl.when(all_valid)(lambda: self.layers(masked=False))
            pl.when(jnp.logical_not(all_valid))(lambda: self.layers(masked=True))
        else:
            self.layers(masked=b.masked)
        self.epilogue()

    def layers(self, masked: bool):
        b = self.b

        @pl.loop(0, b.num_layers)
        def _layer(layer):
            with b.phase("ln1"):
                h = self.layer_norm(self.load_x(), layer, LN1_W, LN1_B).astype(GEMM_DTYPE)
            self.layer(layer, h, masked)

    def layer(self, layer, h, masked: bool):
        q = self.qkv_projection(layer, h)
        with self.b.phase("attention"):
            ctx = self.attention(q, masked)
        self.plgpu.barrier_arrive(self.kv_free.at[0])
        x = self.out_projection(layer, ctx)
        self.mlp(layer, x)

    def qkv_projection(self, layer, h):
        """q (fp16 registers, every block); k and v into shared memory for both consumers, then the
        kv_written barrier pair orders the writes against the other consumer's reads."""
        plgpu, b = self.plgpu, self.b
        with b.phase("q_proj"):
            w = self.chunk_wait(0)
            q = self.project(layer, h, w, BQ)
            self.chunk_done(0)
        with b.phase("wait_kv_free"):
            plgpu.barrier_wait(self.kv_free.at[0])   # the other consumer is done with the last k and v
        for slot, (bias_index, dst) in enumerate(((BK, self.k_smem), (BV, self.v_smem)), start=1):
            with b.phase("kv_proj"):
                w = self.chunk_wait(slot)

                def store(block, value, dst=dst):
                    if b.key_blocks != "all":
                        dst[block, self.wg] = value
                    else:
                        dst[block, pl.ds(self.wg * WG_ROWS, WG_ROWS), :] = value
                self.project(layer, h, w, bias_index, store)
                self.chunk_done(slot)
        plgpu.commit_smem()
        plgpu.barrier_arrive(self.kv_written.at[0])
        with b.phase("wait_kv_written"):
            plgpu.barrier_wait(self.kv_written.at[0])
        return q

    def out_projection(self, layer, ctx):
        """x + bout + sum over blocks of ctx_b Wout_b, in fp32."""
        with self.b.phase("out_proj"):
            w = self.chunk_wait(3)
            x = self.load_x() + self.row_bcast(self.vec(layer, BOUT), (WG_ROWS, self.b.d_model))
            x = self.add_products(x, [(ctx[block], w.at[block]) for block in range(self.num_blocks)])
            self.chunk_done(3)
        return x

    def mlp(self, layer, x):
        """x + b2 + sum_j GELU(LN2(x) W1_j + b1_j) W2_j over the width-wide hidden blocks j (why ffn_dim
        must equal d_model), written back to the residual."""
        b = self.b
        with b.phase("ln2"):
            h2 = self.layer_norm(x, layer, LN2_W, LN2_B).astype(GEMM_DTYPE)
        with b.phase("mlp_in"):
            w = self.chunk_wait(4)

            def gelu_block(block, pre):
                pre = pre + self.row_bcast(self.vec(layer, B1, block * self.width, self.width), pre.shape)
                return gelu(pre, b.fast_erf).astype(GEMM_DTYPE)
            hidden = self.matmuls(h2, [w.at[block] for block in range(self.num_blocks)], gelu_block)
            self.chunk_done(4)
        with b.phase("mlp_out"):
            w = self.chunk_wait(5)
            x = x + self.row_bcast(self.vec(layer, B2), x.shape)
            x = self.add_products(x, [(hidden[block], w.at[block]) for block in range(self.num_blocks)])
            self.chunk_done(5)
            self.rows_smem[...] = x

    def epilogue(self):
        """The final LayerNorm, stored through shared memory to y."""
        plgpu, b = self.plgpu, self.b
        # Observe the last kv_free phase too (a no-op on the GPU; GPU interpret mode checks that every
        # phase of a barrier is waited by the threads that wait on it).
        plgpu.barrier_wait(self.kv_free.at[0])
        with b.phase("final_ln"):
            y = self.layer_norm(self.load_x(), b.num_layers, 0, 1)
            if b.masked:   # invalid tokens' rows are zeros (docs/spec.md)
                valid = self.cast(self.mask_smem[pl.ds(self.wg * WG_ROWS, WG_ROWS)], self.row_layout)
                keep = jnp.where(valid != 0, 1.0, 0.0).astype(jnp.float32)
                y = jnp.where(self.col_bcast(keep, y.shape) != 0.0, y, 0.0)
            if self.io_smem is None:
                out_smem = self.rows_smem
            else:   # every thread's residual loads (the LayerNorm's) before any half store over them
                out_smem = self.io_smem
                plgpu.commit_smem()
                y = y.astype(jnp.dtype(b.io_dtype))
            out_smem[...] = y
        plgpu.commit_smem()
        for dst, src in self.row_copies(self.y_ref, out_smem):
            plgpu.copy_smem_to_gmem(src, dst)
        plgpu.wait_smem_to_gmem(0)

    # --- attention ---

    def attention(self, q, masked: bool):
        """Per block, its context (fp16 [64, width]) over the keys this consumer scores; masked: each
        score block takes the tile's key bias."""
        if self.b.key_blocks == "split":   # consumer 0: its diagonal block; consumer 1: block 0, then its own
            return lax.cond(self.wg == 0, lambda: self.attention_blocks(q, (0,), masked),
                            lambda: self.attention_blocks(q, (0, 1), masked))
        return self.attention_blocks(q, (self.wg,) if self.b.key_blocks == "own" else (None,), masked)

    def tile_all_valid(self):
        """Whether every one of the tile's 128 tokens is valid (masked builds): a uniform scalar, the AND of
        its mask bytes (a tree of 128 scalar loads), bit 0 set in every one. A torch bool is 0 or 1; another
        nonzero byte with bit 0 clear only sends the tile to the masked attention, which reads nonzero as
        valid. (A 32-word read would need the buffer bitcast, which Pallas refuses for a 1-D ref.)"""
        level = [self.mask_smem[i] for i in range(TILE_ROWS)]
        while len(level) > 1:
            level = [lax.bitwise_and(a, b) for a, b in zip(level[::2], level[1::2])]
        one = jnp.array(1, level[0].dtype)
        return lax.bitwise_and(level[0], one) == one

    def attention_blocks(self, q, key_ids, masked: bool):
        """Key blocks named by key_ids (None: all 128 keys). One head per block: softmax(q k^T) v. Packed
        heads: per sub-head s of the block, q_s = q with the other heads' columns zeroed (they add exact
        zeros to q_s k^T), the softmax with the real head_dim's scale, and of P_s v only s's columns kept
        (an exact select: the sub-heads' columns are disjoint)."""
        ctx = []
        for block in range(self.num_blocks):
            def kv(ref, key_id, block=block):
                return ref.at[block] if key_id is None else ref.at[block, key_id]
            if self.heads_per_block == 1:
                ctx.append(self.head_context(q[block], kv, key_ids, masked).astype(GEMM_DTYPE))
                continue
            out = None
            for sub in range(self.heads_per_block):
                # a sub-head's columns: column // hd == sub (hd is a power of two, 8 or 16)
                column = self.iota((WG_ROWS, self.width), 1)
                mine = lax.shift_right_logical(column, jnp.int32(self.hd.bit_length() - 1)) == sub
                q_sub = jnp.where(mine, q[block], 0.0)
                out = jnp.where(mine, self.head_context(q_sub, kv, key_ids, masked), 0.0 if out is None else out)
            ctx.append(out.astype(GEMM_DTYPE))
        return ctx

    def head_context(self, q_head, kv, key_ids, masked: bool):
        """softmax(q_head k^T) v (fp32 [64, width]) over the key blocks named; the last key block is the
        diagonal one (masked by allowed_keys), any before it are wholly in the past (no mask)."""
        scores = self.block_scores(q_head, [kv(self.k_smem, key_id) for key_id in key_ids])
        if masked:
            scores = [s + self.row_bcast(self.key_bias(key_id), s.shape) for s, key_id in zip(scores, key_ids)]
        return self.block_context(self.softmax_probabilities(scores),
                                  [kv(self.v_smem, key_id) for key_id in key_ids])

    def key_bias(self, key_id):
        """0 for a valid key, MASKED_SCORE for an invalid one, over key block key_id's keys (None: all
        128). Finite, so a row whose keys are all invalid (an invalid token's) stays finite; its output
        row is zeroed in the epilogue, and valid rows give its key weight 0."""
        start, size = (0, TILE_ROWS) if key_id is None else (key_id * WG_ROWS, WG_ROWS)
        valid = self.cast(self.mask_smem[pl.ds(start, size)], self.col_layout)
        return jnp.where(valid != 0, 0.0, MASKED_SCORE).astype(jnp.float32)

    def softmax_probabilities(self, scores):
        """P (fp16) per key block from the fp32 score blocks: the diagonal (last) block masked, base-2
        softmax over all blocks, normalised in fp32 before the rounding."""
        allowed = self.allowed_keys()
        if allowed is not None:   # every row keeps its own key: the row max is finite
            scores[-1] = jnp.where(allowed, scores[-1], -jnp.inf)
        m = scores[0].max(axis=1)
        for s in scores[1:]:
            m = jnp.maximum(m, s.max(axis=1))
        m = m * self.score_scale
        ps = [jnp.exp2(s * self.score_scale - self.col_bcast(m, s.shape)) for s in scores]
        total = ps[0].sum(axis=1)
        for p in ps[1:]:
            total = total + p.sum(axis=1)
        inverse = 1.0 / total
        return [(p * self.col_bcast(inverse, p.shape)).astype(GEMM_DTYPE) for p in ps]

    def allowed_keys(self):
        """Mask of the (64 query rows, `keys` keys) score tile, or None (rebuilt per head rather than
        kept live)."""
        b = self.b
        if b.key_blocks != "all":   # a diagonal 64 x 64 block: rows and keys of one consumer
            query, key = self.iota((WG_ROWS, WG_ROWS), 0), self.iota((WG_ROWS, WG_ROWS), 1)
            if b.seq_len >= WG_ROWS:   # within one sequence
                return key <= query if b.causal else None
            if b.causal:   # 0 <= query - key <= query % S, as one unsigned comparison
                return ((query - key).astype(jnp.uint32)
                        <= lax.bitwise_and(query, jnp.int32(b.seq_len - 1)).astype(jnp.uint32))
            shift = jnp.int32(b.seq_len.bit_length() - 1)
            return lax.shift_right_logical(query, shift) == lax.shift_right_logical(key, shift)
        # all 128 keys: S = 128, one sequence per tile
        query = self.wg * WG_ROWS + self.iota((WG_ROWS, TILE_ROWS), 0)
        key = self.iota((WG_ROWS, TILE_ROWS), 1)
        return key <= query if b.causal else None

    def block_scores(self, q_head, k_refs):
        if not (self.chain and len(k_refs) > 1):
            return [self.matmul(None, q_head, k_ref, transpose_b=True) for k_ref in k_refs]

        def body(*acc_refs):
            for acc_ref, k_ref in zip(acc_refs, k_refs):
                self.plgpu.wgmma(acc_ref, q_head, k_ref.transpose((1, 0)))
            return [acc_ref[...] for acc_ref in acc_refs]
        return pl.run_scoped(body, *[self.plgpu.ACC((WG_ROWS, k_ref.shape[0]), jnp.float32) for k_ref in k_refs])

    def block_context(self, ps, v_refs):   # fp32 sum of the blocks' P @ V, block 0 first
        if self.chain and len(v_refs) > 1:
            return self.chained_products(list(zip(ps, v_refs)), (WG_ROWS, v_refs[0].shape[1]), transpose_b=False)
        out = None
        for p, v_ref in zip(ps, v_refs):
            out = self.matmul(out, p, v_ref)
        return out

    # --- primitives ---

    def row_copies(self, gmem_ref, rows_smem):
        """(gmem, smem) pairs of this consumer's 64 rows of x or y: one sequence half, or 64 // S sequences."""
        seq_len, wg, tile = self.b.seq_len, self.wg, self.tile
        if seq_len == TILE_ROWS:
            return [(gmem_ref.at[tile, pl.ds(wg * WG_ROWS, WG_ROWS)], rows_smem)]
        per_wg = WG_ROWS // seq_len
        return [(gmem_ref.at[tile * self.seqs_per_tile + wg * per_wg + j], rows_smem.at[pl.ds(j * seq_len, seq_len)])
                for j in range(per_wg)]

    def cast(self, value, layout):   # layout hints for Mosaic GPU; GPU interpret mode has no layout_cast
        return value if self.b.interpret else self.plgpu.layout_cast(value, layout)

    def iota(self, shape, dimension):
        if self.b.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dimension)
        return self.plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=self.wgmma_layout)

    def stage(self, shape, role="a"):   # GPU interpret mode only: this warpgroup's staging buffer
        return self.stages[_staging_shapes(self.b.d_model, self.width, self.keys).index((role, tuple(shape)))].at[self.wg]

    def vec(self, layer, which, start=0, size=None):
        return self.cast(self.vec_smem[layer, which, pl.ds(start, self.b.d_model if size is None else size)],
                         self.col_layout)

    @staticmethod
    def row_bcast(v, shape):    # (n,) over columns -> (64, n)
        return lax.broadcast_in_dim(v, shape, [1])

    @staticmethod
    def col_bcast(v, shape):    # (64,) over rows -> (64, n)
        return lax.broadcast_in_dim(v, shape, [0])

    def layer_norm(self, x, layer, w_index, b_index):
        d_model = self.b.d_model
        mean = x.sum(axis=1) * (1.0 / d_model)
        centered = x - self.col_bcast(mean, x.shape)
        var = (centered * centered).sum(axis=1) * (1.0 / d_model)
        scaled = centered * self.col_bcast(lax.rsqrt(var + LAYER_NORM_EPS), x.shape)
        return (scaled * self.row_bcast(self.vec(layer, w_index), x.shape)
                + self.row_bcast(self.vec(layer, b_index), x.shape))

    def load_x(self):
        return self.cast(self.rows_smem[...], self.wgmma_layout)

    # Chunk `which` of every layer sits in slot which % NUM_SLOTS (CHUNKS_PER_LAYER % NUM_SLOTS == 0).
    def chunk_wait(self, which):
        with self.b.phase("wait_weights"):
            self.plgpu.barrier_wait(self.w_ready.at[which % NUM_SLOTS])
        return self.w_smem.at[which % NUM_SLOTS]

    def chunk_done(self, which):
        self.plgpu.barrier_arrive(self.w_consumed.at[which % NUM_SLOTS])

    def project(self, layer, h, w, bias_index, store=None):
        """Every block's h @ W_block + b_block in fp16: returned, or handed to store(block, value)."""
        def finish(block, acc):
            value = (acc + self.row_bcast(self.vec(layer, bias_index, block * self.width, self.width),
                                          acc.shape)).astype(GEMM_DTYPE)
            return value if store is None else store(block, value)
        return self.matmuls(h, [w.at[block] for block in range(self.num_blocks)], finish)

    def matmul(self, acc, a, b, transpose_b=False):
        """acc + a @ b (b: a shared-memory ref; transpose_b: a @ b^T) in a fresh accumulator, waited for."""
        plgpu = self.plgpu

        def body(acc_ref):
            if self.b.interpret:
                # GPU interpret mode's wgmma takes A from shared memory only and no transposed views:
                # stage A, and B^T, in (untiled) buffers of this warpgroup.
                a_stage = self.stage(a.shape)
                a_stage[...] = a
                if transpose_b:
                    bt_stage = self.stage((b.shape[1], b.shape[0]), "bt")
                    bt_stage[...] = b[...].T
                    b_operand = bt_stage
                else:
                    b_operand = b
                plgpu.wgmma(acc_ref, a_stage, b_operand)
            else:
                plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if transpose_b else b)
            return acc_ref[...]
        out_cols = b.shape[0] if transpose_b else b.shape[1]
        product = pl.run_scoped(body, plgpu.ACC((a.shape[0], out_cols), jnp.float32))
        return product if acc is None else acc + product

    def matmuls(self, a, bs, then):
        """[then(i, a @ bs[i]) for each i]: one wgmma at a time, each finished by `then` before the next."""
        return [then(i, self.matmul(None, a, b)) for i, b in enumerate(bs)]

    def chained_products(self, pairs, shape, transpose_b, init=None):
        """sum_i a_i @ b_i (b_i^T with transpose_b) in one wgmma accumulator of `shape`, all issued with no
        wait in between, starting from `init` (zero if None). GPU build only: GPU interpret mode can
        neither store into an accumulator nor take register-A or transposed-view operands."""
        plgpu = self.plgpu

        def body(acc_ref):
            if init is not None:
                acc_ref[...] = init
            for a, b in pairs:
                plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if transpose_b else b)
            return acc_ref[...]
        return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

    def add_products(self, x, pairs):
        """x + sum_i a_i @ b_i^T. On the GPU x itself is the accumulator's initial value and every product
        is chained into it: no second [64, d] fp32 value live beside x and one wait. In GPU interpret
        mode: a zero accumulator (operands staged), added to x."""
        if not self.b.interpret:
            return self.chained_products(pairs, x.shape, transpose_b=True, init=x)

        def body(acc_ref):
            for a, b in pairs:
                a_stage, bt_stage = self.stage(a.shape), self.stage((b.shape[1], b.shape[0]), "bt")
                a_stage[...] = a
                bt_stage[...] = b[...].T
                self.plgpu.wgmma(acc_ref, a_stage, bt_stage)
            return acc_ref[...]
        return x + pl.run_scoped(body, self.plgpu.ACC(x.shape, jnp.float32))


# --- The build ----------------------------------------------------------------------------------------

@functools.cache
def _staging_shapes(d_model: int, width: int, keys: int = TILE_ROWS) -> list[tuple[str, tuple[int, int]]]:
    """The wgmma operand buffers GPU interpret mode stages through shared memory (per warpgroup), as
    (role, shape): A ("a") as h or h2 (64 x d), q, ctx or hidden (64 x width), P (64 x keys); B^T ("bt")
    as k^T (width x keys) or a transposed out-projection / MLP-out block (width x d). One buffer per
    distinct pair, in a fixed order: an A and a B^T of one shape never share."""
    shapes = [("a", (WG_ROWS, d_model)), ("a", (WG_ROWS, width)), ("a", (WG_ROWS, keys)),
              ("bt", (width, keys)), ("bt", (width, d_model))]
    return sorted(set(shapes))


def _compiler_params(profile_dir: str | None = None):
    plgpu = _plgpu()
    semantics = plgpu.LoweringSemantics.Warpgroup
    if profile_dir:
        return plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics,
                                    profile_space=PROFILE_SPACE, profile_dir=profile_dir)
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics)


def _interpret_params(detect_races: bool = False):
    from ttj_jax.compat import mosaic_gpu_interpret_params  # noqa: PLC0415
    return mosaic_gpu_interpret_params(detect_races=detect_races)


def kernel_function(batch: int, seq_len: int, num_heads: int, num_layers: int, causal: bool,
                    interpret: bool | str = False, *, d_model: int = D_MODEL, profile_dir: str | None = None,
                    masked: bool = False, io_dtype: str = "float32"):
    """The bare kernel for x [batch, seq_len, d_model] fp32: f(x, mats, vecs) -> y, nothing but the Mosaic
    GPU call (what a launcher outside jax compiles); batch must be a multiple of 128 // seq_len.
    interpret: False (the GPU kernel), True or "detect_races" (Mosaic GPU's interpret mode on a CPU, the
    latter with its race detector). profile_dir: every stage a named profiler region per warpgroup, and
    every call writes a Perfetto trace there (GPU only; bench/fused_stack_mgpu_profile.py reads it).
    masked: f(x, mask, mats, vecs) -> y with mask [batch * seq_len // 128, 128] uint8, the [batch, seq_len]
    token mask's bytes as one 128-byte row per tile (nonzero = valid; a torch bool tensor's bytes, as they
    are): any mask, prefix or not, causal or not (docs/spec.md).
    io_dtype: x's and y's dtype (IO_DTYPES). A half dtype is read and written as it is: the layers compute
    as for fp32 x (x converted exactly, y rounded once at the end, as a cast of the fp32 build's y), with
    x and y staged through the residual's own shared memory."""
    if seq_len not in SUPPORTED_SEQ_LENS:
        raise ValueError(f"{seq_len=} must be one of {SUPPORTED_SEQ_LENS}")
    error = model_error(d_model, num_heads, d_model)
    if error:
        raise ValueError(error)
    if io_dtype not in IO_DTYPES:
        raise ValueError(f"{io_dtype=} must be one of {IO_DTYPES}")
    seqs_per_tile = TILE_ROWS // seq_len
    if batch < 1 or batch % seqs_per_tile:
        raise ValueError(f"{batch=} must be a positive multiple of {seqs_per_tile} at {seq_len=}")
    needed = smem_bytes(num_layers, d_model=d_model, num_heads=num_heads, masked=masked)
    if needed > SMEM_BUDGET_BYTES:
        raise ValueError(f"num_layers={num_layers} needs {needed} bytes of shared memory, "
                         f"more than {SMEM_BUDGET_BYTES}")
    plgpu = _plgpu()
    _, width, vec_len = widths(d_model, num_heads)
    num_blocks, _ = blocks(d_model, num_heads)   # the chunk dimension of mats, k and v

    def fp16_transforms(minor: int):
        swizzle = min(128, minor * 2)
        return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

    kv_transforms = fp16_transforms(width)
    num_tiles = tile_count(batch, seq_len)
    layout = key_blocks(seq_len, causal, num_tiles)
    keys = TILE_ROWS if layout == "all" else WG_ROWS   # k, v: [N, 128, w] or [N, 2, 64, w]
    kv_shape = (num_blocks, TILE_ROWS, width) if keys == TILE_ROWS else (num_blocks, NUM_CONSUMERS, keys, width)
    residual = plgpu.SMEM((NUM_CONSUMERS, WG_ROWS, d_model), jnp.float32)
    if io_dtype != "float32":   # consumer c's half x / y at [c, 0]: the first half of its residual rows
        staging = plgpu.SMEM((NUM_CONSUMERS, 2, WG_ROWS, d_model), jnp.dtype(io_dtype))
        # (GPU interpret mode takes no aliased refs: there the staging buffer is a buffer of its own.)
        residual = (residual, staging) if interpret else plgpu.RefUnion(residual, staging)
    smem = (residual,                                                                       # residual
            plgpu.SMEM(kv_shape, GEMM_DTYPE, transforms=kv_transforms),   # k
            plgpu.SMEM(kv_shape, GEMM_DTYPE, transforms=kv_transforms),   # v
            plgpu.SMEM((NUM_SLOTS, num_blocks, d_model, width), GEMM_DTYPE, transforms=kv_transforms),  # ring
            plgpu.SMEM((num_layers + 1, NUM_VECS, vec_len), jnp.float32))                   # vectors
    if masked:   # the tile's token mask, one byte a row
        smem += (plgpu.SMEM((TILE_ROWS,), jnp.uint8),)
    if interpret:   # wgmma operand staging for GPU interpret mode (see _Consumer.matmul)
        smem += tuple(plgpu.SMEM((NUM_CONSUMERS,) + shape, GEMM_DTYPE)
                      for _, shape in _staging_shapes(d_model, width, keys))
    copies_per_wg = 1 if seq_len == TILE_ROWS else WG_ROWS // seq_len
    barriers = (plgpu.Barrier(num_arrivals=copies_per_wg, num_barriers=NUM_CONSUMERS),   # x_ready
                plgpu.Barrier(num_arrivals=1, num_barriers=1),                           # vec_ready
                plgpu.Barrier(num_arrivals=1, num_barriers=NUM_SLOTS),                   # w_ready
                plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=NUM_SLOTS),       # w_consumed
                plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=1),               # kv_written
                plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=1))               # kv_free
    if masked:
        barriers += (plgpu.Barrier(num_arrivals=1, num_barriers=1),)                    # mask_ready
    build = _Build(num_layers=num_layers, num_heads=num_heads, seq_len=seq_len, causal=causal, d_model=d_model,
                   fast_erf=default_fast_erf(batch, seq_len, causal), key_blocks=layout, interpret=interpret,
                   profile=bool(profile_dir), masked=masked, io_dtype=io_dtype)
    body = functools.partial(_stack_kernel, build=build)

    if masked:
        def entry(x_ref, mask_ref, mats_ref, vecs_ref, y_ref):
            pl.run_scoped(lambda *scoped: body(x_ref, mask_ref, mats_ref, vecs_ref, y_ref, scoped), smem, barriers,
                          collective_axes="wg")
    else:
        def entry(x_ref, mats_ref, vecs_ref, y_ref):
            pl.run_scoped(lambda *scoped: body(x_ref, None, mats_ref, vecs_ref, y_ref, scoped), smem, barriers,
                          collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((batch, seq_len, d_model), jnp.dtype(io_dtype)),
        grid=(num_tiles,),
        grid_names=(GRID_AXIS,),
        num_threads=NUM_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=_compiler_params(profile_dir),
        interpret=_interpret_params(detect_races=interpret == "detect_races") if interpret else None,
    )
