"""The attention backward on Hopper (sm_90), FlashAttention-3 style, in Pallas' Mosaic GPU dialect.

`flash_attention_vjp` (flash_attention_bwd.py) takes it on sm_90 where `mgpu_backward_applies`; measured by
`python3 -m bench.bench_attention_bwd --variants default,mgpu-q128,...` (docs/decisions.md).

One CUDA block per (KV tile of `BLOCK_KV` keys, head, sequence); `NUM_CONSUMERS` consumer warpgroups own
`KEYS_PER_CONSUMER` keys each, and a producer warpgroup streams the query blocks (Q, dO, the forward's
log-sum-exp and delta = rowsum(dO * O), `BLOCK_Q` queries each) through a ring of `num_stages` slots. Per
query block j a consumer, with its keys' K and V in shared memory for the whole loop:
- S^T = K Q_j^T and P^T = exp2(S^T * scale * log2(e) - lse_j * log2(e)) (keys on rows, queries on columns,
  so lse and delta are column vectors, and P^T and dS^T are the register operands of the next GEMMs);
- dP^T = V dO_j^T, dS^T = P^T * (dP^T - delta_j);
- dV += P^T dO_j and dK += dS^T Q_j, accumulated in fp32 registers over the loop;
- dQ_j += dS K: dS^T goes through shared memory and is read transposed as the GEMM's left operand; the
  fp32 product is added into an fp32 dQ accumulator in global memory by a TMA reduce-add copy (other
  blocks add theirs to the same rows). jax's Mosaic GPU interpreter has no TMA reduction: in interpret
  mode each (tile, consumer) writes its own dQ partial and the wrapper sums them.
A key mask gives each consumer's 64 keys a bias row (0 or -inf) added to every block's scores: masked keys
get P = 0, so zero dK and dV and nothing in dQ. A row whose log-sum-exp is -inf (no allowed key) gets
P = 0 and zero dQ.
Causal attention: a tile visits the query blocks from its first key on; the consumer whose keys start
later waits for and releases the blocks before its own diagonal, so the ring's phases stay in step; the
diagonal block takes the causal mask. Sequences are padded to whole KV tiles: padded queries get
lse = +inf (P = 0) and dO = 0, padded keys are masked (non-causal) or never visible (causal).

Numerics as the forward: the GEMMs take the input dtype (fp16 or bf16) with fp32 accumulation; P^T and
dS^T are rounded to it for their GEMMs; dQ is summed in fp32, dK and dV accumulate in fp32 and are
written in the input dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ttj_jax.kernels.attention_common import check_causal_and_scale, check_qkv_layout, fused_qkv_view
from ttj_jax.kernels.flash_attention_mgpu_config import SMEM_BUDGET_BYTES, swizzle_bytes
from ttj_jax.kernels.flash_attention_mgpu_interpret import InterpretPallas, StagingPlgpu
from ttj_jax.kernels.mosaic_primitives import SlotRef, plgpu_module

BLOCK_Q = 64             # queries per ring slot (the M of the dQ GEMM, the N of S^T's)
KEYS_PER_CONSUMER = 64   # one wgmma M tile per consumer warpgroup
NUM_CONSUMERS = 2
BLOCK_KV = KEYS_PER_CONSUMER * NUM_CONSUMERS
SUPPORTED_HEAD_DIMS = (64, 128)
CONSUMER_REGISTERS = (232, 240)   # per thread after set_max_registers (MgpuBwdConfig.registers)
_LOG2_E = math.log2(math.e)
SEQUENCE_AXIS, HEAD_AXIS, KV_TILE_AXIS = "ttj_mgpu_bwd_sequence", "ttj_mgpu_bwd_head", "ttj_mgpu_bwd_kv_tile"


@dataclasses.dataclass(frozen=True)
class MgpuBwdConfig:
    """The kernel's options (static). None of them changes the arithmetic: every option gives the same
    gradients to the bit (tests/test_flash_attention_mgpu_bwd.py).
    num_stages: slots in the ring of query blocks.
    overlap: S^T and dP^T issued together, P^T computed while dP^T runs; dV and dK issued together, dS^T
      stored to shared memory meanwhile. Without it every GEMM is waited for on its own.
    dq_buffers: 1, or 2 so that a block's dQ reduce-add copy runs on while the next block computes (the
      buffer is reused one block later, not right away).
    block_q: queries per ring slot. 64: each consumer computes dQ of the block from its own 64 keys, and
      both add into the same rows. 128 (head_dim 64 only: registers): S^T and dP^T are 64 x 128 GEMMs,
      and dQ is split by rows: both consumers store dS^T (double-buffered), meet at a barrier, and each
      computes 64 rows of dQ from all 128 keys, one reduce-add per row.
    overlap_grads: dV and dK issued together, dS^T stored to shared memory meanwhile, while S^T and dP^T
      are waited for on their own (fewer live accumulators than `overlap`, which implies it).
    registers: per consumer thread (232 or 240); the producer gets what is left of the 64K, at most 40.
    eager_ds: dS^T stored (and, with split dQ, announced to the other consumer) before the dV and dK GEMMs
      are issued, so a consumer's wait for the other's dS^T overlaps its own dV and dK: the consumers
      leave the lock-step the per-block meeting holds them in.
    dq_split: at 128-query blocks, dQ split by rows as above; False: each consumer adds all 128 rows of
      the block's dQ from its own 64 keys (two 64-row GEMMs and reduce-adds, no meeting of the consumers,
      twice the reduce-add traffic)."""
    num_stages: int = 2
    overlap: bool = False
    dq_buffers: int = 1
    block_q: int = BLOCK_Q
    overlap_grads: bool = False
    registers: int = CONSUMER_REGISTERS[0]
    eager_ds: bool = False
    dq_split: bool = True

    def __post_init__(self):
        if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 6:
            raise ValueError(f"MgpuBwdConfig.num_stages={self.num_stages!r} must be an int in 2..6")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"MgpuBwdConfig.overlap={self.overlap!r} must be a bool")
        if self.dq_buffers not in (1, 2):
            raise ValueError(f"MgpuBwdConfig.dq_buffers={self.dq_buffers!r} must be 1 or 2")
        if self.block_q not in (BLOCK_Q, BLOCK_KV):
            raise ValueError(f"MgpuBwdConfig.block_q={self.block_q!r} must be {BLOCK_Q} or {BLOCK_KV}")
        if not isinstance(self.overlap_grads, bool):
            raise ValueError(f"MgpuBwdConfig.overlap_grads={self.overlap_grads!r} must be a bool")
        if not isinstance(self.dq_split, bool):
            raise ValueError(f"MgpuBwdConfig.dq_split={self.dq_split!r} must be a bool")
        if not isinstance(self.eager_ds, bool):
            raise ValueError(f"MgpuBwdConfig.eager_ds={self.eager_ds!r} must be a bool")
        if self.registers not in CONSUMER_REGISTERS:
            raise ValueError(f"MgpuBwdConfig.registers={self.registers!r} must be one of {CONSUMER_REGISTERS}")

    @property
    def split_dq(self) -> bool:
        return self.block_q == BLOCK_KV and self.dq_split

    @property
    def producer_registers(self) -> int:   # 3 warpgroups share 64K registers; a multiple of 8
        return min(40, 65536 // 128 - NUM_CONSUMERS * self.registers)

    @property
    def ds_buffers(self) -> int:   # split dQ: the other consumer reads a dS^T one block longer
        return 2 if self.split_dq else 1


DEFAULT_CONFIG = MgpuBwdConfig()


def smem_bytes(head_dim: int, itemsize: int, config: MgpuBwdConfig) -> int:
    """Shared memory the kernel allocates (barriers aside): K and V per consumer, the rings of Q, dO,
    lse and delta, dS^T and the dQ buffers per consumer, and the keys' bias of a key-masked call."""
    kv = 2 * NUM_CONSUMERS * KEYS_PER_CONSUMER * head_dim * itemsize
    ring = config.num_stages * (2 * config.block_q * head_dim * itemsize + 2 * config.block_q * 4)
    ds = NUM_CONSUMERS * config.ds_buffers * KEYS_PER_CONSUMER * config.block_q * itemsize
    dq = NUM_CONSUMERS * config.dq_buffers * BLOCK_Q * head_dim * 4
    key_bias = NUM_CONSUMERS * KEYS_PER_CONSUMER * 4   # with a key mask
    return kv + ring + ds + dq + key_bias


def padded_len(seq_len: int) -> int:
    """The kernel's sequence length: whole KV tiles."""
    return -(-seq_len // BLOCK_KV) * BLOCK_KV


def first_query_block(kv_tile, causal: bool, block_q: int = BLOCK_Q):
    """The first query block a KV tile's keys are visible to (causal: its first key's block)."""
    return kv_tile * (BLOCK_KV // block_q) if causal else 0


def consumer_first_block(kv_tile, wg, causal: bool, block_q: int = BLOCK_Q):
    """The first query block consumer `wg`'s keys are visible to; the blocks of the tile before it are
    waited for and released only. With causal attention this block is the consumer's diagonal."""
    if not causal:
        return 0
    return (kv_tile * BLOCK_KV + wg * KEYS_PER_CONSUMER) // block_q


def _accumulate(plgpu, interpret: bool, init, a, b):
    """init + a @ b through a wgmma accumulator (init: fp32 registers in the WGMMA layout)."""
    if interpret:   # the interpreter's accumulators start at zero: add the initial value after
        return init + _product(plgpu, init.shape, a, b)

    def gemm(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
    return pl.run_state(gemm)(plgpu.ACC.init(init))


def _product(plgpu, shape, a, b):
    """a @ b in fp32 through a fresh accumulator."""
    return pl.run_scoped(lambda acc: (plgpu.wgmma(acc, a, b), acc[...])[1], plgpu.ACC(shape, jnp.float32))


def _kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, causal: bool, seq_len: int, padded: int,
            head_dim: int, sm_scale: float, config: MgpuBwdConfig, dtype, interpret: bool, key_masked: bool):
    if key_masked:   # the keys' bias row (0 or -inf), its shared memory and barrier
        key_bias_ref, dk_ref, dv_ref, dq_ref, smem, barriers, *stages = refs
        *smem, bias_smem = smem
        *barriers, bias_ready = barriers
    else:
        dk_ref, dv_ref, dq_ref, smem, barriers, *stages = refs
    plgpu = StagingPlgpu(*stages) if interpret else plgpu_module()
    pl_module = InterpretPallas() if interpret else pl
    num_stages, block_q = config.num_stages, config.block_q
    k_smem, v_smem, q_ring, do_ring, lse_ring, delta_ring, ds_smem, dq_smem = smem
    k_ready, v_ready, q_ready, do_ready, lse_ready, delta_ready, consumed, *ds_ready = barriers
    wg = lax.axis_index("wg")
    batch, head, tile = (lax.axis_index(name) for name in (SEQUENCE_AXIS, HEAD_AXIS, KV_TILE_AXIS))
    num_q_blocks = padded // block_q
    first = first_query_block(tile, causal, block_q)

    def slot_of(block):
        return lax.rem(block - first, jnp.int32(num_stages))

    @pl.when(wg < NUM_CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(config.registers, action="increase")
        key_start = tile * BLOCK_KV + wg * KEYS_PER_CONSUMER
        keys = pl.ds(key_start, KEYS_PER_CONSUMER)
        plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, head], k_smem.at[wg], k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, head], v_smem.at[wg], v_ready.at[wg])
        if key_masked:
            plgpu.copy_gmem_to_smem(key_bias_ref.at[batch, keys], bias_smem.at[wg], bias_ready.at[wg])
        plgpu.barrier_wait(k_ready.at[wg])
        plgpu.barrier_wait(v_ready.at[wg])
        score_scale = sm_scale * _LOG2_E
        column = plgpu.Layout.WGMMA.reduce(0)
        if key_masked:   # this consumer's keys: one bias per row of S^T, for the whole loop
            plgpu.barrier_wait(bias_ready.at[wg])
            key_bias = plgpu.layout_cast(bias_smem[wg], plgpu.Layout.WGMMA.reduce(1))

        def wait_block(slot):
            for ready in (q_ready, do_ready, lse_ready, delta_ready):
                plgpu.barrier_wait(ready.at[slot])

        def skip(block, _):
            slot = slot_of(block)
            wait_block(slot)
            plgpu.barrier_arrive(consumed.at[slot])

        def step(block, carry, *, masked: bool):
            dk, dv = carry
            slot = slot_of(block)
            wait_block(slot)
            q_s, do_s = q_ring.at[slot], do_ring.at[slot]
            shape = (KEYS_PER_CONSUMER, block_q)
            lse = lax.broadcast_in_dim(plgpu.layout_cast(lse_ring[slot], column), shape, [1])
            delta = lax.broadcast_in_dim(plgpu.layout_cast(delta_ring[slot], column), shape, [1])

            def probabilities(s_t):
                if key_masked:
                    bias = lax.broadcast_in_dim(key_bias, shape, [0])
                    p_t = jnp.exp2(s_t * score_scale - lse + bias)
                else:
                    p_t = jnp.exp2(s_t * score_scale - lse)
                if masked or (not causal and seq_len != padded and not key_masked):
                    key = key_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
                    allowed = key < seq_len
                    if masked:
                        query = block * block_q + plgpu.broadcasted_iota(jnp.int32, shape, 1,
                                                                         layout=plgpu.Layout.WGMMA)
                        allowed = key <= query
                    p_t = jnp.where(allowed, p_t, 0.0)
                return p_t

            if config.overlap:
                def scores(s_ref, dp_ref):
                    plgpu.wgmma(s_ref, k_smem.at[wg], q_s.transpose((1, 0)))
                    plgpu.wgmma(dp_ref, v_smem.at[wg], do_s.transpose((1, 0)))
                    return probabilities(plgpu.wgmma_accumulator_load(s_ref, wait_n=1)), dp_ref[...]
                p_t, dp_t = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))
            else:
                p_t = probabilities(_product(plgpu, shape, k_smem.at[wg], q_s.transpose((1, 0))))
                dp_t = _product(plgpu, shape, v_smem.at[wg], do_s.transpose((1, 0)))
            ds_half = (p_t * (dp_t - delta)).astype(dtype)
            ds_buffer = ds_smem.at[wg, lax.rem(block, jnp.int32(config.ds_buffers))]
            if config.eager_ds:   # dS^T stored, and announced to the other consumer, before dV and dK
                ds_buffer[...] = ds_half
                plgpu.commit_smem()
                if config.split_dq:
                    plgpu.barrier_arrive(ds_ready[0].at[0])
            if config.overlap or config.overlap_grads:
                def grads(refs):
                    dv_ref, dk_ref = refs
                    plgpu.wgmma(dv_ref, p_t.astype(dtype), do_s)
                    plgpu.wgmma(dk_ref, ds_half, q_s)
                    if not config.eager_ds:
                        ds_buffer[...] = ds_half   # while the two GEMMs run
                dv, dk = pl_module.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
            else:
                dv = _accumulate(plgpu, interpret, dv, p_t.astype(dtype), do_s)
                dk = _accumulate(plgpu, interpret, dk, ds_half, q_s)
                if not config.eager_ds:
                    ds_buffer[...] = ds_half
            plgpu.barrier_arrive(consumed.at[slot])   # every read of Q_j and dO_j has completed
            if not config.eager_ds:
                plgpu.commit_smem()

            def add_dq(dq, first_row, copy_index):
                # the copy that last read this dQ buffer (dq_buffers copies ago) has finished reading it
                plgpu.wait_smem_to_gmem(config.dq_buffers - 1, wait_read_only=True)
                buffer = dq_smem.at[wg, lax.rem(copy_index, jnp.int32(config.dq_buffers))]
                buffer[...] = dq * sm_scale
                plgpu.commit_smem()
                rows = pl.ds(first_row, BLOCK_Q)
                if interpret:
                    plgpu.copy_smem_to_gmem(buffer, dq_ref.at[tile * NUM_CONSUMERS + wg, batch, rows, head])
                else:
                    plgpu.copy_smem_to_gmem(buffer, dq_ref.at[batch, rows, head], reduction_op="add")

            if not config.split_dq:   # dQ of the whole block from this consumer's keys, 64 rows at a time
                parts = block_q // BLOCK_Q
                for part in range(parts):
                    ds_t = ds_buffer if parts == 1 else ds_buffer.at[:, pl.ds(part * BLOCK_Q, BLOCK_Q)]
                    add_dq(_product(plgpu, (BLOCK_Q, head_dim), ds_t.transpose((1, 0)), k_smem.at[wg]),
                           block * block_q + part * BLOCK_Q, block * parts + part)
                return dk, dv
            # split: each consumer's 64 rows of dQ from both consumers' dS^T and K, once both are stored
            if not config.eager_ds:
                plgpu.barrier_arrive(ds_ready[0].at[0])
            plgpu.barrier_wait(ds_ready[0].at[0])
            buffer_index = lax.rem(block, jnp.int32(config.ds_buffers))
            for rows_of in range(NUM_CONSUMERS):   # static slices: one branch per consumer
                @pl.when(wg == rows_of)
                def _(rows_of=rows_of):
                    columns = pl.ds(rows_of * BLOCK_Q, BLOCK_Q)

                    def both(acc):
                        for owner in range(NUM_CONSUMERS):
                            ds_t = ds_smem.at[owner, buffer_index].at[:, columns]
                            plgpu.wgmma(acc, ds_t.transpose((1, 0)), k_smem.at[owner])
                        return acc[...]
                    add_dq(pl.run_scoped(both, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32)),
                           block * block_q + rows_of * BLOCK_Q, block)
            return dk, dv

        own = consumer_first_block(tile, wg, causal, block_q)
        zeros = plgpu.layout_cast(jnp.zeros((KEYS_PER_CONSUMER, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        lax.fori_loop(first, own, skip, None)
        carry = (zeros, zeros)
        if causal:   # the diagonal block, then the blocks wholly after it
            carry = step(own, carry, masked=True)
            carry = lax.fori_loop(own + 1, num_q_blocks, functools.partial(step, masked=False), carry)
        else:
            carry = lax.fori_loop(own, num_q_blocks, functools.partial(step, masked=False), carry)
        dk, dv = carry
        if config.split_dq:   # the other consumer's last dQ GEMM reads this K: wait for it to complete
            plgpu.barrier_arrive(ds_ready[0].at[0])
            plgpu.barrier_wait(ds_ready[0].at[0])
        k_smem.at[wg][...] = (dk * sm_scale).astype(dtype)   # every GEMM reading K and V has completed
        v_smem.at[wg][...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[batch, keys, head])
        plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[batch, keys, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == NUM_CONSUMERS)
    def _producer():
        plgpu.set_max_registers(config.producer_registers, action="decrease")

        def load(block):
            slot = slot_of(block)
            rows = pl.ds(block * block_q, block_q)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_ring.at[slot], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_ring.at[slot], do_ready.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[batch, head, rows], lse_ring.at[slot], lse_ready.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[batch, head, rows], delta_ring.at[slot], delta_ready.at[slot])

        for i in range(num_stages):   # fill the ring
            pl.when(first + i < num_q_blocks)(functools.partial(load, first + i))

        @pl.loop(first + num_stages, num_q_blocks)
        def _(block):
            plgpu.barrier_wait(consumed.at[slot_of(block)])
            load(block)

    if interpret:   # the interpreter wants every phase of every barrier observed before it is freed
        @pl.when(wg == NUM_CONSUMERS)
        def _():
            @pl.loop(jnp.maximum(num_q_blocks - num_stages, first), num_q_blocks)
            def _(block):
                plgpu.barrier_wait(consumed.at[slot_of(block)])


def _check(q, k, v, o, lse, do, causal, sm_scale, key_mask):
    check_causal_and_scale(causal, sm_scale)
    check_qkv_layout(q, k, v)
    if key_mask is not None and (key_mask.shape != q.shape[:2] or key_mask.dtype != jnp.bool_):
        raise ValueError(f"key_mask: {key_mask.shape} {key_mask.dtype} must be bool [batch, seq_len] = {q.shape[:2]}")
    for name, x in (("o", o), ("do", do)):
        if x.shape != q.shape or x.dtype != q.dtype:
            raise ValueError(f"{name}: {x.shape} {x.dtype} must be q's {q.shape} {q.dtype}")
    batch, seq_len, heads, head_dim = q.shape
    if lse.shape != (batch, heads, seq_len):
        raise ValueError(f"lse.shape={lse.shape} must be [batch, heads, seq_len] = {(batch, heads, seq_len)}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"q.dtype={jnp.dtype(q.dtype)} must be float16 or bfloat16")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} must be one of {SUPPORTED_HEAD_DIMS}")


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "interpret", "config"))
def flash_attention_mgpu_bwd(q, k, v, o, lse, do, *, causal: bool, key_mask=None, sm_scale: float | None = None,
                             interpret: bool | str = False, config: MgpuBwdConfig | None = None):
    """(dq, dk, dv) of softmax(q k^T * sm_scale) v for the cotangent `do`, from the forward's output `o`
    and its log-sum-exp `lse` ([B, H, S] fp32, natural log, `flash_attention(..., return_lse=True)`).
    q, k, v, o, do: [B, S, H, head_dim] float16 or bfloat16, head_dim 64 or 128, any S >= 1. key_mask: bool
    [B, S] (False: a key no query sees; its dk and dv are zero) or None. Rows whose lse is -inf (no allowed
    key) get zero dq. config: MgpuBwdConfig, or None for DEFAULT_CONFIG. Returns three arrays in q's dtype."""
    _check(q, k, v, o, lse, do, causal, sm_scale, key_mask)
    return _backward((q, k, v), o, lse, do, causal=causal, key_mask=key_mask, sm_scale=sm_scale,
                     interpret=interpret, config=config)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "interpret", "config"))
def flash_attention_mgpu_bwd_fused_qkv(qkv, o, lse, do, *, causal: bool, key_mask=None,
                                       sm_scale: float | None = None, interpret: bool | str = False,
                                       config: MgpuBwdConfig | None = None):
    """`flash_attention_mgpu_bwd` for q, k, v read in place out of one fused [B, S, 3, H, head_dim]
    projection (the forward's `flash_attention_mgpu_fused_qkv` layout), its gradient returned in that
    layout: the kernel's TMA copies read slots 0, 1, 2 of qkv and write dk and dv into slots 1 and 2 of the
    result, and dq (summed in fp32) is rounded into slot 0, so no q, k, v slices are made and no three
    gradients stacked after. Returns [B, S, 3, H, head_dim] in qkv's dtype."""
    view = fused_qkv_view(qkv)
    _check(view, view, view, o, lse, do, causal, sm_scale, key_mask)
    return _backward((qkv,), o, lse, do, causal=causal, key_mask=key_mask, sm_scale=sm_scale,
                     interpret=interpret, config=config)


def _backward(sources, o, lse, do, *, causal, key_mask, sm_scale, interpret, config):
    """The kernel call: sources (q, k, v) [B, S, H, hd] -> (dq, dk, dv), or (qkv,) [B, S, 3, H, hd] ->
    dqkv in that layout (flash_attention_mgpu_bwd_fused_qkv)."""
    fused = len(sources) == 1
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, MgpuBwdConfig):
        raise ValueError(f"config={config!r} must be an MgpuBwdConfig or None")
    batch, seq_len, heads, head_dim = o.shape
    if config.block_q == BLOCK_KV and head_dim != 64:
        raise ValueError(f"{config} takes head_dim 64 only (its 64 x 128 score tiles and dK, dV accumulators "
                         f"would not fit the registers at head_dim {head_dim})")
    if smem_bytes(head_dim, jnp.dtype(o.dtype).itemsize, config) > SMEM_BUDGET_BYTES:
        raise ValueError(f"{config} at head_dim {head_dim} needs {smem_bytes(head_dim, 2, config)} bytes of "
                         f"shared memory, over {SMEM_BUDGET_BYTES}")
    plgpu = plgpu_module()
    dtype = jnp.dtype(o.dtype)
    sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    padded = padded_len(seq_len)
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    lse = lse.astype(jnp.float32)
    lse2 = jnp.where(jnp.isfinite(lse), lse * _LOG2_E, jnp.inf)   # no allowed key: P = 0

    def pad_rows(x, value=0.0):   # [B, S, (3,) H, hd] and [B, S] on axis 1, [B, H, S] on axis 2
        axis = 2 if x.ndim == 3 else 1
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, padded - seq_len)
        return jnp.pad(x, widths, constant_values=value) if padded != seq_len else x
    operands = (*map(pad_rows, sources), pad_rows(do), pad_rows(lse2, jnp.inf), pad_rows(delta))
    key_masked = key_mask is not None
    if key_masked:   # [B, padded] fp32: 0 for a valid key, -inf for a masked or padded one
        operands += (pad_rows(jnp.where(key_mask, 0.0, -jnp.inf).astype(jnp.float32), -jnp.inf),)

    ring_slots, block_q = config.num_stages, config.block_q
    swizzle = swizzle_bytes(head_dim, dtype.itemsize)
    tiled = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    ds_swizzle = swizzle_bytes(BLOCK_Q, dtype.itemsize)
    ds_tiled = (plgpu.TilingTransform((8, ds_swizzle // dtype.itemsize)), plgpu.SwizzleTransform(ds_swizzle))
    smem = (plgpu.SMEM((NUM_CONSUMERS, KEYS_PER_CONSUMER, head_dim), dtype, transforms=tiled),   # K, then dK
            plgpu.SMEM((NUM_CONSUMERS, KEYS_PER_CONSUMER, head_dim), dtype, transforms=tiled),   # V, then dV
            plgpu.SMEM((ring_slots, block_q, head_dim), dtype, transforms=tiled),                   # Q ring
            plgpu.SMEM((ring_slots, block_q, head_dim), dtype, transforms=tiled),                   # dO ring
            plgpu.SMEM((ring_slots, block_q), jnp.float32),                                         # lse ring
            plgpu.SMEM((ring_slots, block_q), jnp.float32),                                         # delta ring
            plgpu.SMEM((NUM_CONSUMERS, config.ds_buffers, KEYS_PER_CONSUMER, block_q), dtype,       # dS^T
                       transforms=ds_tiled),
            plgpu.SMEM((NUM_CONSUMERS, config.dq_buffers, BLOCK_Q, head_dim), jnp.float32))      # dQ parts
    if key_masked:   # each consumer's keys' bias
        smem += (plgpu.SMEM((NUM_CONSUMERS, KEYS_PER_CONSUMER), jnp.float32),)
    one = functools.partial(plgpu.Barrier, num_arrivals=1)
    barriers = (one(num_barriers=NUM_CONSUMERS), one(num_barriers=NUM_CONSUMERS),
                *(one(num_barriers=ring_slots) for _ in range(4)),
                plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=ring_slots))
    if config.split_dq:   # both consumers' dS^T stored
        barriers += (plgpu.Barrier(num_arrivals=NUM_CONSUMERS, num_barriers=1),)
    if key_masked:
        barriers += (one(num_barriers=NUM_CONSUMERS),)
    stages = ((plgpu.SMEM((NUM_CONSUMERS, KEYS_PER_CONSUMER, max(block_q, head_dim)), dtype),
               plgpu.SMEM((NUM_CONSUMERS, head_dim, max(block_q, KEYS_PER_CONSUMER)), dtype)) if interpret else ())
    num_tiles = padded // BLOCK_KV
    kernel = functools.partial(_kernel, causal=causal, seq_len=seq_len, padded=padded, head_dim=head_dim,
                               sm_scale=sm_scale, config=config, dtype=dtype, interpret=bool(interpret),
                               key_masked=key_masked)
    params = plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane)
    if fused:   # one [B, padded, 3, H, hd] gradient: the kernel writes slots 1 and 2
        grads = (jax.ShapeDtypeStruct((batch, padded, 3, heads, head_dim), dtype),)
    else:
        grads = (jax.ShapeDtypeStruct((batch, padded, heads, head_dim), dtype),) * 2

    def body(*refs):   # the inputs, then the gradient(s) (dk, dv or dqkv) and dq (interpret: an output; else
        #                the accumulator)
        *inputs, dq = refs
        if fused:
            (qkv, *inputs), dqkv = inputs[:-1], inputs[-1]
            inputs = [SlotRef(qkv, 0), SlotRef(qkv, 1), SlotRef(qkv, 2), *inputs, SlotRef(dqkv, 1), SlotRef(dqkv, 2)]
        pl.run_scoped(lambda *scoped: kernel(*inputs, dq, *scoped), smem, barriers, *stages, collective_axes="wg")

    grid = dict(grid=(batch, heads, num_tiles), grid_names=(SEQUENCE_AXIS, HEAD_AXIS, KV_TILE_AXIS),
                num_threads=NUM_CONSUMERS + 1, thread_name="wg")
    if interpret:
        from ttj_jax.kernels.flash_attention_mgpu_interpret import interpret_params  # noqa: PLC0415
        parts = jax.ShapeDtypeStruct((num_tiles * NUM_CONSUMERS, batch, padded, heads, head_dim), jnp.float32)
        *outs, dq_parts = plgpu.kernel(body, out_type=(*grads, parts), compiler_params=params,
                                       interpret=interpret_params(interpret), **grid)(*operands)
        dq = dq_parts.sum(axis=0)
    else:   # a Ref argument of pl.kernel is read and written in place (plgpu.kernel takes none)
        dq_acc = jax.new_ref(jnp.zeros((batch, padded, heads, head_dim), jnp.float32))

        def ordered(*refs):   # pl.kernel passes the Ref among the inputs, the outputs after
            inputs, dq, grad_refs = refs[:len(operands)], refs[len(operands)], refs[len(operands) + 1:]
            body(*inputs, *grad_refs, dq)
        outs = pl.kernel(ordered, out_type=grads, mesh=plgpu.Mesh(**grid), compiler_params=params)(*operands, dq_acc)
        dq = dq_acc[...]
    if fused:   # dq rounded into slot 0 of the kernel's output (an in-place update of that buffer)
        dqkv = outs[0].at[:, :, 0].set(dq.astype(dtype))
        return dqkv[:, :seq_len] if padded != seq_len else dqkv
    return tuple(x[:, :seq_len] for x in (dq.astype(dtype), *outs))
