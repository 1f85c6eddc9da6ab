"""Block sizes of the Hopper flash-attention kernel (`flash_attention_mgpu_kernel.py`) and the tables that
pick them per head_dim and sequence length. Numbers are H200, fp16, causal unless said."""

from __future__ import annotations

import dataclasses
import math

from jax.experimental import pallas as pl

SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
ROWS_PER_CONSUMER = 64          # one wgmma M tile per consumer warpgroup
# Hopper's opt-in shared memory per block (227 KiB) less room for barriers and 1 KiB swizzle alignment.
SMEM_BUDGET_BYTES = 227 * 1024 - 2 * 1024
# Registers per thread after `set_max_registers` (sum over warpgroups * 128 threads <= 65536).
REGISTERS_PER_THREAD = {2: (232, 40), 3: (160, 32)}   # num_compute_wgs -> (consumer, producer)


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
    block_kv: int                  # keys per KV block (the N of Q @ K^T, the K of P @ V)
    num_stages: int                # slots in the shared-memory ring of K/V blocks (clamped to the KV blocks)
    num_compute_wgs: int = 2       # consumer warpgroups; a query tile is 64 * num_compute_wgs rows
    # FA3's intra-warpgroup overlap: Q @ K_j^T is issued before P_{j-1} @ V_{j-1}, so the softmax of block
    # j runs while that PV GEMM is on the tensor core. The output is rescaled by alpha_{j-1} before the
    # GEMM phase and P @ V accumulates into it (one fp32 accumulator: head_dim <= 128 with two consumers).
    overlap_softmax: bool = False
    # The consumers' GEMM phases ordered round-robin by a token ring (FA3's ping-pong).
    pingpong: bool = True
    # K/V blocks shared by the two CUDA blocks of a 2-block cluster through TMA multicast: half the
    # L2 -> SM traffic, which matters because the kernel runs at the 700 W cap. GPU only (no clusters in
    # interpret mode).
    kv_multicast: bool = False
    # The producer's loads issued by one warp of its warpgroup instead of all four (FA3's producer is one
    # warp): 7% fewer instructions in the issue-bound kernel. Lane lowering only.
    warp_producer: bool = False

    def __post_init__(self):
        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)
        if not is_int(self.block_kv) or self.block_kv < 64 or self.block_kv > 256 or self.block_kv % 64:
            raise ValueError(f"MgpuBlockSizes.block_kv={self.block_kv!r} must be 64, 128, 192 or 256")
        if not is_int(self.num_stages) or self.num_stages < 2:
            raise ValueError(f"MgpuBlockSizes.num_stages={self.num_stages!r} must be an int >= 2")
        if self.num_compute_wgs not in REGISTERS_PER_THREAD or not is_int(self.num_compute_wgs):
            raise ValueError(f"MgpuBlockSizes.num_compute_wgs={self.num_compute_wgs!r} must be 2 or 3")
        for name in ("overlap_softmax", "pingpong", "kv_multicast", "warp_producer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MgpuBlockSizes.{name}={getattr(self, name)!r} must be a bool")

    @property
    def block_q(self) -> int:
        """Query rows per CUDA block (all consumers together)."""
        return ROWS_PER_CONSUMER * self.num_compute_wgs


# Per head_dim. head_dim 64: three consumers with a 4-slot ring of 128-key blocks, 476 TFLOP/s against
# 346 for two consumers with the softmax overlap and cuDNN's 451 (B=1 H=16 S=100000). head_dim 32 takes
# 64's tiling, the fastest of six at S=8192. warp_producer: +1% at head_dim 64 (499.8 against 494.6).
_DEFAULT_BLOCK_SIZES = {
    32: MgpuBlockSizes(block_kv=128, num_stages=4, num_compute_wgs=3, warp_producer=True),
    64: MgpuBlockSizes(block_kv=128, num_stages=4, num_compute_wgs=3, warp_producer=True),
    128: MgpuBlockSizes(block_kv=128, num_stages=2, num_compute_wgs=2),
    256: MgpuBlockSizes(block_kv=64, num_stages=2, num_compute_wgs=2),
}
# From these lengths on, per head_dim, the defaults above give way to these. head_dim 128: the softmax
# overlap, 1.5-2.3% faster at S=16384 and 32768, level at 4096. (At head_dim 64 it lost: 479 against 494.)
_LONG_SEQ_BLOCK_SIZES = {
    128: (4096, MgpuBlockSizes(block_kv=128, num_stages=2, num_compute_wgs=2, overlap_softmax=True)),
}
# K/V multicast from these lengths on, per head_dim: the shortest measured lengths where it won
# (head_dim 64: +0.5% at S=32768, level at 16384; 128: +1.6% at 4096; 256: +3% at 16384).
MULTICAST_MIN_SEQ_LEN = {64: 32768, 128: 4096, 256: 16384}
# With multicast these head_dims also drop the ping-pong ring: +0.8% at head_dim 64, S=100000 (level
# without multicast, and at head_dim 128).
MULTICAST_WITHOUT_PINGPONG = frozenset({64})

# Mosaic GPU's two lowerings; the default per head_dim. "lane" won all five comparisons at head_dim 64
# (+0.5-1%) and at head_dim 32; 128 and 256 keep "warpgroup", the lowering they were timed with.
LOWERING_SEMANTICS = ("warpgroup", "lane")
_DEFAULT_LOWERING = {32: "lane", 64: "lane", 128: "warpgroup", 256: "warpgroup"}


def default_lowering_semantics(head_dim: int) -> str:
    return _DEFAULT_LOWERING[head_dim]


def default_block_sizes(head_dim: int, seq_len: int | None = None, *, kv_multicast: bool = True) -> MgpuBlockSizes:
    """The default block sizes at this head_dim and sequence length (None: the short-sequence default).
    kv_multicast=False: the same tiling without clusters (and so with the ping-pong ring), for
    benchmarks that time multicast against it."""
    blocks = _DEFAULT_BLOCK_SIZES[head_dim]
    if seq_len is not None and head_dim in _LONG_SEQ_BLOCK_SIZES:
        min_len, long_blocks = _LONG_SEQ_BLOCK_SIZES[head_dim]
        if seq_len >= min_len:
            blocks = long_blocks
    if kv_multicast and seq_len is not None and seq_len >= MULTICAST_MIN_SEQ_LEN.get(head_dim, math.inf):
        blocks = with_kv_multicast(blocks, head_dim)
    return blocks


def with_kv_multicast(blocks: MgpuBlockSizes, head_dim: int) -> MgpuBlockSizes:
    """`blocks` with K/V multicast as the defaults take it (MULTICAST_WITHOUT_PINGPONG)."""
    return dataclasses.replace(blocks, kv_multicast=True,
                               pingpong=blocks.pingpong and head_dim not in MULTICAST_WITHOUT_PINGPONG)


def swizzle_bytes(head_dim: int, itemsize: int) -> int:
    """The shared-memory swizzle of the Q, K and V tiles: 128 bytes, or a row's width where it is less
    (head_dim 32 in fp16: 64 bytes; wgmma then takes K in steps of 32 keys or head dims, not 64)."""
    return min(128, head_dim * itemsize)


def smem_bytes(head_dim: int, itemsize: int, blocks: MgpuBlockSizes) -> int:
    """Shared memory the kernel allocates: Q (reused for the output) and the K/V ring, plus barriers."""
    tiles = head_dim * itemsize * (blocks.block_q + 2 * blocks.num_stages * blocks.block_kv)
    num_barriers = blocks.num_compute_wgs * 2 + blocks.num_stages * 4
    return tiles + 8 * num_barriers


def check_block_sizes(head_dim: int, itemsize: int, blocks: MgpuBlockSizes) -> None:
    """Raises ValueError when `blocks` cannot run at this head_dim (shared memory or registers)."""
    if smem_bytes(head_dim, itemsize, blocks) > SMEM_BUDGET_BYTES:
        raise ValueError(f"{blocks} at head_dim={head_dim} needs {smem_bytes(head_dim, itemsize, blocks)} "
                         f"bytes of shared memory, more than {SMEM_BUDGET_BYTES}")
    # FA3's register budgets: the output, the scores and two P blocks in registers
    if blocks.overlap_softmax and (head_dim > 128 or blocks.block_kv > 128
                                   or (blocks.num_compute_wgs == 3 and head_dim > 64)):
        raise ValueError(f"overlap_softmax keeps the output, the scores and two P blocks in registers: "
                         f"head_dim={head_dim} must be 64 (128 with two consumers) and block_kv={blocks.block_kv} "
                         f"<= 128")
    if blocks.num_compute_wgs == 3 and head_dim > 128:
        raise ValueError(f"num_compute_wgs=3 leaves 160 registers per thread: head_dim={head_dim} must be <= 128")
    if blocks.num_compute_wgs == 3 and blocks.block_kv > 192:
        raise ValueError(f"block_kv={blocks.block_kv} with num_compute_wgs=3 gave wrong outputs on the H200: "
                         "at most 192")


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
    """resolve_block_sizes, except that in interpret mode a default tiling runs without multicast (no
    clusters there; the output is the same, bit for bit) and with two consumers instead of three (jax's
    interpreter can hang with three; two compute every row the same way). Blocks asked for are kept."""
    blocks = resolve_block_sizes(seq_len, head_dim, itemsize, block_sizes)
    if interpret and block_sizes is None and blocks.kv_multicast:
        blocks = dataclasses.replace(blocks, kv_multicast=False)
    if interpret and block_sizes is None and blocks.num_compute_wgs == 3:
        blocks = dataclasses.replace(blocks, num_compute_wgs=2)
        check_block_sizes(head_dim, itemsize, blocks)
    return blocks
