"""Flash attention forward pass for Hopper (sm_90), written with Pallas' Mosaic GPU backend.

The generic kernel in `flash_attention.py` lowers through Triton and runs everywhere, interpret mode
included. This one is the H200 path for head_dim 32 (since session 15), 64, 128 and 256: tensor-core
`wgmma`, TMA bulk copies into a ring of shared-memory stages, and warp specialization in the
FlashAttention-3 style. It has no masks: a dispatcher must send calls with `kv_lengths` or `key_mask`,
other head sizes, float32 inputs, or non-Hopper devices to the generic kernel (`interpret=True` runs it
in Mosaic GPU's CPU interpreter).

Design (one CUDA block per (query tile, head, batch element)):
- Warpgroups. `num_compute_wgs` consumer warpgroups (2 or 3) each own 64 consecutive query rows, so a
  query tile is 64 * num_compute_wgs rows; one more warpgroup is the producer. The producer gives up
  registers (`set_max_registers`), the consumers take them.
- Producer. Issues the TMA copies of K and V blocks of `block_kv` keys into a ring of `num_stages`
  slots, each slot with a "ready" barrier (completed by the copy) and a "consumed" barrier (one arrival
  per consumer). K and V have separate barriers, because a consumer is done with K_j one GEMM phase
  before it is done with V_j. At head_dim 32 and 64 (lane lowering) one warp of the producer's warpgroup
  issues all of this and the other three wait (`warp_producer`).
- Consumers. Each loads its own 64 rows of Q once. Its loop is software-pipelined: one "GEMM phase"
  issues P_{j-1} @ V_{j-1} and Q @ K_j^T together, then the warpgroup does the softmax of block j.
  The GEMM phases of the consumers are ordered round-robin by a token ring of barriers (consumer w
  waits for token w, issues, passes the token to w+1), so while one warpgroup runs its softmax on the
  ALU/SFU, another's GEMMs run on the tensor core (FA3's ping-pong).
- `overlap_softmax` (two consumers at head_dim 64; see below for one accumulator): Q @ K_j^T is issued first and P_{j-1} @ V_{j-1}
  accumulates into a fresh accumulator, so the softmax of block j runs while that PV GEMM is still on
  the tensor core (FA3's intra-warpgroup overlap). The rescale of the running output by the previous
  block's correction is then one fused multiply-add after the GEMM: out = out * alpha_{j-1} + P V.
  It costs a second head_dim-wide fp32 accumulator in registers, which only head_dim 64 affords;
  `overlap_one_accumulator` instead rescales the output before the GEMM phase and lets P @ V add to it
  (one accumulator: head_dim 128 with two consumers, or 64 with three). Either way P stays fp32 until
  P @ V_{j-1} has completed: converting it while that wgmma was in flight made ptxas serialize every
  wgmma (its C7513 report; `bench/scratch/ptxas_dump.py` prints ptxas's report per build), which had
  held every overlap build near 350 TFLOP/s at head_dim 64. The head_dim-128 default from S=4096 on.
- Causal attention. Tiles are launched heaviest first (the last query tile is the first program), so
  the light tiles fill the tail of the launch. A tile only visits KV blocks that start at or before its
  last row; a consumer applies the causal mask only on blocks that straddle its own diagonal, and
  consumers whose rows end earlier than the tile's last block skip the blocks past their diagonal
  (waiting for each such block to arrive before releasing it, so the ring's phases stay in order).
- Any sequence length. TMA reads past the end of the sequence are filled with zeros and TMA writes
  past it are dropped, so the last query tile and the last KV block may overhang S without padding.
  Under causal attention the keys past S are never visible to a real query (they come after it);
  otherwise the block holding them is masked with `key < S`. The one exception: Mosaic GPU views the
  sequence axis in whole 8-row tiles for TMA, so an S that is not a multiple of 8 (and > 8) is padded
  to one with zeros (`padded_seq_len`), a copy of q, k and v and a slice of the output.
- Output. Each consumer normalises its rows, writes them over its own Q buffer in shared memory and
  stores them with one TMA copy.

Numerics (fp16 or bf16 inputs; the output has the input dtype):
- Both GEMMs take the input dtype and accumulate in fp32. P is rounded to the input dtype for P @ V.
- Scores stay fp32. The softmax runs in base 2: the running max m is kept in units of
  log2(e) * sm_scale * score, so each probability is one fused multiply-add and one `ex2.approx`
  (`approx_math=True`: an error of a few fp32 ulps, far below the 2^-11 rounding of P to fp16).
- Running max, running sum and the output accumulator are fp32; each row is multiplied by 1 / sum once.
- Masked scores are -inf. Every visited row has key 0 in its first block, so its running max is
  finite from the first block on and no NaN can arise; rows past S compute on zero-filled Q and their
  writes are dropped.

Layouts and copies: q, k, v are read in place from their `[B, S, H, head_dim]` arrays (the free
reshape of a `[B, S, d]` projection) and the output is written in the same layout: no transposes, and
no padding or slicing when S is a multiple of 8. A fused `[B, S, 3, H, head_dim]` QKV array would
need its three slices copied out first (TMA copies from the fused array would avoid that; not done).

Testing: tests/test_flash_attention_mgpu.py lowers it on a CPU (every head_dim, causal or not, several
S) and runs it in Mosaic GPU's interpret mode (`interpret=`; the substitutes: `_InterpretPlgpu` below);
its numerics and speed are checked on the H200 by `bench/bench_attention_mgpu.py` (all checks passed
there on 2026-11-30, and the default block sizes below come from its timings).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ttj_jax.kernels.mosaic_primitives import (mosaic_cluster_arrive_from_warp, mosaic_half_exp2,
                                              mosaic_rescale_where_needed)
from ttj_jax.kernels.flash_attention import check_causal_and_scale, check_qkv_layout

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
ROWS_PER_CONSUMER = 64          # one wgmma M tile per consumer warpgroup
ROW_SUM_COLUMNS = 16            # MgpuBlockSizes.row_sum_mma: the width of its ones matrix and accumulator
_LOG2_E = math.log2(math.e)
LAZY_RESCALE_THRESHOLD = 8.0   # base-2 units: P <= 2^8 between rescales (MgpuBlockSizes.lazy_rescale)
_LN_2 = math.log(2.0)
# Hopper's opt-in shared memory per block (227 KiB) less room for barriers and 1 KiB swizzle alignment.
SMEM_BUDGET_BYTES = 227 * 1024 - 2 * 1024
# Registers per thread after `set_max_registers` (sum over warpgroups * 128 threads <= 65536).
_REGISTERS = {2: (232, 40), 3: (160, 32)}   # num_compute_wgs -> (consumer, producer)


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    block_kv: int                  # keys per KV block (the N of Q @ K^T, the K of P @ V)
    num_stages: int                # slots in the shared-memory ring of K/V blocks (clamped to the KV blocks)
    num_compute_wgs: int = 2       # consumer warpgroups; a query tile is 64 * num_compute_wgs rows
    overlap_softmax: bool = False  # softmax of block j overlaps the PV GEMM of block j - 1
    # The last poly_exp_keys keys of each KV block get exp2 from a polynomial on the FMA units instead of
    # the MUFU (FA4's trick; _exp2_poly). Opt-in and slower: on the H200 with 64 of 128 keys, 375 TFLOP/s
    # against 485 for the same build without it (main case, lane lowering; attention-mgpu-2026-11-30-
    # nvidia-h200-poly.json). Its ~10 extra instructions per element add ~900 issue clocks per block round
    # to the three consumer warps sharing each SM sub-partition, about what the round lengthened (~920 at
    # an assumed 1.83 GHz): the softmax is bound by instruction issue, not by the MUFU.
    poly_exp_keys: int = 0
    # The softmax's row sums taken by a wgmma, P @ ones[block_kv, 16], into a [64, 16] fp32 accumulator
    # rescaled like the output's, instead of one FADD per score: the issue-bound softmax's instruction
    # count down by about a fifth, the tensor cores' work up by an eighth, 8 more fp32 registers per
    # thread; the sums are then of P as rounded to the input dtype, the P the output is made from.
    # Opt-in and much slower: expected 5-10% faster at head_dim 64 (from the poly_exp_keys measurement),
    # measured on the H200 at 300 TFLOP/s against 497 for the same lane build without it (main case, 9/9
    # checks; attention-mgpu-2026-11-30-nvidia-h200-rowsum.json). Why was not measured (a register spill
    # or the extra wgmma group's wait are the suspects); kept for that study.
    row_sum_mma: bool = False
    # P by PTX's packed half-precision exp2 (`compat.mosaic_half_exp2`: ex2.approx.f16x2, two elements per
    # special-function-unit instruction) of the exponent rounded to the input dtype, and the row sums
    # of that P added in the input dtype (packed adds) before the fp32 running sum: per score one
    # conversion, half an exp2 and half an add instead of an exp2, an fp32 add and half a conversion,
    # for the issue-bound softmax above. Costs accuracy: the exponent's rounding (2^-11 relative, so up
    # to ~0.7% of P where the exponent is near -16, P near 2^-16) and the 16-bit partial sums.
    # Opt-in and slower: predicted ~5% faster at head_dim 64, measured on the H200 at 444 TFLOP/s against
    # 490 for the default in the same run (main case; 429/432 with 3/5 stages; 9/9 checks passed, worst
    # err/tol 0.16: bench/results/attention-mgpu-2026-12-01-nvidia-h200-half-exp2.json). Why not
    # measured; the suspects are the packed exp2's own throughput and the conversions around it.
    half_exp2: bool = False
    # With overlap_softmax: the running output is rescaled by the previous block's alpha in registers
    # before Q @ K_j^T and P_{j-1} @ V_{j-1} are issued, and P @ V accumulates into that output itself
    # instead of into a fresh accumulator (FlashAttention-3 rescales while Q @ K^T runs; here ptxas then
    # serialized the wgmmas, C7513 "non wgmma instructions defining input registers of a wgmma"):
    # one [64, head_dim] fp32 accumulator instead of two, 32 registers per thread fewer at head_dim 64,
    # which is what lets three consumers (160 registers each) overlap, FA3's head_dim-64 configuration
    # (192 query rows, 128 keys, P from registers, intra-warpgroup overlap). Measured on the H200: slower
    # at head_dim 64, faster at 128 on long sequences (see _LONG_SEQ_BLOCK_SIZES).
    overlap_one_accumulator: bool = False
    # Q multiplied by sm_scale * log2(e) once per tile, in shared memory (each consumer its own 64 rows,
    # before its first wgmma), so the scores come out of Q @ K^T already in the softmax's base-2 units:
    # the exponent is score - max instead of score * scale - max, and the max needs no scaling. Worth
    # one instruction per score only where the compiler did not contract that multiply and subtract
    # into one FFMA (bench/scratch/ptxas_dump.py counts them). Numerics: Q is rounded to the input
    # dtype once more after the scaling (2^-11 relative in fp16, as P is for P @ V). Opt-in and slower:
    # ptxas had already contracted score * c - max into one FFMA, so it removes no instruction (the FFMA
    # becomes an FADD); 491.2 against 495.1 TFLOP/s at head_dim 64, main case, 3 rounds
    # (bench/results/attention-mgpu-2026-12-01-nvidia-h200-softmax-run1.json).
    prescaled_q: bool = False
    # The row sums of P added in the input dtype: P as rounded for P @ V, its column halves added with
    # packed half adds (two keys per instruction) down to 8 columns (`_packed_row_sum`), then fp32,
    # instead of one fp32 add per score: ~30 instructions per thread and block instead of 64. fp16 only
    # (bf16's 8-bit mantissa would cost ~1% of a sum); a tree of depth log2(block_kv / 8) over values
    # <= 1 in fp16: a relative error of at most ~4 * 2^-11 at 128 keys. Opt-in and slower: 16 of the
    # main loop's 427 instructions fewer, yet 474.8 against 497.2 TFLOP/s (main case, 5 rounds,
    # ...-softmax-run2.json; with `p.sum(axis=1)`, which converts every key to fp32 first, 442.7: run1).
    half_row_sum: bool = False
    # The consumers' GEMM phases ordered round-robin by the token ring (FA3's ping-pong, the default);
    # False: each consumer issues its GEMMs as soon as its own data is ready, in whatever order the
    # consumers get there. Alone: level (485.2 against 484.0 TFLOP/s, 3 rounds, in a run whose default
    # drifted from 492 to 477: bench/results/mufu-probe-2026-12-01-nvidia-h200.json). With kv_multicast
    # at head_dim 64 faster, and the default there (MULTICAST_WITHOUT_PINGPONG, session 20).
    pingpong: bool = True
    # The running row sum kept per thread as a [64, 8] fp32 array (each thread's own columns of its
    # rows, P's 8-column chunks added as a tree) and reduced across the 4 lanes of a row once, after
    # the last block, instead of a 32-add chain and two shuffles in every block. Session 15's SASS
    # showed that chain and its shuffles at the end of every iteration of the main loop, in front of
    # the next GEMM phase's issue (in-order issue), and a longer chain there (half_row_sum) slowing the
    # kernel by 4.5%. Same sums in another fp32 order. Opt-in and slower: the main loop went from 427 to
    # 419 instructions and from 8 to 4 shuffles (no spills in it), yet 484.1 against 494.7 TFLOP/s
    # (main case, 5 rounds, ...-softmax-run3.json).
    deferred_row_sum: bool = False
    # Each row's max over P's 8-column chunks taken as a tree (depth log2(block_kv / 8)) before the
    # cross-lane step, instead of ptxas's two 16-long FMNMX chains: the max is the first thing every
    # softmax waits for. Exact (a max in any order is the same max). Opt-in and slower: 481.8 against
    # 494.7 TFLOP/s (same run as deferred_row_sum; both together 483.1).
    tree_row_max: bool = False
    # FA4's conditional rescaling: each row's running max, the reference point of P = exp2(score - max),
    # moves only when the block's max exceeds it by more than LAZY_RESCALE_THRESHOLD (base-2 units),
    # and the output accumulator is multiplied by alpha only in threads holding a row whose max moved
    # (`compat.mosaic_rescale_where_needed`: a branch around the 32 multiplies per thread at head_dim
    # 64 that otherwise sit on every iteration's path from the softmax to the next P @ V). The sums and
    # the output stay relative to the same max, so the result is the same softmax; P may reach
    # 2^LAZY_RESCALE_THRESHOLD (256) before rounding to the input dtype, which keeps its relative
    # precision. Not with overlap_softmax, row_sum_mma, half_exp2, half_row_sum or deferred_row_sum.
    # Opt-in and slower: predicted ~2% faster at head_dim 64 (32 of the loop's ~427 instructions per
    # thread skipped on most iterations), measured 484.4 against 495.7 TFLOP/s at the main case (5
    # rounds) and 480.9 against 492.4 at shape 14's call (3 rounds); 9/9 checks, incl. keys scaled 10x
    # late in the sequence so the max jumps past the threshold (bench/results/attention-mgpu-2026-12-01-
    # nvidia-h200-lazy.{json,log}, `STUDY=--lazy bash bench/scratch/softmax_run.sh OUT`). The SASS shows
    # why it cannot win as built: the per-thread branch is a divergent one, so ptxas wraps it in
    # BSSY/BSYNC (reconvergence) and no longer schedules the softmax's tail, the multiplies and the
    # next GEMM phase's issue across it; 2 more spill stores (ptxas-2026-12-01-nvidia-h200-session16-lazy.json).
    lazy_rescale: bool = False
    # One long-lived CUDA block per SM (at most), each looping over its share of the query tiles
    # (`persistent_tile`: rounds of one tile per block in a fixed cost order, snake-wise, computed from
    # the block's id and the round alone) instead of one block per tile: the K/V ring runs on from one
    # tile into the next (starting at slot 0 with each), the next tile's Q is loaded while this one's
    # last P @ V and store run, and the output is staged in its own buffer. Opt-in; nothing dispatches
    # to it. Why: the one-block-per-tile kernel costs 5.5 us per tile beyond its key blocks (bench/
    # results/cta-overhead-2026-12-01-nvidia-h200.json), 0.83% of the head_dim-64 main case and much
    # more of short sequences. History, all on the H200 against the default in alternating rounds:
    # 1. Tile lists in shared memory (least-loaded assignment; 13/13 checks, `python3 bench/
    #    bench_attention_mgpu.py --persistent`, attention-mgpu-2026-12-01-nvidia-h200-persistent2.
    #    {json,log}): shape 13's call (B=64 H=4 S=1024 hd 32) 146.2 against 134.4 TFLOP/s, but the main
    #    case 490.6 against 494.8, shape 14's call (B=8) 484.3 against 490.2, hd 128 S=16384 569.9
    #    against 588.2. Its main loop had 433 instructions against 427: the ready barriers' phase
    #    bookkeeping on per-thread instead of uniform registers (non-causal, balanced by construction,
    #    lost more, 465.9 against 487.4: persistent-why-2026-12-01-nvidia-h200.json), because the tile
    #    index came from a shared-memory load (confirmed by 2.; passing it through redux.sync had not
    #    helped: -uniform.json).
    # 2. The order computed from block id and round (`bench/scratch/persistent_why.py OUT 3 --more`,
    #    persistent-why-2026-12-01-nvidia-h200-arith.json): main loop 429 instructions (2 UMOV more),
    #    shape 13's call 155.1 against 135.2 (+14.7%; our generic kernel, which the model uses there,
    #    ran 164.9 in the first run), but with the heads interleaved at each tile position, long
    #    sequences lost 7-13% (main case 454.0 against 484.4, non-causal 433.8 against 487.4, B=8 420.0
    #    against 485.3, hd 128 S=16384 532.8 against 566.8): the blocks busy at one time no longer
    #    share one head's K/V in L2.
    # 3. Now: long sequences (a head has at least as many tiles as there are blocks) take a head-major
    #    order, short ones keep (2)'s. 13/13 checks on the H200 (`--persistent`, attention-mgpu-2026-12-
    #    01-nvidia-h200-persistent3.{json,log}); still slower on every long sequence
    #    (persistent-why-2026-12-01-nvidia-h200-headmajor.json, 3 rounds): main case 488.6 against
    #    495.3, non-causal 478.6 against 497.7, B=8 487.3 against 499.6, hd 128 S=16384 541.6 against
    #    580.2; shape 13's call 155.5 against 135.6 (our generic kernel there: 165.5). The SASS of the
    #    unmasked main loop is the default's (same opcodes, a few instructions reordered around the
    #    first HGMMA: persistent-sass-2026-12-01-nvidia-h200.tgz), and the non-causal loss does not grow
    #    with the number of tiles (4.1% at 782 key blocks per tile, 7.9% at 196, 2.4% at 49; the shorter
    #    two in (2)'s order: persistent-why-2026-12-01-nvidia-h200-tiles.json), so it is neither the
    #    schedule, nor the loop's code, nor a cost per tile; the producer's steady loop is the default's
    #    too (53 and 54 instructions), and the clock and power are the same (power-clocks-2026-12-01-
    #    nvidia-h200-ramp.json). Not found; left: runtime behaviour such as L2 hits under the static
    #    assignment. Nothing dispatches to it.
    # 4. Session 18: not L2 (one head, K/V inside L2: still -5.3% non-causal, -1.1% causal; persistent-
    #    why-2026-12-01-nvidia-h200-l2.json). The SASS that ran (Nsight Compute: ncu-attention-2026-12-
    #    01-nvidia-h200.json) differs from (3)'s offline dump: at non-causal S=100000 the main loop has
    #    438 instructions against 426, the barrier bookkeeping (block counter, slot, shared-memory base)
    #    in per-thread registers plus six R2UR for the wgmma descriptors, where the default uses uniform
    #    registers. Running the loops exactly each block's tile count (no branch around a tile) did not
    #    bring them back (442; causal slower: persistent-why-2026-12-01-nvidia-h200-exactcount.json).
    persistent: bool = False
    # Q as the register operand of Q @ K^T: each consumer loads its 64 rows of Q from shared memory into
    # registers once per tile (16 registers per thread at head_dim 64), and every Q @ K^T wgmma reads A
    # from there instead of from shared memory, as P @ V reads P. Why (session 18): the kernel runs at the
    # 700 W cap, so energy per FLOP sets its speed, and this takes a fifth of the consumers' shared-memory
    # reads (per warpgroup and key block: Q 8 KiB, K 16, V 16) off every block. Opt-in and much slower:
    # 393.6 against 489.8 TFLOP/s at the main case (both pass the harness rule on rows [:2048]), 91.7 M SM
    # cycles per call against 66.0 M (ncu), because with three consumers ptxas has no registers left to
    # keep the wgmmas in flight: "(C7512) wgmma.mma_async instructions are serialized due to insufficient
    # register resources", 36 WARPGROUP.DEPBAR against 4 (bench/results/variant-power-2026-12-01-nvidia-
    # h200-q-registers.{json,log}, ptxas-2026-12-01-nvidia-h200-session18-q-registers.log). It drew the
    # same 690 W at a higher sampled clock, so per cycle it spent less energy, per call more.
    q_in_registers: bool = False
    # K and V blocks shared by the two CUDA blocks of a cluster (session 19): the grid's query tiles are
    # taken in pairs, each pair one 2-block cluster, and every KV block both tiles need is loaded once
    # for the two, each block's TMA loading half its rows and multicasting them into both blocks'
    # shared memory (`copy_gmem_to_smem(..., collective_axes=...)`). Before a shared block goes into a
    # slot, each producer waits for its own consumers to release the slot (as without clusters), then
    # tells the other producer so and waits for its word (a cluster barrier of the two producers):
    # the consumers' loop is the default's. Under causal masking the pair's upper tile needs a block
    # or two more than the lower one, which it loads alone; a pair whose second tile is past the last
    # (an odd tile count) has a member with no tile, which loads nothing. Both members wait for each
    # other at the end (a cluster barrier of all warpgroups): no block exits while the other may still
    # arrive on its barriers. Why: the kernel runs at the 700 W cap (docs/power.md), so energy per FLOP
    # sets its speed, and this halves the K/V traffic from L2 to the SMs (the main case moves ~107 GB per
    # call that way, 32 KiB per tile and block, ~2.5 TB/s), at the cost of coupling the two blocks.
    # Not in the persistent build, nor with grid_order="tiles_outer" or interpret mode (no clusters).
    # First build (commit 7a790eb): the consumers arrived on cluster barriers of the slots
    # themselves (and twice on the upper tile's own blocks): 34/34 checks on the H200, but 463.9 against
    # 495.3 TFLOP/s at the main case (bench/results/attention-mgpu-2026-12-02-nvidia-h200-multicast.json);
    # ncu at B=1 H=16 S=16384 causal: 8.4% more instructions, 12.7% more active SM cycles, all 132 SMs
    # busy (66 clusters fit; ...-multicast-ncu.txt): each cluster arrive is ~10 instructions in
    # every consumer warp, twice per block, in the issue-bound loop.
    kv_multicast: bool = False
    # The producer's loads issued by one warp of its warpgroup (`pl.core_map` over `plgpu.WarpMesh`,
    # warp 0; FA3's producer is one warp too) instead of all four: each barrier wait, copy and cluster
    # arrive then runs in 32 threads, and the copies' per-thread `arrive.expect_tx` and the warpgroup
    # barrier Mosaic GPU puts before each copy in a warpgroup context go away; the other three warps
    # wait at the warpgroup barrier after the loop. Why (session 21): Nsight Compute counted the
    # producer's loop in all four warps, 104 instructions per warp and key block with kv_multicast
    # (ncu-source-2026-12-02-nvidia-h200-summary.txt), 7% of the kernel's instructions, issued from
    # the same four SM sub-partitions as the consumers' issue-bound loop. The cluster arrive of
    # kv_multicast goes through `compat.mosaic_cluster_arrive_from_warp` (jax refuses it in a warp
    # context). Measured on the H200 at the main case: 499.8 against 494.6 TFLOP/s (5 of 5 rounds),
    # Nsight Compute 16.70 G instructions against 17.90 G, 65.4 M SM cycles against 66.3 M
    # (bench/results/variant-power-2026-12-02-nvidia-h200-warp-producer.json,
    # ncu-2026-12-02-nvidia-h200-warp-producer.txt): the default at head_dim 32 and 64 (_DEFAULT_BLOCK_SIZES).
    # Lane lowering only (the warpgroup lowering has no warp-level copies: a default tiling lowered that
    # way drops it); not in the persistent build; in interpret mode the loads run as without it.
    warp_producer: bool = False

    def __post_init__(self):
        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)
        if not is_int(self.block_kv) or self.block_kv < 64 or self.block_kv > 256 or self.block_kv % 64:
            raise ValueError(f"MgpuBlockSizes.block_kv={self.block_kv!r} must be 64, 128, 192 or 256")
        if not is_int(self.num_stages) or self.num_stages < 2:
            raise ValueError(f"MgpuBlockSizes.num_stages={self.num_stages!r} must be an int >= 2")
        if self.num_compute_wgs not in _REGISTERS or not is_int(self.num_compute_wgs):
            raise ValueError(f"MgpuBlockSizes.num_compute_wgs={self.num_compute_wgs!r} must be 2 or 3")
        if not isinstance(self.overlap_softmax, bool):
            raise ValueError(f"MgpuBlockSizes.overlap_softmax={self.overlap_softmax!r} must be a bool")
        if not isinstance(self.overlap_one_accumulator, bool):
            raise ValueError(f"MgpuBlockSizes.overlap_one_accumulator={self.overlap_one_accumulator!r} must be a bool")
        if self.overlap_one_accumulator and not self.overlap_softmax:
            raise ValueError("overlap_one_accumulator is an order of overlap_softmax: set both")
        if self.overlap_softmax and self.num_compute_wgs != 2 and not self.overlap_one_accumulator:
            raise ValueError("overlap_softmax with a second accumulator needs num_compute_wgs=2 (3 consumers "
                             "have too few registers); overlap_one_accumulator=True keeps one")
        if (not is_int(self.poly_exp_keys) or self.poly_exp_keys < 0 or self.poly_exp_keys % 64
                or self.poly_exp_keys >= self.block_kv):
            raise ValueError(f"MgpuBlockSizes.poly_exp_keys={self.poly_exp_keys!r} must be a multiple of 64 "
                             f"(each key part is the depth of a P @ V wgmma, whose 128-byte swizzle takes 64 "
                             f"fp16 keys at a time) from 0 to below block_kv={self.block_kv}")
        if self.poly_exp_keys and self.overlap_softmax:
            raise ValueError("poly_exp_keys is built for the non-overlapped softmax (overlap_softmax=False)")
        if not isinstance(self.q_in_registers, bool):
            raise ValueError(f"MgpuBlockSizes.q_in_registers={self.q_in_registers!r} must be a bool")
        if not isinstance(self.row_sum_mma, bool):
            raise ValueError(f"MgpuBlockSizes.row_sum_mma={self.row_sum_mma!r} must be a bool")
        if self.row_sum_mma and (self.overlap_softmax or self.poly_exp_keys):
            raise ValueError("row_sum_mma is built for one key part and the non-overlapped softmax")
        if not isinstance(self.half_exp2, bool):
            raise ValueError(f"MgpuBlockSizes.half_exp2={self.half_exp2!r} must be a bool")
        if self.half_exp2 and (self.poly_exp_keys or self.row_sum_mma):
            raise ValueError("half_exp2 replaces the softmax's exp2 and row sums: not with poly_exp_keys "
                             "or row_sum_mma")
        for name in ("prescaled_q", "half_row_sum", "pingpong", "deferred_row_sum", "tree_row_max",
                     "lazy_rescale", "persistent", "kv_multicast", "warp_producer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MgpuBlockSizes.{name}={getattr(self, name)!r} must be a bool")
        if self.half_row_sum and (self.overlap_softmax or self.poly_exp_keys or self.row_sum_mma
                                  or self.half_exp2):
            raise ValueError("half_row_sum is built for one key part and the non-overlapped softmax with "
                             "fp32 exp2 (not with overlap_softmax, poly_exp_keys, row_sum_mma or half_exp2)")
        if self.deferred_row_sum and (self.row_sum_mma or self.half_exp2 or self.half_row_sum):
            raise ValueError("deferred_row_sum keeps the fp32 sums of the fp32 exp2: not with row_sum_mma, "
                             "half_exp2 or half_row_sum")
        if self.warp_producer and self.persistent:
            raise ValueError("warp_producer is built for the one-tile-per-block producer: not with persistent")
        if self.kv_multicast and self.persistent:
            raise ValueError("kv_multicast pairs the grid's query tiles into clusters: not with persistent")
        if self.lazy_rescale and (self.overlap_softmax or self.row_sum_mma or self.half_exp2 or self.half_row_sum
                                  or self.deferred_row_sum):
            raise ValueError("lazy_rescale is built for the plain non-overlapped softmax: not with overlap_softmax, "
                             "row_sum_mma, half_exp2, half_row_sum or deferred_row_sum")

    @property
    def block_q(self) -> int:
        """Query rows per CUDA block (all consumers together)."""
        return ROWS_PER_CONSUMER * self.num_compute_wgs


# Default block sizes per head_dim, from bench/results/attention-mgpu-2026-11-30-nvidia-h200-quick.json
# (H200, fp16, causal; `python bench/bench_attention_mgpu.py --quick`): at head_dim 64, S=100000, three
# consumer warpgroups with a 4-slot ring of 128-key blocks ran at 476 TFLOP/s against 346 for two
# consumers with softmax overlap, 415 without it and cuDNN's 451 in the same run. head_dim 128 (553
# TFLOP/s, cuDNN 527 at S=16384) and 256 (577, cuDNN 589) keep their first settings, measured there.
_DEFAULT_BLOCK_SIZES = {
    # head_dim 32 (session 15): head_dim 64's tiling, the fastest of six at S=8192 (273.4 TFLOP/s; 128-key
    # blocks with two consumers 224.6, 256 with two 232.8, 64 with three 219.4, 192 with three 208.8, the
    # warpgroup lowering 269.1) and at S=1024 (134.1; the next 133.4): ...-hd32.json
    # Both with the producer's loads from one warp (warp_producer, session 21; lane lowering only), measured
    # on the H200, fp16 causal, alternating rounds (`bash bench/scratch/warp_producer_run.sh OUT`, then
    # `..._run2.sh`; bench/results/variant-power-2026-12-02-nvidia-h200-warp-producer*.json): head_dim 64,
    # B=1 H=16 S=100000 (with multicast), 499.8 against 494.6 TFLOP/s (5 of 5 rounds) and 500.8 against
    # 495.5 (3); B=8, 497.5 against 490.3 (2 of 2); without multicast 491.0 against 488.2 (5 of 5);
    # head_dim 32, B=4 H=16 S=8192, 275.5 against 274.3 (3 of 3).
    32: MgpuBlockSizes(block_kv=128, num_stages=4, num_compute_wgs=3, warp_producer=True),
    64: MgpuBlockSizes(block_kv=128, num_stages=4, num_compute_wgs=3, warp_producer=True),
    128: MgpuBlockSizes(block_kv=128, num_stages=2, num_compute_wgs=2),
    256: MgpuBlockSizes(block_kv=64, num_stages=2, num_compute_wgs=2),
}
# `ttj_jax.kernels.flash_attention` sends mask-free fp16/bf16 calls with these head_dims to this kernel on
# sm_90 from this sequence length on. Measured against our generic (Triton) kernel in the run above:
# faster at S=16384 (head_dim 128: 553 against 416 TFLOP/s; 256: 577 against 226) and S=100000 (head_dim
# 64: 476 against 350); level at S=1024 (head_dim 64, B=64: 0.163 against 0.165 ms). Shorter sequences,
# where the official shapes' timings were taken with the generic kernel, stay there.
MIN_SEQ_LEN = 4096
# Fused-layout calls ([B, S, 3, H, hd] straight from the QKV projection, read in place by
# `flash_attention_mgpu_fused_qkv`) go to this kernel from these lengths on, per head_dim. Measured on the
# H200, B=64, 4 heads (2 at head_dim 64), causal, kernel time per call in place against our generic
# kernel on the same layout (bench/results/small-attention-2026-12-01-nvidia-h200-fused.json): S=128,
# head_dim 256 (shape 8's call) 24.3 against 27.9 us; 128: 10.6 against 11.4; 64: 5.6 against 4.6
# (slower); S=1024, head_dim 64: 146.3 against 165.2. Longer sequences were already faster here (above).
FUSED_MIN_SEQ_LEN = {64: 1024, 128: 1, 256: 1}
# head_dims whose own length threshold replaces MIN_SEQ_LEN. head_dim 32
# (session 15, bench/results/attention-mgpu-2026-12-01-nvidia-h200-hd32.json, `python3
# bench/bench_attention_mgpu.py --hd32`, 20/20 checks, medians of 3 alternating rounds, fp16 causal): at
# B=4 H=16 S=8192 this kernel 273.4 TFLOP/s against our generic kernel's 233.8 and cuDNN's 220.0; at shape
# 13's call (B=64 H=4 S=1024) slower, 134.1 against 164.9 (cuDNN 149.2), so shape 13 keeps the generic
# kernel. Nothing between was measured: from 8192 on.
UNFUSED_MIN_SEQ_LEN = {32: 8192}


def dispatch_min_seq_len(head_dim: int, fused: bool) -> int:
    """From which sequence length `ttj_jax.kernels.flash_attention` sends a mask-free fp16/bf16 call at
    this head_dim to this kernel on sm_90; fused: the call reads a [B, S, 3, H, hd] array."""
    if fused and head_dim in FUSED_MIN_SEQ_LEN:
        return FUSED_MIN_SEQ_LEN[head_dim]
    return UNFUSED_MIN_SEQ_LEN.get(head_dim, MIN_SEQ_LEN)


def swizzle_bytes(head_dim: int, itemsize: int) -> int:
    """The shared-memory swizzle of the Q, K and V tiles: 128 bytes, or a row's width where it is less
    (head_dim 32 in fp16: 64 bytes; wgmma then takes K in steps of 32 keys or head dims, not 64)."""
    return min(128, head_dim * itemsize)


def smem_bytes(head_dim: int, itemsize: int, blocks: MgpuBlockSizes) -> int:
    """Shared memory the kernel allocates: Q (reused for the output) and the K/V ring, plus barriers."""
    tiles = head_dim * itemsize * (blocks.block_q + 2 * blocks.num_stages * blocks.block_kv)
    if blocks.row_sum_mma:   # each consumer's ones matrix
        tiles += blocks.num_compute_wgs * blocks.block_kv * ROW_SUM_COLUMNS * itemsize
    num_barriers = blocks.num_compute_wgs * 2 + blocks.num_stages * 4
    if blocks.persistent:   # the output's staging buffer and the schedule's barrier (its table: _launch)
        tiles += head_dim * itemsize * blocks.block_q
        num_barriers += 1
    return tiles + 8 * num_barriers


def check_block_sizes(head_dim: int, itemsize: int, blocks: MgpuBlockSizes) -> None:
    """Raises ValueError when `blocks` cannot run at this head_dim (shared memory or registers)."""
    if smem_bytes(head_dim, itemsize, blocks) > SMEM_BUDGET_BYTES:
        raise ValueError(f"{blocks} at head_dim={head_dim} needs {smem_bytes(head_dim, itemsize, blocks)} "
                         f"bytes of shared memory, more than {SMEM_BUDGET_BYTES}")
    if blocks.overlap_softmax and not blocks.overlap_one_accumulator and (head_dim > 64 or blocks.block_kv > 128):
        raise ValueError(f"overlap_softmax keeps two [64, head_dim] fp32 accumulators and two P blocks in "
                         f"registers: head_dim={head_dim} must be 64 and block_kv={blocks.block_kv} <= 128")
    # one accumulator: FA3's budgets (head_dim 64 with three consumers, 128 with two)
    if blocks.overlap_one_accumulator and (head_dim > 128 or blocks.block_kv > 128
                                           or (blocks.num_compute_wgs == 3 and head_dim > 64)):
        raise ValueError(f"overlap_one_accumulator keeps the output, the scores and two P blocks in registers: "
                         f"head_dim={head_dim} must be 64 (128 with two consumers) and block_kv={blocks.block_kv} "
                         f"<= 128")
    if blocks.num_compute_wgs == 3 and head_dim > 128:
        raise ValueError(f"num_compute_wgs=3 leaves 160 registers per thread: head_dim={head_dim} must be <= 128")
    if blocks.num_compute_wgs == 3 and blocks.block_kv > 192:
        raise ValueError(f"block_kv={blocks.block_kv} with num_compute_wgs=3 gave wrong outputs on the H200 "
                         "(bench/results/attention-mgpu-2026-11-30-nvidia-h200-sweep.json): at most 192")


# From these lengths on, per head_dim, the defaults above give way to these. head_dim 128: the one-
# accumulator softmax overlap (overlap_one_accumulator), 1.5-2.3% faster than the two-consumer build
# above at S=16384 and 32768 and level at S=4096 on the H200 (B=1 H=16 S=16384: 583.6 and 586.2 against
# 574.7 and 574.5 TFLOP/s, cuDNN 527.8; S=32768: 597.9 and 599.2 against 584.4 and 588.3; B=4 S=4096:
# 497.5 and 498.5 against 492.0 and 496.2; two rounds in alternating order, 5/5 checks passed:
# bench/results/attention-mgpu-2026-12-01-nvidia-h200-hd128-overlap.json). Shorter sequences (the
# fused-layout calls at S=128) keep the build their timings were taken with. At head_dim 64 the same
# overlap with three consumers lost (479 against 494 TFLOP/s: attention-mgpu-2026-12-01-nvidia-h200-
# overlap.json), so 64 has no entry.
_LONG_SEQ_BLOCK_SIZES = {
    128: (4096, MgpuBlockSizes(block_kv=128, num_stages=2, num_compute_wgs=2, overlap_softmax=True,
                               overlap_one_accumulator=True)),
}


# K/V multicast to 2-block clusters (MgpuBlockSizes.kv_multicast) from these lengths on, per head_dim.
# Measured on the H200, fp16 causal, alternating rounds, faster in every round unless said:
# - session 19 (`python3 bench/bench_attention_mgpu.py --multicast`, 34/34 checks; bench/results/attention-
#   mgpu-2026-12-02-nvidia-h200-multicast2.json): head_dim 64, B=1 H=16 S=100000, 494.2 against 489.3
#   TFLOP/s (5 rounds); B=8, 488.8 against 486.6 (2); head_dim 128, B=1 H=16 S=16384, 599.4 against 580.0 (3).
# - session 20, below those lengths (`--multicast_lengths`, 12/12 checks, 3 rounds each, multicast as
#   with_kv_multicast builds it; ...-multicast_lengths.json): head_dim 64, B=2 S=32768, 482.7 against
#   480.1; B=4 S=16384 level (461.9 against 461.2, 1 of 3 rounds faster), so 64 starts at 32768;
#   head_dim 128, B=4 S=4096, 504.3 against 496.4, B=2 S=8192, 559.3 against 540.0; head_dim 256, B=1
#   S=16384, 614.3 against 596.6. Shorter lengths were not measured (head_dim 128's long-sequence tiling,
#   which these runs used, starts at 4096 too); head_dim 32 keeps its tiling without it.
MULTICAST_MIN_SEQ_LEN = {64: 32768, 128: 4096, 256: 16384}
# With multicast, these head_dims also drop the consumers' ping-pong token ring (MgpuBlockSizes.pingpong).
# Measured on the H200 (session 20, `PYTHONPATH=. python3 bench/scratch/variant_power.py OUT 5 pingpong=0
# ... --causal-only`, alternating rounds, fp16 causal; bench/results/variant-power-2026-12-02-nvidia-h200-
# pingpong{1,2}.json): head_dim 64, B=1 H=16 S=100000, faster in all 8 rounds of two runs, 498.8 against
# 494.5 TFLOP/s (3 rounds) and 495.7 against 491.7 (5); Nsight Compute: 66.3 M SM cycles against 66.9 M,
# 1.5% fewer instructions; B=8 (shape 14's call), 484.6 against 481.9 in 3 of 3 rounds (...-pingpong3-
# b8.json). Without multicast it was level (491.2 against the multicast default's 491.7; session 16:
# 485.2 against 484.0). head_dim 128, S=16384: level (594.3 against 594.8), so it keeps it.
MULTICAST_WITHOUT_PINGPONG = frozenset({64})


def default_block_sizes(head_dim: int, seq_len: int | None = None, *, kv_multicast: bool = True) -> MgpuBlockSizes:
    """The default block sizes at this head_dim (and sequence length, where the tables have a
    long-sequence entry for it; None: the short-sequence default). kv_multicast=False: the tiling as it
    runs without clusters (no multicast, so the ping-pong ring too), for builds that cannot take them
    (persistent) and for studies that compare against multicast."""
    blocks = _DEFAULT_BLOCK_SIZES[head_dim]
    if seq_len is not None and head_dim in _LONG_SEQ_BLOCK_SIZES:
        min_len, long_blocks = _LONG_SEQ_BLOCK_SIZES[head_dim]
        if seq_len >= min_len:
            blocks = long_blocks
    if kv_multicast and seq_len is not None and seq_len >= MULTICAST_MIN_SEQ_LEN.get(head_dim, math.inf):
        blocks = with_kv_multicast(blocks, head_dim)
    return blocks


def persistent_block_sizes(head_dim: int, seq_len: int | None = None) -> MgpuBlockSizes:
    """The default tiling as the persistent build (MgpuBlockSizes.persistent; opt-in, for studies) takes
    it: without clusters (kv_multicast=False, so with the ping-pong ring) and with the producer's loads
    from all four warps (warp_producer=False), the two options the persistent producer does not have."""
    return dataclasses.replace(default_block_sizes(head_dim, seq_len, kv_multicast=False), persistent=True,
                               warp_producer=False)


def with_kv_multicast(blocks: MgpuBlockSizes, head_dim: int) -> MgpuBlockSizes:
    """`blocks` with K/V multicast as the defaults take it: at MULTICAST_WITHOUT_PINGPONG's head_dims
    also without the ping-pong token ring."""
    return dataclasses.replace(blocks, kv_multicast=True,
                               pingpong=blocks.pingpong and head_dim not in MULTICAST_WITHOUT_PINGPONG)


def resolve_block_sizes(seq_len: int, head_dim: int, itemsize: int,
                        block_sizes: MgpuBlockSizes | None) -> MgpuBlockSizes:
    """The block sizes a call runs with: given or default, stages clamped to the number of KV blocks."""
    blocks = default_block_sizes(head_dim, seq_len) if block_sizes is None else block_sizes
    check_block_sizes(head_dim, itemsize, blocks)
    num_kv_blocks = pl.cdiv(seq_len, blocks.block_kv)
    # A ring longer than the sequence would only preload nothing; 2 stays the minimum for overlap.
    return dataclasses.replace(blocks, num_stages=max(2, min(blocks.num_stages, num_kv_blocks)))


def launch_block_sizes(seq_len: int, head_dim: int, itemsize: int, block_sizes: MgpuBlockSizes | None,
                       interpret) -> MgpuBlockSizes:
    """resolve_block_sizes, except that in interpret mode a default tiling with three consumer warpgroups
    runs with two: jax's interpreter can hang with three (see the list at the end of this file), and two
    compute every row the same way; and a default with kv_multicast runs without it (no clusters
    there; the output is the same, bit for bit: it changes only how K/V reach shared memory). Blocks
    asked for explicitly are kept."""
    blocks = resolve_block_sizes(seq_len, head_dim, itemsize, block_sizes)
    if interpret and block_sizes is None and blocks.kv_multicast:
        blocks = dataclasses.replace(blocks, kv_multicast=False)
    if interpret and block_sizes is None and blocks.num_compute_wgs == 3:
        blocks = dataclasses.replace(blocks, num_compute_wgs=2)
        check_block_sizes(head_dim, itemsize, blocks)
    return blocks


# Persistent kernel (MgpuBlockSizes.persistent): in interpret mode a few programs, each with several tiles.
PERSISTENT_INTERPRET_PROGRAMS = 3


def sm_count() -> int:
    """SMs of the first GPU jax sees (the persistent kernel's block count); 132 (an H200) where jax has
    no GPU, e.g. when lowering for CUDA on a CPU machine."""
    for device in jax.devices():
        count = getattr(device, "core_count", None)
        if device.platform == "gpu" and isinstance(count, int) and count > 0:
            return count
    return 132


def persistent_tile(j, program, num_programs: int, batch: int, num_heads: int, num_q_tiles: int, causal: bool):
    """The persistent kernel's j-th tile of block `program`: (valid, sequence, head, query tile), valid
    False past the last tile. Python ints, or traced int32 scalars (the kernel's loop index and program
    id: every value derived from them is then uniform across the block's threads to ptxas, which a tile
    list read from shared memory was not, costing the main loop's barrier bookkeeping its uniform
    registers: bench/results/persistent-why-2026-12-01-nvidia-h200.json).

    Round j hands the next num_programs tiles of one fixed order to the programs, forward in even
    rounds and backward in odd ones (a snake: neighbouring tiles differ little in cost, so each pair of
    rounds gives every program about the same work). The order, when a head has at least as many
    query tiles as there are programs (long sequences): head by head, each head's tiles by cost, so
    that the programs busy at one time share one head's K/V in L2 (as the one-block-per-tile grid's
    launch order does; interleaving the heads cost 7-13% at S=100000:
    persistent-why-2026-12-01-nvidia-h200-arith.json); causal, alternate heads run light to heavy so
    that the cost never jumps between heads, and the last one heavy to light, so that the schedule ends
    on the lightest tiles. Shorter sequences (a round spans many heads, and the snake's pairs would not
    balance): sequence by sequence, within one the tiles by cost and within a tile position the heads,
    alternate sequences light to heavy."""
    position = _where(_rem(j, 2) == 0, program, num_programs - 1 - program)
    linear = j * num_programs + position
    valid = linear < batch * num_heads * num_q_tiles
    if num_q_tiles >= num_programs:   # head-major
        group, rank = _floordiv(linear, num_q_tiles), _rem(linear, num_q_tiles)
        sequence, head = _floordiv(group, num_heads), _rem(group, num_heads)
        last_group = batch * num_heads - 1
    else:   # sequence-major, tiles by cost, then heads
        sequence, within = _floordiv(linear, num_heads * num_q_tiles), _rem(linear, num_heads * num_q_tiles)
        rank, head = _floordiv(within, num_heads), _rem(within, num_heads)
        group, last_group = sequence, batch - 1
    if causal:
        tile = _where(_rem(last_group - group, 2) == 0, num_q_tiles - 1 - rank, rank)
    else:
        tile = rank
    return valid, sequence, head, tile


def persistent_schedule(batch: int, num_heads: int, num_q_tiles: int, causal: bool,
                        num_programs: int) -> list[list[tuple[int, int, int]]]:
    """Each persistent block's (sequence, head, query tile) list, in order (persistent_tile in Python)."""
    lists = [[] for _ in range(num_programs)]
    for j in range(_cdiv(batch * num_heads * num_q_tiles, num_programs)):
        for program in range(num_programs):
            valid, *item = persistent_tile(j, program, num_programs, batch, num_heads, num_q_tiles, causal)
            if valid:
                lists[program].append(tuple(item))
    return lists


def attention_flops(batch: int, seq_len: int, num_heads: int, head_dim: int, causal: bool) -> float:
    """Matmul FLOPs of the forward pass: 4 * B * H * S^2 * hd, halved under causal attention."""
    flops = 4.0 * batch * num_heads * seq_len * seq_len * head_dim
    return flops / 2 if causal else flops


def padded_seq_len(seq_len: int) -> int:
    """The sequence length the kernel's arrays have: S itself when S % 8 == 0 or S < 8, else the next
    multiple of 8 (Mosaic GPU's TMA path tiles the sequence axis by 8 rows and needs whole tiles)."""
    return seq_len if seq_len < 8 or seq_len % 8 == 0 else seq_len + (-seq_len % 8)


def _cdiv(a, b: int):
    if isinstance(a, int):
        return -(-a // b)
    return lax.div(a + (b - 1), jnp.int32(b))


def _floordiv(a, b: int):
    # Only for a >= 0, where truncation equals floor division.
    return a // b if isinstance(a, int) else lax.div(a, jnp.int32(b))


def _rem(a, b: int):
    # Only for a >= 0, where the remainder is the modulus.
    return a % b if isinstance(a, int) else lax.rem(a, jnp.int32(b))


def _where(condition, a, b):
    return (a if condition else b) if isinstance(condition, bool) else jnp.where(condition, a, b)


def _minimum(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


def kv_block_range(row_start, num_rows: int, seq_len: int, block_kv: int, causal: bool):
    """KV blocks that rows [row_start, row_start + num_rows) visit: (num_unmasked, num_visited).

    Blocks [0, num_unmasked) need no mask for any of these rows; blocks [num_unmasked, num_visited)
    need the causal mask (causal) or the `key < seq_len` mask (otherwise); later blocks hold no key
    these rows may see. Works on Python ints and on traced int32 scalars (the kernel's program ids).
    """
    num_kv_blocks = _cdiv(seq_len, block_kv)
    if not causal:
        return seq_len // block_kv, num_kv_blocks
    # Block j is below the diagonal of every row when its last key (j + 1) * block_kv - 1 < row_start.
    num_unmasked = _minimum(_floordiv(row_start, block_kv), num_kv_blocks)
    num_visited = _minimum(_cdiv(row_start + num_rows, block_kv), num_kv_blocks)
    return num_unmasked, num_visited


class ConsumerPlan(NamedTuple):
    """The KV blocks one consumer warpgroup handles, in order (ints, or traced int32 scalars)."""
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

    The pair's grid positions are 2 * pair and 2 * pair + 1, mapped to query tiles as without clusters
    (causal: heaviest first, so member 0 has the upper tile). valid is False for a position past the
    last tile (the second member of the last pair when the tile count is odd). shared_blocks: the KV
    blocks [0, shared_blocks) both members load together, those of member 1's tile (0 if it has none):
    member 0's tile needs all of them, and under causal masking a block or two more, which it loads
    alone. Python ints, or traced int32 scalars."""
    def tile_of(position):
        tile = num_q_tiles - 1 - position if causal else position
        valid = (tile >= 0) & (tile < num_q_tiles)
        return valid, _where(valid, tile, 0)
    valid, tile = tile_of(2 * pair + member)
    partner_valid, partner_tile = tile_of(2 * pair + 1)
    _, partner_blocks = kv_block_range(partner_tile * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv,
                                       causal)
    return valid, tile, _where(partner_valid, partner_blocks, 0)


# --- Version-dependent Mosaic GPU API, in one place (jax 0.10.2 on CPUs, 0.11.2 on the H200) ---------
# `jax.experimental.pallas.mosaic_gpu` imports absl (layout inference logs through it), which the
# CPU environment may lack, so it is imported on first use, not when this module loads.
# - Lowering semantics: jax's default changed from Lane (0.10) to Warpgroup (0.11); ours is chosen per
#   head_dim below (_DEFAULT_LOWERING) and always passed.
# - Barrier(num_barriers=...) defaulted to 1 in 0.10 and to a scalar () in 0.11; always passed.
# - SMEM refs are transposed with `ref.transpose(...)` (0.11 deprecates `plgpu.transpose_ref`).
# - copy_gmem_to_smem's `oob_mode` defaults to zero fill in both; passed explicitly because the
#   kernel relies on it for sequence lengths that are not block multiples.
LOWERING_SEMANTICS = ("warpgroup", "lane")
# The default lowering per head_dim. head_dim 64: "lane", faster than "warpgroup" in all five comparisons on
# the H200 (main case B=1, H=16, S=100000: 496.5 against 492.2, 493.6 against 486.6, 496.6 against 491.0
# TFLOP/s; shape 14's call B=32: 488.8 against 486.2, 492.3 against 484.2; attention-mgpu-2026-11-30-nvidia-
# h200-{grid-session4,grid-session5,rowsum}.json). 128 and 256: "warpgroup", the lowering their timings
# were taken with (lane not compared there). 32: "lane", faster than "warpgroup" at S=8192 (273.4 against 269.1)
# and S=1024 (134.1 against 130.5; ...-hd32.json).
_DEFAULT_LOWERING = {32: "lane", 64: "lane", 128: "warpgroup", 256: "warpgroup"}


def default_lowering_semantics(head_dim: int) -> str:
    return _DEFAULT_LOWERING[head_dim]


def _plgpu():
    import jax.experimental.pallas.mosaic_gpu as plgpu  # noqa: PLC0415 - see the comment above
    return plgpu


def _compiler_params(lowering_semantics: str):
    plgpu = _plgpu()
    semantics = {"lane": plgpu.LoweringSemantics.Lane,
                 "warpgroup": plgpu.LoweringSemantics.Warpgroup}[lowering_semantics]
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=semantics)


def _attention_kernel(q_ref, k_ref, v_ref, out_ref, scoped, *, causal: bool, sm_scale: float,
                      seq_len: int, num_q_tiles: int, head_dim: int, blocks: MgpuBlockSizes, dtype, interpret=False,
                      lse_ref=None, num_heads: int | None = None, batch_size: int | None = None,
                      num_programs: int | None = None):
    # Refs: q, k, v, out [B, S, H, hd] in GMEM; lse_ref [B, H, S] fp32 in GMEM or None (return_lse).
    # num_heads, batch_size, num_programs: the persistent kernel's (persistent_tile), else None.
    # scoped: shared memory and barriers for all warpgroups.
    plgpu, pl = (_InterpretPlgpu(scoped), _InterpretPallas()) if interpret else (_plgpu(), _PALLAS)
    (q_smem, k_smem, v_smem, *other_smem), (q_ready, k_ready, v_ready, k_consumed, v_consumed, tokens,
                                                *cluster_barriers) = scoped
    num_wgs, block_kv, num_stages = blocks.num_compute_wgs, blocks.block_kv, blocks.num_stages
    rows = ROWS_PER_CONSUMER
    wg = lax.axis_index("wg")
    if not blocks.persistent:   # one tile per CUDA block, from the grid
        batch, head = lax.axis_index(_GRID_SEQUENCE), lax.axis_index(_GRID_HEAD)
        if blocks.kv_multicast:   # the grid's tile axis counts pairs (see multicast_pair)
            tile_valid, tile, shared_blocks = multicast_pair(
                lax.axis_index(_GRID_Q_TILE), lax.axis_index(_CLUSTER_MEMBER), num_q_tiles, seq_len, blocks,
                causal)
        else:
            tile = lax.axis_index(_GRID_Q_TILE)
            if causal:
                tile = num_q_tiles - 1 - tile   # heaviest tiles first
        tile_start = tile * blocks.block_q

    def kv_rows(block):
        return pl.ds(block * block_kv, block_kv)

    def slot_of(block):
        # A tile's block j is in slot j % num_stages, in a persistent block too: there the ring starts
        # over at slot 0 with each tile (an offset carried from tile to tile cost the issue-bound main
        # loop 6 instructions and 1.4%: bench/results/attention-mgpu-2026-12-01-nvidia-h200-persistent.json)
        return lax.rem(block, jnp.int32(num_stages))

    def consume(batch, head, tile_start, *, item=None, prefetch_next_q=None, o_wg=None):
        """One query tile's work for consumer `wg`. item: None (one tile per CUDA block), or the
        persistent loop's index (its Q is loaded by the loop, prefetch_next_q() loads the next
        tile's once this one's last Q @ K^T is done, and the output is staged in o_wg)."""
        row_start = tile_start + wg * rows
        q_wg = q_smem.at[wg]
        if item is None:
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row_start, rows), head], q_wg, q_ready.at[wg],
                                    oob_mode=plgpu.OOBFillMode.ZEROS)
        plan = consumer_plan(tile_start, wg, seq_len, blocks, causal)
        # The keys of a block in one part, or two with poly_exp_keys: [0, block_kv - n) and the last n,
        # each part its own Q @ K^T and P @ V wgmma (nothing is sliced in registers).
        part_widths = ((block_kv - blocks.poly_exp_keys, blocks.poly_exp_keys) if blocks.poly_exp_keys
                       else (block_kv,))
        part_offsets = (0, block_kv - blocks.poly_exp_keys)[:len(part_widths)]

        def key_parts(slot_ref):   # a K or V slot [block_kv, head_dim] -> its parts
            if len(part_widths) == 1:
                return (slot_ref,)
            return tuple(slot_ref.at[pl.ds(offset, width)] for offset, width in zip(part_offsets, part_widths))

        score_scale = sm_scale * _LOG2_E
        row_layout = plgpu.Layout.WGMMA.reduce(1)

        def scaled(x):   # raw scores (or their row max) in the softmax's base-2 units
            return x if blocks.prescaled_q else x * score_scale

        def wgmma_zeros(shape):
            return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)

        def softmax(scores, block, m_prev, l_prev, masked: bool, p_dtype=dtype):
            # scores: the (64, width) fp32 raw q.k of each key part (one part of block_kv keys, or two:
            # see key_parts). Returns the new running max and sum, P per part in p_dtype (the input
            # dtype unless asked), and alpha = exp2(m_prev - m_new), the factor for what was accumulated
            # before.
            if masked:
                def mask(part, offset):
                    # no "+ 0" for the first part: the pinned lowerings (tests) are of the build without it
                    first_key = block * block_kv + offset if offset else block * block_kv
                    key = first_key + plgpu.broadcasted_iota(jnp.int32, part.shape, 1, layout=plgpu.Layout.WGMMA)
                    if causal:
                        query = row_start + plgpu.broadcasted_iota(
                            jnp.int32, part.shape, 0, layout=plgpu.Layout.WGMMA)
                        allowed = key <= query
                    else:
                        allowed = key < seq_len
                    return jnp.where(allowed, part, -jnp.inf)
                scores = tuple(mask(part, offset) for part, offset in zip(scores, part_offsets))
            if blocks.tree_row_max:
                row_max = _chunk_tree(scores, jnp.maximum).max(axis=1)
            else:
                row_max = scores[0].max(axis=1)
                for part in scores[1:]:
                    row_max = jnp.maximum(row_max, part.max(axis=1))
            m_new = jnp.maximum(m_prev, scaled(row_max))
            if blocks.lazy_rescale:   # the max moves only by more than the threshold (MgpuBlockSizes)
                moved = m_new > m_prev + LAZY_RESCALE_THRESHOLD
                m_new = jnp.where(moved, m_new, m_prev)
                alpha = jnp.where(moved, jnp.exp2(m_prev - m_new), 1.0)
            else:
                alpha = jnp.exp2(m_prev - m_new)
            if blocks.half_exp2:   # one key part (MgpuBlockSizes refuses poly_exp_keys here)
                exponent = (scaled(scores[0]) - lax.broadcast_in_dim(m_new, scores[0].shape, [0])).astype(dtype)
                p = mosaic_half_exp2(exponent, interpret=bool(interpret))
                return m_new, l_prev * alpha + p.sum(axis=1).astype(jnp.float32), (p,), alpha
            # the first part's exp2 on the MUFU (ex2.approx), the second's from a polynomial on the FMA
            # units (poly_exp_keys): the two pipes share the work
            poly = functools.partial(_exp2_poly, exact_round=bool(interpret))
            ps = tuple((jnp.exp2 if i == 0 else poly)(scaled(part) - lax.broadcast_in_dim(
                m_new, part.shape, [0])) for i, part in enumerate(scores))
            if blocks.row_sum_mma:   # l is the [64, 16] accumulator: the P @ V phase adds P's sums
                return m_new, l_prev, tuple(part.astype(dtype) for part in ps), alpha
            if blocks.half_row_sum:   # one key part, fp16, not overlapped (MgpuBlockSizes, _check_inputs)
                p_half = ps[0].astype(dtype)
                return m_new, l_prev * alpha + _packed_row_sum(p_half), (p_half,), alpha
            if blocks.deferred_row_sum:   # l: [64, 8] per-lane partial sums (see MgpuBlockSizes)
                l_new = l_prev * lax.broadcast_in_dim(alpha, l_prev.shape, [0]) + _chunk_tree(ps, jnp.add)
                return m_new, l_new, tuple(part.astype(p_dtype) for part in ps), alpha
            l_new = l_prev * alpha + ps[0].sum(axis=1)
            for part in ps[1:]:
                l_new = l_new + part.sum(axis=1)
            return m_new, l_new, tuple(part.astype(p_dtype) for part in ps), alpha

        def next_token():
            if blocks.pingpong:
                plgpu.barrier_arrive(tokens.at[lax.rem(wg + 1, jnp.int32(num_wgs))])

        def wait_token():
            if blocks.pingpong:
                plgpu.barrier_wait(tokens.at[wg])

        # The interpreter cannot store into an accumulator: there P @ V goes into a zero one and is
        # added after (the same fp32 sum, init + (0 + P @ V), as its run_state substitute).
        one_accumulator = blocks.overlap_one_accumulator and not interpret

        def rescale(acc, alpha):
            if blocks.lazy_rescale:   # threads whose factors are all 1.0 skip the multiplies
                return mosaic_rescale_where_needed(acc, alpha, interpret=bool(interpret))
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        # The two halves of an overlapped P @ V (overlap_softmax) around its wgmma into pv_ref: with one
        # accumulator the output, rescaled by the previous block's alpha, is stored there before the
        # GEMMs and P @ V adds to it; with two, pv_ref starts at zero and the sum is taken after.
        def seed_pv(pv_ref, acc, alpha):
            if one_accumulator:
                pv_ref[...] = rescale(acc, alpha)

        def merge_pv(acc, alpha, pv):
            return pv if one_accumulator else rescale(acc, alpha) + pv

        # Prologue: S_0 = Q @ K_0^T alone. Consumer 0 holds the token first.
        m = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
        if blocks.row_sum_mma:
            # every column of P @ ones is P's row sum; the ones live in this warpgroup's SMEM
            ones = other_smem[-1 - (lse_ref is not None)].at[wg]
            ones[...] = plgpu.layout_cast(jnp.ones(ones.shape, dtype), plgpu.Layout.WGMMA)
            plgpu.commit_smem()   # visible to the tensor cores before the first wgmma reads them
            l = wgmma_zeros((rows, ROW_SUM_COLUMNS))
        else:
            l = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), row_layout)
        if blocks.deferred_row_sum:
            l = wgmma_zeros((rows, _CHUNK_COLUMNS))
        acc = wgmma_zeros((rows, head_dim))
        plgpu.barrier_wait(q_ready.at[wg])
        if blocks.prescaled_q:   # this warpgroup's Q in base-2 score units, visible to its wgmmas
            q_wg[...] = (q_wg[...].astype(jnp.float32) * score_scale).astype(dtype)
            plgpu.commit_smem()
        # the A operand of every Q @ K^T: this warpgroup's Q in shared memory, or in registers
        q_a = plgpu.layout_cast(q_wg[...], plgpu.Layout.WGMMA) if blocks.q_in_registers else q_wg
        plgpu.barrier_wait(k_ready.at[0])

        # Consumer 0 holds the token first: in a persistent block, only before its first tile
        @pl.when(wg > 0 if item is None else (wg > 0) | (item > 0))
        def _():
            wait_token()

        def first_scores(*s_refs):
            for s_ref, k_part in zip(s_refs, key_parts(k_smem.at[0])):
                plgpu.wgmma(s_ref, q_a, k_part.transpose((1, 0)))
            next_token()
            return tuple(s_ref[...] for s_ref in s_refs)

        scores = pl.run_scoped(first_scores, *(plgpu.ACC((rows, width), jnp.float32) for width in part_widths))
        plgpu.barrier_arrive(k_consumed.at[0])
        # The prologue block takes the mask whenever any block might: a no-op where it is not needed.
        m, l, p, alpha = softmax(scores, 0, m, l, masked=plan.prologue_masked)
        if not blocks.overlap_softmax and not blocks.lazy_rescale:   # (lazy: acc is zero, nothing to scale)
            acc = rescale(acc, alpha)

        def step(block, carry, *, masked: bool):
            # One GEMM phase (P_{block-1} @ V_{block-1} and Q @ K_block^T), then the softmax of `block`.
            acc, m, l, p, alpha = carry
            prev_slot, slot = slot_of(block - 1), slot_of(block)
            plgpu.barrier_wait(v_ready.at[prev_slot])
            plgpu.barrier_wait(k_ready.at[slot])
            wait_token()
            k_ts = tuple(part.transpose((1, 0)) for part in key_parts(k_smem.at[slot]))
            vs = key_parts(v_smem.at[prev_slot])
            if blocks.overlap_softmax:   # one key part (MgpuBlockSizes refuses poly_exp_keys here)
                def gemms(s_ref, pv_ref):
                    seed_pv(pv_ref, acc, alpha)   # before the GEMMs (see MgpuBlockSizes)
                    plgpu.wgmma(s_ref, q_a, k_ts[0])
                    plgpu.wgmma(pv_ref, p[0], vs[0])   # returns once Q @ K^T is done; P @ V keeps running
                    next_token()
                    scores = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)
                    plgpu.barrier_arrive(k_consumed.at[slot])
                    # P stays fp32 until P @ V has completed: registers that feed a later wgmma, written
                    # while one is in flight, made ptxas serialize every wgmma (C7513)
                    softmax_out = softmax((scores,), block, m, l, masked, p_dtype=jnp.float32)
                    return softmax_out, pv_ref[...]
                (m, l, p_next, alpha_next), pv = pl.run_scoped(
                    gemms, plgpu.ACC((rows, block_kv), jnp.float32), plgpu.ACC((rows, head_dim), jnp.float32))
                p_next = tuple(part.astype(dtype) for part in p_next)
                plgpu.barrier_arrive(v_consumed.at[prev_slot])
                # alpha of block - 1: P_{block-1} is relative to its max
                return merge_pv(acc, alpha, pv), m, l, p_next, alpha_next

            if blocks.row_sum_mma:
                def gemms(refs):
                    acc_ref, l_ref, s_ref = refs
                    plgpu.wgmma(acc_ref, p[0], vs[0])
                    plgpu.wgmma(l_ref, p[0], ones)
                    plgpu.wgmma(s_ref, q_a, k_ts[0])
                    next_token()
                acc, l, scores = pl.run_state(gemms)((plgpu.ACC.init(acc), plgpu.ACC.init(l),
                                                      plgpu.ACC.init(wgmma_zeros((rows, block_kv)))))
                plgpu.barrier_arrive(k_consumed.at[slot])
                plgpu.barrier_arrive(v_consumed.at[prev_slot])
                m, l, p_next, alpha_next = softmax((scores,), block, m, l, masked)
                return rescale(acc, alpha_next), m, rescale(l, alpha_next), p_next, alpha_next

            def gemms(refs):
                acc_ref, *s_refs = refs
                for p_part, v_part in zip(p, vs):
                    plgpu.wgmma(acc_ref, p_part, v_part)
                for s_ref, k_t in zip(s_refs, k_ts):
                    plgpu.wgmma(s_ref, q_a, k_t)
                next_token()
            acc, *scores = pl.run_state(gemms)((plgpu.ACC.init(acc), *(
                plgpu.ACC.init(wgmma_zeros((rows, width))) for width in part_widths)))
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_arrive(v_consumed.at[prev_slot])
            m, l, p_next, alpha_next = softmax(scores, block, m, l, masked)
            return rescale(acc, alpha_next), m, l, p_next, alpha_next

        carry = (acc, m, l, p, alpha)
        carry = _fori_loop(1, plan.first_masked, functools.partial(step, masked=False), carry)
        carry = _fori_loop(plan.first_masked, plan.num_visited, functools.partial(step, masked=True), carry)
        acc, m, l, p, alpha = carry

        # Epilogue: the last P @ V.
        if prefetch_next_q is not None:   # every wgmma reading this tile's Q has completed
            prefetch_next_q()
        last_slot = slot_of(plan.num_visited - 1)
        plgpu.barrier_wait(v_ready.at[last_slot])
        wait_token()
        if blocks.overlap_softmax:
            def last_pv(pv_ref):
                seed_pv(pv_ref, acc, alpha)
                plgpu.wgmma(pv_ref, p[0], v_smem.at[last_slot])
                next_token()
                return pv_ref[...]
            pv = pl.run_scoped(last_pv, plgpu.ACC((rows, head_dim), jnp.float32))
            acc = merge_pv(acc, alpha, pv)
        elif blocks.row_sum_mma:
            def last_pv(refs):
                acc_ref, l_ref = refs
                plgpu.wgmma(acc_ref, p[0], v_smem.at[last_slot])
                plgpu.wgmma(l_ref, p[0], ones)
                next_token()
            acc, l = pl.run_state(last_pv)((plgpu.ACC.init(acc), plgpu.ACC.init(l)))
            l = l.max(axis=1)   # its columns are equal
        else:
            def last_pv(acc_ref):
                for p_part, v_part in zip(p, key_parts(v_smem.at[last_slot])):
                    plgpu.wgmma(acc_ref, p_part, v_part)
                next_token()
            acc = pl.run_state(last_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_consumed.at[last_slot])

        # Blocks this tile loads but these rows never see (causal only): wait for each, release it,
        # and pass the token on, so the ring and the token order stay the same for every consumer.
        def skip(block, _):
            slot = slot_of(block)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_consumed.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_consumed.at[slot])
            wait_token()
            next_token()
        if causal:
            lax.fori_loop(plan.num_visited, plan.tile_blocks, skip, None)

        if blocks.deferred_row_sum:   # the one cross-lane reduction of the row sums
            l = l.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
        if o_wg is None:
            staged = q_wg   # every wgmma reading Q has completed
        else:   # persistent: the previous tile's stores must have read their SMEM first
            staged = o_wg
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        staged[...] = acc.astype(dtype)
        if lse_ref is not None:   # log(sum_j exp(sm_scale q.k_j)) = (m + log2 l) ln 2: m and l are in base 2
            lse_wg = other_smem[-1].at[wg]
            lse_wg[...] = (m + jnp.log2(l)) * _LN_2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staged, out_ref.at[batch, pl.ds(row_start, rows), head])
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_wg, lse_ref.at[batch, head, pl.ds(row_start, rows)])
        if item is None:
            plgpu.wait_smem_to_gmem(0)

    if blocks.persistent:
        o_smem = other_smem[len(_interpret_smem(interpret, 1, 8, 64, dtype))]
        program = lax.axis_index(_GRID_PROGRAM)

        def item_at(j):
            """(valid, batch, head, tile_start) of this block's j-th tile; valid False past its last."""
            valid, sequence, head, tile = persistent_tile(j, program, num_programs, batch_size, num_heads,
                                                          num_q_tiles, causal)
            return valid, sequence, head, tile * blocks.block_q

        def ring_steps(valid, tile_start):   # K/V blocks the tile loads into the ring (0 past the last tile)
            _, blocks_loaded = kv_block_range(tile_start, blocks.block_q, seq_len, block_kv, causal)
            return jnp.where(valid, blocks_loaded, 0)

        max_items = _cdiv(batch_size * num_heads * num_q_tiles, num_programs)   # rounds

    def with_tile(condition):   # kv_multicast: a member with no tile (multicast_pair) only waits, below
        return condition & tile_valid if blocks.kv_multicast else condition

    @pl.when(with_tile(wg < num_wgs))
    def _consumer():
        plgpu.set_max_registers(_REGISTERS[num_wgs][0], action="increase")
        if not blocks.persistent:
            consume(batch, head, tile_start)
            return
        q_wg, o_wg = q_smem.at[wg], o_smem.at[wg]

        def load_q(j):
            valid, batch, head, tile_start = item_at(j)

            @pl.when(valid)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(tile_start + wg * rows, rows), head], q_wg,
                                        q_ready.at[wg], oob_mode=plgpu.OOBFillMode.ZEROS)

        load_q(0)

        def run_item(j, _):
            valid, batch, head, tile_start = item_at(j)

            @pl.when(valid)
            def _():
                consume(batch, head, tile_start, item=j, prefetch_next_q=lambda: load_q(j + 1), o_wg=o_wg)
        lax.fori_loop(0, max_items, run_item, None)
        plgpu.wait_smem_to_gmem(0)

    if blocks.persistent:
        @pl.when(wg == num_wgs)
        def _persistent_producer():
            plgpu.set_max_registers(_REGISTERS[num_wgs][1], action="decrease")

            def load_item(j, filled):
                # filled: slots [0, filled) hold blocks of earlier tiles (the ring starts at slot 0 with
                # each tile; see slot_of)
                valid, batch, head, tile_start = item_at(j)
                steps = ring_steps(valid, tile_start)

                @pl.loop(0, steps)
                def _(block):
                    slot = slot_of(block)
                    for what_ref, smem, ready, consumed in ((k_ref, k_smem, k_ready, k_consumed),
                                                            (v_ref, v_smem, v_ready, v_consumed)):
                        @pl.when((block >= num_stages) | (block < filled))   # the slot's last block released
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])
                        plgpu.copy_gmem_to_smem(what_ref.at[batch, kv_rows(block), head], smem.at[slot],
                                                ready.at[slot], oob_mode=plgpu.OOBFillMode.ZEROS)
                return jnp.maximum(filled, jnp.minimum(steps, num_stages))
            lax.fori_loop(0, max_items, load_item, jnp.int32(0))
        return

    _, tile_blocks = kv_block_range(tile_start, blocks.block_q, seq_len, block_kv, causal)

    @pl.when(with_tile(wg == num_wgs))
    def _producer():
        plgpu.set_max_registers(_REGISTERS[num_wgs][1], action="decrease")

        def load(block, slot, what_ref, smem, ready):
            def copy(**collective):
                plgpu.copy_gmem_to_smem(what_ref.at[batch, kv_rows(block), head], smem.at[slot], ready.at[slot],
                                        oob_mode=plgpu.OOBFillMode.ZEROS, **collective)
            if not blocks.kv_multicast:
                copy()
                return
            together = block < shared_blocks   # each member loads half the rows, into both blocks
            pl.when(together)(functools.partial(copy, collective_axes=_CLUSTER_MEMBER))
            pl.when(jnp.logical_not(together))(copy)

        def fill(block):
            load(jnp.int32(block), block, k_ref, k_smem, k_ready)
            load(jnp.int32(block), block, v_ref, v_smem, v_ready)

        in_one_warp = blocks.warp_producer and not interpret
        cluster_arrive = mosaic_cluster_arrive_from_warp if in_one_warp else plgpu.barrier_arrive

        def wait_free(consumed, peer_free, block, slot):
            """Slot `slot` may take `block`: this block's consumers have released the slot's last block
            and, kv_multicast and `block` shared, the partner's have too (its producer says so)."""
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
                slot = slot_of(block)
                wait_free(k_consumed, k_peer_free, block, slot)
                load(block, slot, k_ref, k_smem, k_ready)
                wait_free(v_consumed, v_peer_free, block, slot)
                load(block, slot, v_ref, v_smem, v_ready)

        if in_one_warp:   # MgpuBlockSizes.warp_producer: warp 0 loads, the other three wait after the map
            @pl.core_map(plgpu.WarpMesh(axis_name=_PRODUCER_WARP))
            def _():
                pl.when(lax.axis_index(_PRODUCER_WARP) == 0)(loads)
        else:
            loads()

    if blocks.kv_multicast:   # every warpgroup of both members: no block exits while its partner may
        done = cluster_barriers[2]   # still arrive on its barriers or write into its shared memory
        plgpu.barrier_arrive(done.at[0])
        plgpu.barrier_wait(done.at[0])


# 2^f on [-0.5, 0.5]: a degree-4 polynomial fitted for relative error (at most 1e-5 in fp32, against the
# 2^-11 of P's fp16 rounding), Horner's rule: four FMAs.
_EXP2_POLY = (1.0000004768371582, 0.6931350231170654, 0.2402241975069046, 0.05581861734390259,
              0.009630154818296432)
_ROUND_MAGIC = 12582912.0   # 1.5 * 2^23: x + it holds round(x) in its low mantissa bits


def _exp2_poly(x, *, exact_round: bool = False):
    """exp2(x) for x <= 0 (-inf included) on the FMA units: x = j + f with j = round(x), 2^f from the
    polynomial, and j added to its exponent bits. x is clamped to -120 first (2^-120 for -inf: 0 after
    P's fp16 rounding, and nothing in the fp32 row sum), which keeps the exponent arithmetic normal.

    On the GPU j comes from adding and subtracting 1.5 * 2^23 (two fp32 adds, round to nearest even).
    XLA folds (x + c) - c to x, so where XLA runs the body (interpret mode on a CPU) `exact_round`
    rounds with lax.round instead: the same j (tests/test_flash_attention_mgpu.py checks the adds' j
    against it in NumPy's fp32)."""
    x = jnp.maximum(x, -120.0)
    if exact_round:
        j = lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)
        exponent = lax.shift_left(lax.convert_element_type(j, jnp.int32), jnp.int32(23))
    else:
        shifted = x + _ROUND_MAGIC
        j = shifted - _ROUND_MAGIC
        # bits(shifted) = bits(1.5 * 2^23) + j; shifted left by 23 the constant's bits leave the 32 bits
        # (its low 9 bits are 0), so what lands in the exponent field is j
        exponent = lax.shift_left(lax.bitcast_convert_type(shifted, jnp.int32), jnp.int32(23))
    f = x - j
    poly = _EXP2_POLY[4]
    for c in reversed(_EXP2_POLY[:4]):
        poly = poly * f + c
    return lax.bitcast_convert_type(lax.bitcast_convert_type(poly, jnp.int32) + exponent, jnp.float32)


_CHUNK_COLUMNS = 8   # one 8-column tile of the WGMMA layout: two columns of each of its rows per thread


def _chunk_tree(parts, combine):
    """combine() over the 8-column chunks of [64, n] arrays in the WGMMA layout, as a balanced tree:
    a [64, 8] array whose columns each thread holds for its rows (no cross-lane step). Slicing whole
    chunks picks registers; each combine is one instruction per register."""
    chunks = [part[:, i:i + _CHUNK_COLUMNS] for part in parts for i in range(0, part.shape[1], _CHUNK_COLUMNS)]
    while len(chunks) > 1:
        paired = [combine(a, b) for a, b in zip(chunks[0::2], chunks[1::2])]
        chunks = paired + ([chunks[-1]] if len(chunks) % 2 else [])
    return chunks[0]


def _packed_row_sum(p):
    """Row sums of a [64, n] fp16 P in the WGMMA layout, as fp32: the column halves added elementwise
    (registers holding two fp16 keys each, so one packed HADD2 per two keys) down to one 8-column
    tile, then converted and summed in fp32. A plain `p.sum(axis=1)` converts every element to fp32
    first (one HADD2.F32 per key on the H200: session 15's SASS), which is slower than fp32 sums."""
    while p.shape[1] > _CHUNK_COLUMNS and p.shape[1] % (2 * _CHUNK_COLUMNS) == 0:
        half = p.shape[1] // 2
        p = p[:, :half] + p[:, half:]
    if p.shape[1] > _CHUNK_COLUMNS:   # an odd number of 8-column chunks left (192 keys: 3 of them)
        p = _chunk_tree([p], jnp.add)
    return p.astype(jnp.float32).sum(axis=1)


def _fori_loop(lower, upper, body, carry):
    if isinstance(lower, int) and isinstance(upper, int) and lower >= upper:
        return carry
    return lax.fori_loop(lower, upper, body, carry)


def _check_inputs(q, k, v, causal, sm_scale, block_sizes):
    check_causal_and_scale(causal, sm_scale)
    if block_sizes is not None and not isinstance(block_sizes, MgpuBlockSizes):
        raise ValueError(f"block_sizes={block_sizes!r} must be an MgpuBlockSizes or None")
    check_qkv_layout(q, k, v)
    if jnp.dtype(q.dtype) not in _SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype={jnp.dtype(q.dtype)} must be float16 or bfloat16")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"q.shape={q.shape}: head_dim={q.shape[-1]} must be one of {SUPPORTED_HEAD_DIMS}")
    if any(size < 1 for size in q.shape):
        raise ValueError(f"q.shape={q.shape} must have no empty dimension")
    if block_sizes is not None and block_sizes.half_row_sum and jnp.dtype(q.dtype) != jnp.float16:
        raise ValueError(f"MgpuBlockSizes.half_row_sum sums P in float16: q.dtype={jnp.dtype(q.dtype)} "
                         "must be float16")
    if block_sizes is not None and block_sizes.q_in_registers and q.shape[-1] > 64:
        raise ValueError(f"MgpuBlockSizes.q_in_registers is built for head_dim <= 64 (Q's 64 rows take "
                         f"head_dim / 4 registers per thread; at 64 ptxas already serialises the wgmmas "
                         f"with three consumers): head_dim={q.shape[-1]}")


GRID_ORDERS = ("tiles_outer", "tiles_inner")
# The grid's axis names live in the same namespace as the axes of an enclosing mesh: inside a shard_map
# over a mesh axis called "batch" (ttj_jax.parallel's), `lax.axis_index("batch")` in the kernel resolved
# to the mesh axis, not the grid's (the lowered kernel changed; tests/test_flash_attention_mgpu.py), and a
# two-H200 split of shape 14 gave a wrong output. Names no mesh will use:
_GRID_Q_TILE, _GRID_HEAD, _GRID_SEQUENCE = "ttj_mgpu_q_tile", "ttj_mgpu_head", "ttj_mgpu_sequence"
_GRID_PROGRAM = "ttj_mgpu_program"   # the persistent kernel's one grid axis
_PRODUCER_WARP = "ttj_mgpu_producer_warp"   # warp_producer: the warps of the producer's warpgroup
_CLUSTER_MEMBER = "ttj_mgpu_pair_member"   # kv_multicast: 0 or 1 within a 2-block cluster


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "lowering_semantics",
                                             "grid_order", "interpret", "return_lse"))
def flash_attention_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, interpret: bool | str = False,
                         sm_scale: float | None = None, block_sizes: MgpuBlockSizes | None = None,
                         lowering_semantics: str | None = None, grid_order: str = "tiles_inner",
                         return_lse: bool = False):
    """Softmax attention `softmax(q k^T * sm_scale) v` per (batch, head) on Hopper, in one kernel.

    Args:
      q, k, v: [B, S, H, head_dim], all float16 or all bfloat16; head_dim 32, 64, 128 or 256; any S >= 1.
      causal: key j is excluded for query i when j > i.
      sm_scale: Python float, default head_dim ** -0.5.
      block_sizes: MgpuBlockSizes, or None for the per-head_dim default.
      lowering_semantics: "warpgroup" or "lane" (Mosaic GPU's two lowering modes), or None for the
        per-head_dim default (`default_lowering_semantics`).
      grid_order: "tiles_outer" (grid (q tiles, heads, batch): programs launched together share a query
        tile position across heads and sequences) or "tiles_inner" (grid (batch, heads, q tiles):
        programs launched together are tiles of one head of one sequence and read the same K/V, which
        may then come from L2). tiles_inner, the default, ran shape 14's attention call (B=8, H=16,
        S=100000, head_dim 64) at 481 TFLOP/s against 405 for tiles_outer and cuDNN's 446
        (bench/results/attention-mgpu-2026-11-30-nvidia-h200-grid.json).
      interpret: True or "detect_races" (with its race detector): Mosaic GPU's interpret mode on a CPU.
      return_lse: also return each row's log-sum-exp, log(sum_j exp(sm_scale q.k_j)) over its allowed keys,
        [B, H, S] fp32 (as the generic kernel's return_lse; every row here has an allowed key), from the
        kernel's running max and sum: one more TMA store per consumer.

    Returns:
      [B, S, H, head_dim] in q's dtype (and the log-sum-exp with return_lse). Read and written in place
      when S is a multiple of 8; otherwise q, k, v are padded to one (`padded_seq_len`). No masks: see
      `ttj_jax.kernels.flash_attention`.
    """
    _check_inputs(q, k, v, causal, sm_scale, block_sizes)
    _check_options(return_lse, lowering_semantics, grid_order)
    return _launch((q, k, v), q.shape, causal=causal, interpret=interpret, sm_scale=sm_scale,
                   block_sizes=block_sizes, lowering_semantics=lowering_semantics, grid_order=grid_order,
                   return_lse=return_lse)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "lowering_semantics",
                                             "grid_order", "interpret"))
def flash_attention_mgpu_fused_qkv(qkv: jax.Array, *, causal: bool, interpret: bool | str = False,
                                   sm_scale: float | None = None, block_sizes: MgpuBlockSizes | None = None,
                                   lowering_semantics: str | None = None, grid_order: str = "tiles_inner"):
    """`flash_attention_mgpu` on q, k, v read in place out of one fused projection: qkv [B, S, 3, H,
    head_dim] (the free reshape of a [B, S, 3 d] output of x @ W_qkv, columns ordered q | k | v, each
    head-major), as `flash_attention.flash_attention_fused_qkv` takes it. The TMA copies index slot 0, 1
    or 2 of the array itself, so nothing is sliced out first (three copies of [B, S, H, head_dim] before;
    at shape 8's call, B=64, S=128, 4 heads of 256, 3 x 11.4 us against a 22.4 us kernel:
    bench/results/small-attention-2026-12-01-nvidia-h200.json; in place 24.3 us in all against 57-58 with
    the slices, small-attention-...-fused.json). The kernel is the same: this changes only where its q,
    k and v tiles are read from. Returns [B, S, H, head_dim] in qkv's dtype."""
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv.shape={qkv.shape} must be [batch, seq_len, 3, num_heads, head_dim]")
    view = jax.ShapeDtypeStruct(qkv.shape[:2] + qkv.shape[3:], qkv.dtype)
    _check_inputs(view, view, view, causal, sm_scale, block_sizes)
    _check_options(False, lowering_semantics, grid_order)
    return _launch((qkv,), view.shape, causal=causal, interpret=interpret, sm_scale=sm_scale,
                   block_sizes=block_sizes, lowering_semantics=lowering_semantics, grid_order=grid_order,
                   return_lse=False)


class _SlotRef:
    """q, k or v inside a fused [B, S, 3, H, head_dim] GMEM ref: `.at[b, rows, h]` (all the kernel asks
    of its q/k/v refs) is the fused ref's `.at[b, rows, slot, h]`, one TMA copy out of the big array."""

    def __init__(self, ref, slot: int):
        self.ref, self.slot = ref, slot

    @property
    def at(self):
        return self

    def __getitem__(self, index):
        batch, rows, head = index
        return self.ref.at[batch, rows, self.slot, head]


def _check_options(return_lse, lowering_semantics, grid_order):
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse={return_lse!r} must be a bool")
    if lowering_semantics is not None and lowering_semantics not in LOWERING_SEMANTICS:
        raise ValueError(f"lowering_semantics={lowering_semantics!r} must be None, 'warpgroup' or 'lane'")
    if grid_order not in GRID_ORDERS:
        raise ValueError(f"grid_order={grid_order!r} must be one of {GRID_ORDERS}")


def _launch(operands: tuple, shape: tuple, *, causal, interpret, sm_scale, block_sizes, lowering_semantics,
            grid_order, return_lse):
    """The kernel call: operands are (q, k, v) [B, S, H, hd] or (qkv,) [B, S, 3, H, hd] (fused);
    shape is q's [B, S, H, hd]."""
    plgpu = _plgpu()
    fused = len(operands) == 1
    batch, seq_len, num_heads, head_dim = shape
    dtype = jnp.dtype(operands[0].dtype)
    sm_scale = head_dim ** -0.5 if sm_scale is None else float(sm_scale)
    blocks = launch_block_sizes(seq_len, head_dim, dtype.itemsize, block_sizes, interpret)
    if blocks.kv_multicast and (interpret or grid_order != "tiles_inner"):
        raise ValueError("MgpuBlockSizes.kv_multicast runs on the GPU with grid_order='tiles_inner' only "
                         f"(2-block clusters along the query tiles): interpret={interpret!r}, "
                         f"grid_order={grid_order!r}")
    if lowering_semantics is None:
        lowering_semantics = default_lowering_semantics(head_dim)
    if blocks.warp_producer and lowering_semantics == "warpgroup":
        if block_sizes is not None:
            raise ValueError("MgpuBlockSizes.warp_producer needs lowering_semantics='lane' (Mosaic GPU's "
                             "warpgroup lowering has no warp-level copies)")
        blocks = dataclasses.replace(blocks, warp_producer=False)   # a default tiling runs either way
    num_q_tiles = pl.cdiv(seq_len, blocks.block_q)
    num_wgs, num_stages = blocks.num_compute_wgs, blocks.num_stages

    # Tiles of (8 rows, 128 bytes), 128-byte swizzle: wgmma reads them without bank conflicts, TMA writes them.
    # Rows narrower than 128 bytes (head_dim 32 in fp16: 64) take the swizzle of their width.
    swizzle = swizzle_bytes(head_dim, dtype.itemsize)
    transforms = (plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    smem = (plgpu.SMEM((num_wgs, ROWS_PER_CONSUMER, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, blocks.block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((num_stages, blocks.block_kv, head_dim), dtype, transforms=transforms)) \
        + _interpret_smem(interpret, num_wgs, head_dim, blocks.block_kv, dtype)   # () for the GPU kernel
    if blocks.persistent:   # after those: the output's staging buffer
        num_programs = min(batch * num_heads * num_q_tiles, PERSISTENT_INTERPRET_PROGRAMS if interpret else sm_count())
        smem += (plgpu.SMEM((num_wgs, ROWS_PER_CONSUMER, head_dim), dtype, transforms=transforms),)
    if blocks.row_sum_mma:   # last: the kernel finds it at scoped[0][-1]
        smem += (plgpu.SMEM((num_wgs, blocks.block_kv, ROW_SUM_COLUMNS), dtype, transforms=(
            plgpu.TilingTransform((8, ROW_SUM_COLUMNS)), plgpu.SwizzleTransform(ROW_SUM_COLUMNS * dtype.itemsize))),)
    if return_lse:   # after it: the kernel finds each consumer's log-sum-exp rows at scoped[0][-1]
        smem += (plgpu.SMEM((num_wgs, ROWS_PER_CONSUMER), jnp.float32),)
    barriers = (plgpu.Barrier(num_arrivals=1, num_barriers=num_wgs),             # q_ready
                plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),          # k_ready
                plgpu.Barrier(num_arrivals=1, num_barriers=num_stages),          # v_ready
                plgpu.Barrier(num_arrivals=num_wgs, num_barriers=num_stages),    # k_consumed
                plgpu.Barrier(num_arrivals=num_wgs, num_barriers=num_stages),    # v_consumed
                plgpu.Barrier(num_arrivals=1, num_barriers=num_wgs))             # tokens
    if blocks.kv_multicast:   # k_peer_free, v_peer_free (the producers'), cluster_done (all warpgroups')
        cluster_barrier = functools.partial(plgpu.ClusterBarrier, collective_axes=(_CLUSTER_MEMBER,))
        barriers += (cluster_barrier(num_arrivals=1, num_barriers=num_stages),
                     cluster_barrier(num_arrivals=1, num_barriers=num_stages),
                     cluster_barrier(num_arrivals=num_wgs + 1, num_barriers=1))
    kernel = functools.partial(_kernel_body(interpret), causal=causal, sm_scale=sm_scale, seq_len=seq_len,
                               num_q_tiles=num_q_tiles, head_dim=head_dim, blocks=blocks, dtype=dtype)
    if blocks.persistent:
        kernel = functools.partial(kernel, num_heads=num_heads, batch_size=batch, num_programs=num_programs)

    def entry(q_ref, k_ref, v_ref, out_ref, *lse_ref):
        pl.run_scoped(lambda *scoped: kernel(q_ref, k_ref, v_ref, out_ref, scoped,
                                             lse_ref=lse_ref[0] if lse_ref else None),
                      smem, barriers, collective_axes="wg")

    def fused_entry(qkv_ref, out_ref):
        entry(_SlotRef(qkv_ref, 0), _SlotRef(qkv_ref, 1), _SlotRef(qkv_ref, 2), out_ref)

    # Row-major grid: the last axis varies fastest, so all heads and batch elements of the heaviest
    # query tile launch first.
    array_len = num_q_tiles * blocks.block_q if interpret else padded_seq_len(seq_len)   # see _interpret_params
    if array_len != seq_len:   # the padded keys are masked in the kernel (seq_len is the true S)
        operands = tuple(jnp.pad(x, ((0, 0), (0, array_len - seq_len)) + ((0, 0),) * (x.ndim - 2))
                         for x in operands)
    out_type = jax.ShapeDtypeStruct((batch, array_len, num_heads, head_dim), dtype)
    if return_lse:
        # Whole query tiles long: every consumer's 64 rows are in bounds. (With [B, H, S] the TMA stores of
        # rows past S were not dropped but landed in the next head's first rows, on the H200 with three
        # consumers: bench/results/mgpu-lse-rows-2026-11-30-h200.json.)
        out_type = (out_type, jax.ShapeDtypeStruct((batch, num_heads, num_q_tiles * blocks.block_q), jnp.float32))
    cluster = {}
    if blocks.persistent:   # the tiles' order is persistent_tile's (grid_order does not apply)
        grid, grid_names = (num_programs,), (_GRID_PROGRAM,)
    elif blocks.kv_multicast:   # the tile axis counts 2-block clusters (multicast_pair)
        grid, grid_names = (batch, num_heads, pl.cdiv(num_q_tiles, 2)), (_GRID_SEQUENCE, _GRID_HEAD, _GRID_Q_TILE)
        cluster = dict(cluster=(2,), cluster_names=(_CLUSTER_MEMBER,))
    elif grid_order == "tiles_outer":
        grid, grid_names = (num_q_tiles, num_heads, batch), (_GRID_Q_TILE, _GRID_HEAD, _GRID_SEQUENCE)
    else:
        grid, grid_names = (batch, num_heads, num_q_tiles), (_GRID_SEQUENCE, _GRID_HEAD, _GRID_Q_TILE)
    out = plgpu.kernel(
        fused_entry if fused else entry,
        out_type=out_type,
        grid=grid,
        grid_names=grid_names,
        num_threads=num_wgs + 1,
        thread_name="wg",
        compiler_params=_compiler_params(lowering_semantics), interpret=_interpret_params(interpret),
        **cluster,
    )(*operands)
    if not return_lse:
        return out[:, :seq_len] if array_len != seq_len else out
    out, lse = out
    return (out[:, :seq_len] if array_len != seq_len else out), lse[:, :, :seq_len]


# --- Mosaic GPU interpret mode (`interpret=True` / "detect_races") ---------------------------------------
# jax's GPU interpret mode (0.10.2) runs the kernel body on a CPU: warpgroups as threads, SMEM with the
# tiling/swizzle transforms, TMA copies, barriers with phase checks, and synchronous wgmma. Where it lacks
# what the kernel uses, `_attention_kernel` takes stand-ins for `plgpu` and `pl`, selected by `interpret`
# at trace time, so the GPU kernel's code, and its lowering, are untouched (tests/test_flash_attention_mgpu.py
# pins the lowered kernel by hash; the kernel's source lines were kept in place because the module
# records them):
# - `layout_cast`: no layouts in the interpreter; the value is returned as is.
# - `broadcasted_iota(..., layout=)`: `lax.broadcasted_iota`.
# - wgmma operands: A must be an SMEM ref (the kernel's P is in registers) and B cannot be a transposed
#   view (the kernel's K^T): both are staged in untiled SMEM buffers of the warpgroup first.
# - `pl.run_state` with accumulator initial values: a zero accumulator (run_scoped) whose result is added
#   to the initial value in registers (the same fp32 sum: init + (0 + P @ V)); the same for the
#   accumulator store of `overlap_one_accumulator` (jax 0.10.2's interpreter rejects that store).
# - TMA: zero fill past the array and partial out-of-bounds writes (see `_interpret_params`).
# - Barrier phases the GPU kernel leaves unobserved at its end (see `_interpret_kernel`).
# What this leaves unverified by interpret mode, and checked only by lowering and on the H200: the
# register-A and transposed-view wgmma paths, layouts, asynchronous wgmma (the interpreter's is
# synchronous, so `wgmma_accumulator_load(wait_n=1)` orders nothing there), register allocation. The
# default head_dim 64 tiling (three consumers) hung now and then in the interpreter here (three threads
# in barrier waits, the fourth inside XLA running the interpreter's jaxpr); the tests use two consumers.
_PALLAS = pl


class _InterpretPlgpu:
    """`plgpu` for the kernel body in interpret mode: the real module, but for the substitutes above."""

    def __init__(self, scoped):
        (_, _, _, self._p_stage, self._kt_stage, *_), _ = scoped   # see `_interpret_smem`
        self._plgpu = _plgpu()

    def __getattr__(self, name):
        return getattr(self._plgpu, name)

    @staticmethod
    def layout_cast(value, layout):
        del layout
        return value

    @staticmethod
    def broadcasted_iota(dtype, shape, dimension, *, layout=None):
        del layout
        return lax.broadcasted_iota(dtype, shape, dimension)

    def wgmma(self, acc, a, b):
        from jax._src.state.types import TransformedRef, TransposeTransform  # noqa: PLC0415
        wg = lax.axis_index("wg")
        if not isinstance(a, TransformedRef):   # P (or one key part of it: poly_exp_keys), in registers
            a_stage = self._p_stage.at[wg, :, pl.ds(0, a.shape[1])]
            a_stage[...] = a
            a = a_stage
        if isinstance(b, TransformedRef) and b.transforms and isinstance(b.transforms[-1], TransposeTransform):
            k_part = TransformedRef(b.ref, b.transforms[:-1])[...]   # K^T: a transposed view of (part of) a K slot
            bt_stage = self._kt_stage.at[wg, :, pl.ds(0, k_part.shape[0])]
            bt_stage[...] = k_part.T
            b = bt_stage
        self._plgpu.wgmma(acc, a, b)


class _InterpretPallas:
    """`pl` for the kernel body in interpret mode: the real module, but for `run_state` (see above)."""

    def __getattr__(self, name):
        return getattr(pl, name)

    @staticmethod
    def run_state(body):
        def run(inits):
            single = not isinstance(inits, tuple)
            inits = (inits,) if single else inits

            def scoped(*refs):
                body(refs[0] if single else refs)
                return tuple(ref[...] for ref in refs)
            accs = pl.run_scoped(scoped, *(_plgpu().ACC(init.shape, init.dtype) for init in inits))
            outs = tuple(init._init + acc for init, acc in zip(inits, accs))
            return outs[0] if single else outs
        return run


def _interpret_smem(interpret, num_wgs: int, head_dim: int, block_kv: int, dtype) -> tuple:
    """The SMEM the interpret-mode wgmma staging adds (P and K^T per consumer warpgroup); none on the GPU."""
    if interpret not in (False, True, "detect_races"):
        raise ValueError(f"interpret={interpret!r} must be False, True or 'detect_races'")
    if interpret:
        plgpu = _plgpu()
        return (plgpu.SMEM((num_wgs, ROWS_PER_CONSUMER, block_kv), dtype),
                plgpu.SMEM((num_wgs, head_dim, block_kv), dtype))
    return ()


def _interpret_params(interpret):
    if interpret:
        from ttj_jax.compat import mosaic_gpu_interpret_params  # noqa: PLC0415
        # TMA's zero fill past the array (OOBFillMode.ZEROS, which the kernel relies on) is the
        # interpreter's out-of-bounds read returning "uninitialized" memory set to zero. That also
        # zero-fills fresh SMEM (no NaN poisoning of a read before a write, which the kernel has not).
        # The interpreter drops a TMA write that is partly out of bounds (the GPU writes the part in
        # bounds), so in interpret mode the arrays are padded to whole query tiles (flash_attention_mgpu).
        return mosaic_gpu_interpret_params(detect_races=interpret == "detect_races",
                                           out_of_bounds_reads="uninitialized", uninitialized_memory="zero")
    return None


def _kernel_body(interpret):
    if interpret:
        return _interpret_kernel
    return _attention_kernel


def _interpret_kernel(q_ref, k_ref, v_ref, out_ref, scoped, *, causal: bool, seq_len: int, num_q_tiles: int,
                      blocks: MgpuBlockSizes, **kwargs):
    """The kernel body in interpret mode, then waits for the barrier phases that it leaves unobserved.

    The interpreter raises when a barrier is freed before every thread that waits on it has observed
    all its phases. On the GPU the kernel ends without waiting for the last token pass to consumer 0
    (the token goes round tile_blocks + 1 times and consumer 0 holds it first) nor for the releases of
    the last blocks of the ring (the producer has nothing left to load): both harmless there.
    """
    _attention_kernel(q_ref, k_ref, v_ref, out_ref, scoped, causal=causal, seq_len=seq_len,
                      num_q_tiles=num_q_tiles, blocks=blocks, interpret=True, **kwargs)
    plgpu = _plgpu()
    smem, (_, _, _, k_consumed, v_consumed, tokens, *_) = scoped
    num_wgs, num_stages = blocks.num_compute_wgs, blocks.num_stages
    wg = lax.axis_index("wg")
    if blocks.persistent:   # the ring starts at slot 0 with each tile: each slot used by any of this
        # block's tiles has its last release unobserved
        program, batch, num_heads = lax.axis_index(_GRID_PROGRAM), kwargs["batch_size"], kwargs["num_heads"]
        num_programs = kwargs["num_programs"]

        def widest(j, most):
            valid, _, _, tile = persistent_tile(j, program, num_programs, batch, num_heads, num_q_tiles, causal)
            _, loaded = kv_block_range(tile * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv, causal)
            return jnp.maximum(most, jnp.where(valid, jnp.minimum(loaded, num_stages), 0))
        tile_blocks = lax.fori_loop(0, _cdiv(batch * num_heads * num_q_tiles, num_programs), widest,
                                    jnp.int32(0))   # drain below: [0, this)
    else:
        tile = lax.axis_index(_GRID_Q_TILE)
        if causal:
            tile = num_q_tiles - 1 - tile
        _, tile_blocks = kv_block_range(tile * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv, causal)

    if blocks.pingpong:
        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(tokens.at[0])

    @pl.when(wg == num_wgs)
    def _():
        def drain(block, _):
            slot = lax.rem(block, jnp.int32(num_stages))
            plgpu.barrier_wait(k_consumed.at[slot])
            plgpu.barrier_wait(v_consumed.at[slot])
        first = max(tile_blocks - num_stages, 0) if isinstance(tile_blocks, int) else jnp.maximum(
            tile_blocks - num_stages, 0)
        lax.fori_loop(first, tile_blocks, drain, None)
