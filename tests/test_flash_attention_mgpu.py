"""CPU checks of the Mosaic GPU (Hopper) flash-attention kernel, `ttj_jax/kernels/flash_attention_mgpu.py`.

Mosaic GPU kernels execute only on sm_90 GPUs; on the CPU the kernel body runs only in jax's Mosaic GPU
interpret mode (section 6, with the substitutes listed at the end of the kernel's module). Its numerical
check against `flash_attention_reference` (the same cases as below, small S) and its timing run on the
H200:

    PYTHONPATH=. python3 bench/bench_attention_mgpu.py

What this file checks, on the CPU:
1. Lowering for CUDA: `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` succeeds and
   emits a Mosaic GPU custom call, for head_dim 32, 64, 128, 256, causal and not, S in {128, 1000, 100000},
   plus edge lengths, bf16, the other block-size variants and both lowering semantics. Lowering runs
   Pallas -> Mosaic GPU, Mosaic's layout inference, its wgmma operand/shape checks, the TMA slicing
   and the shared-memory budget; PTX generation, ptxas (register spills) and execution only happen on
   the GPU, so a kernel that lowers here can still fail or be slow there.
2. The pure-Python pieces: the KV block ranges (brute force against explicit masks), the padding
   rule, block-size validation and shared-memory accounting, the FLOP count, argument validation.
3. A NumPy emulation of each consumer warpgroup's schedule, driven by the kernel's own `consumer_plan`
   (prologue, unmasked and masked loops, epilogue, skipped blocks, both rescaling variants, zero-filled
   reads past S), compared with the reference; and the barrier bookkeeping that must hold for the
   kernel not to deadlock: every consumer releases each K and V block of its tile exactly once, in
   order, and passes the token the same number of times.

6. The kernel body itself in jax's Mosaic GPU interpret mode (`interpret=True`, on the CPU) against the
   reference at small sizes, one case with its race detector; and the lowered GPU kernel pinned by hash
   (the interpret-mode changes must leave the H200-verified build unchanged).

jax's Mosaic GPU package imports absl (`absl.logging.vlog_is_on` in layout inference): the test extra
installs absl-py for it, as the GPU machine has.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")   # the package exports a function of that name
from ttj_jax.kernels import flash_attention_reference
from ttj_jax.numerics import harness_check


Blocks = fm.MgpuBlockSizes


def _lower_for_cuda(seq_len, head_dim, causal, *, dtype=jnp.float16, batch=1, num_heads=2, **kwargs) -> str:
    spec = jax.ShapeDtypeStruct((batch, seq_len, num_heads, head_dim), dtype)
    call = jax.jit(lambda q, k, v: fm.flash_attention_mgpu(q, k, v, causal=causal, **kwargs))
    return call.trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @(\w+)", text)


# --- 1. Lowering for CUDA -----------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [128, 1000, 100_000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_lowers_to_one_mosaic_gpu_kernel(head_dim, causal, seq_len):
    text = _lower_for_cuda(seq_len, head_dim, causal)
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    # S is a multiple of 8: q, k, v are read in place and the output written in place.
    assert "stablehlo.pad" not in text and "stablehlo.slice" not in text


@pytest.mark.parametrize("seq_len", [1, 7, 64, 113, 1023])
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_at_odd_lengths(seq_len, causal):
    text = _lower_for_cuda(seq_len, 64, causal)
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    needs_padding = fm.padded_seq_len(seq_len) != seq_len
    assert ("stablehlo.pad" in text) == needs_padding


@pytest.mark.parametrize("causal", [False, True])
def test_lowers_in_either_grid_order(causal):
    # and the tiling the H200 found wrong is refused
    with pytest.raises(ValueError, match="wrong outputs on the H200"):
        fm.check_block_sizes(64, 2, Blocks(256, 2, 3))
    assert _custom_calls(_lower_for_cuda(1000, 64, causal, batch=2, grid_order="tiles_inner")) == ["mosaic_gpu_v2"]
    with pytest.raises(ValueError, match="grid_order"):
        _lower_for_cuda(1000, 64, causal, grid_order="diagonal")


@pytest.mark.parametrize("head_dim,blocks", [
    (64, Blocks(block_kv=128, num_stages=4, num_compute_wgs=2, overlap_softmax=False)),
    (64, Blocks(block_kv=256, num_stages=2)),
    (64, Blocks(block_kv=192, num_stages=3)),
    (64, Blocks(block_kv=128, num_stages=4, num_compute_wgs=3)),
    (128, Blocks(block_kv=128, num_stages=3)),
    (128, Blocks(block_kv=64, num_stages=4, num_compute_wgs=3)),
])
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_with_other_block_sizes(head_dim, blocks, causal):
    assert _custom_calls(_lower_for_cuda(1000, head_dim, causal, block_sizes=blocks)) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("lowering_semantics", ["lane", "warpgroup"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_lowers_in_both_semantics_and_dtypes(lowering_semantics, dtype):
    text = _lower_for_cuda(1000, 128, True, dtype=dtype, batch=2, lowering_semantics=lowering_semantics)
    assert _custom_calls(text) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("lowering_semantics", ["lane", "warpgroup"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, poly_exp_keys=64),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, row_sum_mma=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, half_exp2=True),
                                    Blocks(block_kv=128, num_stages=2, overlap_softmax=True, half_exp2=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, overlap_softmax=True,
                                           overlap_one_accumulator=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, prescaled_q=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, half_row_sum=True),
                                    Blocks(block_kv=192, num_stages=3, half_row_sum=True),   # 3 chunks left
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, prescaled_q=True,
                                           half_row_sum=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, pingpong=False),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, deferred_row_sum=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, tree_row_max=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, deferred_row_sum=True,
                                           tree_row_max=True),
                                    Blocks(block_kv=128, num_stages=2, num_compute_wgs=2, overlap_softmax=True,
                                           overlap_one_accumulator=True, deferred_row_sum=True,
                                           tree_row_max=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, lazy_rescale=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, lazy_rescale=True,
                                           poly_exp_keys=64, tree_row_max=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, persistent=True),
                                    Blocks(block_kv=128, num_stages=2, num_compute_wgs=2, overlap_softmax=True,
                                           overlap_one_accumulator=True, persistent=True),
                                    Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, q_in_registers=True),
                                    Blocks(block_kv=128, num_stages=2, overlap_softmax=True, q_in_registers=True)])
def test_lowers_with_the_softmax_variants(lowering_semantics, causal, blocks):
    # poly_exp_keys: two key parts per block, their own Q @ K^T and P @ V wgmmas over slices of the K/V
    # slots; row_sum_mma: a third wgmma, P @ ones, in every GEMM phase
    text = _lower_for_cuda(1000, 64, causal, block_sizes=blocks, lowering_semantics=lowering_semantics)
    assert _custom_calls(text) == ["mosaic_gpu_v2"]


def test_polynomial_exp2():
    x = jnp.concatenate([jnp.linspace(-119.0, 0.0, 100_001, dtype=jnp.float32),
                         jnp.array([-0.5, -1.5, -2.5, -1e-8, 0.0], jnp.float32)])
    y = np.asarray(jax.jit(lambda x: fm._exp2_poly(x, exact_round=True))(x), np.float64)
    assert np.abs(y / np.exp2(np.asarray(x, np.float64)) - 1).max() < 1.2e-5   # against P's 2^-11 fp16 rounding
    masked = np.asarray(jax.jit(lambda x: fm._exp2_poly(x, exact_round=True))(
        jnp.array([-jnp.inf, -1e30, -200.0], jnp.float32)))
    assert ((masked >= 0) & (masked < 1e-35)).all()
    # The GPU's rounding (two fp32 adds of 1.5 * 2^23; XLA would fold them, NumPy does not) gives the j
    # that exact_round's lax.round gives, and its bits shifted by 23 are j in the exponent field.
    xs = np.concatenate([np.linspace(-120, 0, 100_001, dtype=np.float32), np.float32([-0.5, -1.5, -2.5, -3.5])])
    magic = np.float32(fm._ROUND_MAGIC)
    shifted = xs + magic
    assert np.array_equal(shifted - magic, np.round(xs))
    assert np.array_equal((shifted.view(np.int32) << 23) >> 23, np.round(xs).astype(np.int32))


def test_lowered_kernel_depends_on_causal_and_blocks():
    """The lowered module carries the kernel: different statics give a different serialized module."""
    def module_of(**kwargs):
        return re.search(r'module = "([^"]*)"', _lower_for_cuda(1000, 64, **kwargs)).group(1)
    causal, full = module_of(causal=True), module_of(causal=False)
    other = module_of(causal=True, block_sizes=Blocks(block_kv=256, num_stages=2))
    assert len({causal, full, other}) == 3


# --- 2. Pure-Python pieces ----------------------------------------------------------------------------

def test_padded_seq_len():
    assert [fm.padded_seq_len(s) for s in (1, 7, 8, 9, 100, 1000, 1001, 100_000)] == \
        [1, 7, 8, 16, 104, 1000, 1008, 100_000]


@pytest.mark.parametrize("block_kv", [64, 128, 192, 256])
def test_kv_block_range_matches_explicit_masks(block_kv):
    rows = fm.ROWS_PER_CONSUMER
    for seq_len in range(1, 600, 7):
        num_kv_blocks = -(-seq_len // block_kv)
        for row_start in range(0, seq_len, rows):
            real_rows = np.arange(row_start, min(row_start + rows, seq_len))
            num_unmasked, num_visited = fm.kv_block_range(row_start, rows, seq_len, block_kv, causal=True)
            assert 0 <= num_unmasked <= num_visited <= num_kv_blocks
            for block in range(num_kv_blocks):
                keys = np.arange(block * block_kv, min((block + 1) * block_kv, seq_len))
                allowed = keys[None, :] <= real_rows[:, None]
                if block < num_unmasked:
                    assert allowed.all(), (seq_len, row_start, block)
                if block >= num_visited:
                    assert not allowed.any(), (seq_len, row_start, block)
            # Tight: the last visited block holds a key the last real row may see.
            last_keys = np.arange((num_visited - 1) * block_kv, seq_len)
            assert (last_keys <= real_rows[-1]).any()
            full_unmasked, full_visited = fm.kv_block_range(row_start, rows, seq_len, block_kv, causal=False)
            assert (full_unmasked, full_visited) == (seq_len // block_kv, num_kv_blocks)


def test_q_in_registers_refuses_wide_heads():
    # Q in registers is built (and its interpret-mode staging sized) for head_dim <= 64
    q = jnp.zeros((1, 128, 2, 128), jnp.float16)
    with pytest.raises(ValueError, match="q_in_registers"):
        fm.flash_attention_mgpu(q, q, q, causal=True, block_sizes=Blocks(block_kv=128, num_stages=2,
                                                                         q_in_registers=True))
    assert "mosaic_gpu_v2" in _lower_for_cuda(128, 32, True, block_sizes=Blocks(block_kv=128, num_stages=2,
                                                                                q_in_registers=True))


def test_half_row_sum_refuses_bfloat16():
    # bf16's 8-bit mantissa would cost ~1% of a row sum: refused before anything is traced
    q = jnp.zeros((1, 128, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="half_row_sum"):
        fm.flash_attention_mgpu(q, q, q, causal=True, block_sizes=Blocks(128, 2, 2, half_row_sum=True))


def test_block_sizes_validate_themselves():
    for bad in (dict(block_kv=100, num_stages=2), dict(block_kv=32, num_stages=2),
                dict(block_kv=320, num_stages=2), dict(block_kv=128, num_stages=1),
                dict(block_kv=128, num_stages=2, num_compute_wgs=4),
                dict(block_kv=128, num_stages=2, num_compute_wgs=3, overlap_softmax=True),
                dict(block_kv=128, num_stages=2, overlap_softmax=1), dict(block_kv=True, num_stages=2),
                dict(block_kv=128, num_stages=2, poly_exp_keys=32), dict(block_kv=128, num_stages=2, poly_exp_keys=128),
                dict(block_kv=128, num_stages=2, poly_exp_keys=-16),
                dict(block_kv=128, num_stages=2, overlap_softmax=True, poly_exp_keys=64),
                dict(block_kv=128, num_stages=2, row_sum_mma=1),
                dict(block_kv=128, num_stages=2, row_sum_mma=True, poly_exp_keys=64),
                dict(block_kv=128, num_stages=2, row_sum_mma=True, overlap_softmax=True),
                dict(block_kv=128, num_stages=2, half_exp2=1),
                dict(block_kv=128, num_stages=2, half_exp2=True, poly_exp_keys=64),
                dict(block_kv=128, num_stages=2, half_exp2=True, row_sum_mma=True),
                dict(block_kv=128, num_stages=2, overlap_one_accumulator=True),        # needs overlap_softmax
                dict(block_kv=128, num_stages=2, overlap_softmax=True, overlap_one_accumulator=1),
                # session 15's options: bools, and the combinations they are not built for
                dict(block_kv=128, num_stages=2, prescaled_q=1), dict(block_kv=128, num_stages=2, pingpong=0),
                dict(block_kv=128, num_stages=2, q_in_registers=1),
                dict(block_kv=128, num_stages=2, half_row_sum="yes"),
                dict(block_kv=128, num_stages=2, deferred_row_sum=1), dict(block_kv=128, num_stages=2, tree_row_max=1),
                dict(block_kv=128, num_stages=2, half_row_sum=True, overlap_softmax=True),
                dict(block_kv=128, num_stages=2, half_row_sum=True, half_exp2=True),
                dict(block_kv=128, num_stages=2, half_row_sum=True, poly_exp_keys=64),
                dict(block_kv=128, num_stages=2, deferred_row_sum=True, half_row_sum=True),
                dict(block_kv=128, num_stages=2, deferred_row_sum=True, row_sum_mma=True),
                dict(block_kv=128, num_stages=2, deferred_row_sum=True, half_exp2=True),
                # session 16's conditional rescaling: a bool, plain softmax only
                dict(block_kv=128, num_stages=2, lazy_rescale=1),
                dict(block_kv=128, num_stages=2, lazy_rescale=True, overlap_softmax=True),
                dict(block_kv=128, num_stages=2, lazy_rescale=True, row_sum_mma=True),
                dict(block_kv=128, num_stages=2, lazy_rescale=True, half_exp2=True),
                dict(block_kv=128, num_stages=2, lazy_rescale=True, half_row_sum=True),
                dict(block_kv=128, num_stages=2, lazy_rescale=True, deferred_row_sum=True),
                dict(block_kv=128, num_stages=2, persistent=1)):
        with pytest.raises(ValueError):
            Blocks(**bad)
    assert Blocks(block_kv=128, num_stages=2, num_compute_wgs=3).block_q == 192
    # three consumers overlap only with one accumulator
    assert Blocks(128, 2, 3, overlap_softmax=True, overlap_one_accumulator=True).block_q == 192


@pytest.mark.parametrize("head_dim", fm.SUPPORTED_HEAD_DIMS)
def test_defaults_fit_and_oversized_blocks_are_refused(head_dim):
    blocks = fm.default_block_sizes(head_dim)
    fm.check_block_sizes(head_dim, 2, blocks)
    assert fm.smem_bytes(head_dim, 2, blocks) <= fm.SMEM_BUDGET_BYTES
    too_deep = Blocks(block_kv=blocks.block_kv, num_stages=64)
    with pytest.raises(ValueError, match="shared memory"):
        fm.check_block_sizes(head_dim, 2, too_deep)


def test_register_bound_variants_are_refused():
    with pytest.raises(ValueError, match="head_dim=128 must be 64"):
        fm.check_block_sizes(128, 2, Blocks(block_kv=64, num_stages=2, overlap_softmax=True))
    with pytest.raises(ValueError, match="block_kv=256 <= 128"):
        fm.check_block_sizes(64, 2, Blocks(block_kv=256, num_stages=2, overlap_softmax=True))
    with pytest.raises(ValueError, match="head_dim=256 must be <= 128"):
        fm.check_block_sizes(256, 2, Blocks(block_kv=64, num_stages=2, num_compute_wgs=3))
    # one accumulator: head_dim 128 with two consumers fits (FA3's budget), with three or at 256 not
    one_acc = functools.partial(Blocks, overlap_softmax=True, overlap_one_accumulator=True)
    fm.check_block_sizes(128, 2, one_acc(128, 2, 2))
    fm.check_block_sizes(64, 2, one_acc(128, 4, 3))
    for head_dim, blocks in ((128, one_acc(128, 2, 3)), (256, one_acc(64, 2, 2)), (64, one_acc(192, 2, 2))):
        with pytest.raises(ValueError, match="overlap_one_accumulator keeps"):
            fm.check_block_sizes(head_dim, 2, blocks)


def test_long_sequences_at_head_dim_128_default_to_the_one_accumulator_overlap():
    long_blocks = fm.default_block_sizes(128, 4096)
    assert long_blocks.overlap_softmax and long_blocks.overlap_one_accumulator
    assert fm.default_block_sizes(128, 4095) == fm.default_block_sizes(128) == Blocks(128, 2, 2)
    # lost at head_dim 64: the long default there is the short one, plus K/V multicast (below)
    assert dataclasses.replace(fm.default_block_sizes(64, 100_000), kv_multicast=False,
                               pingpong=True) == fm.default_block_sizes(64)
    # and a call without block sizes lowers to exactly that build
    explicit = _lower_for_cuda(4096, 128, True, block_sizes=long_blocks)
    assert _lower_for_cuda(4096, 128, True) == explicit
    assert _lower_for_cuda(4096, 128, True, block_sizes=Blocks(128, 2, 2)) != explicit


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_kv_multicast_is_the_default_from_its_measured_lengths(head_dim):
    threshold = fm.MULTICAST_MIN_SEQ_LEN.get(head_dim)
    assert not fm.default_block_sizes(head_dim).kv_multicast
    if threshold is None:
        assert not fm.default_block_sizes(head_dim, 1 << 20).kv_multicast
        return
    assert not fm.default_block_sizes(head_dim, threshold - 1).kv_multicast
    blocks = fm.default_block_sizes(head_dim, threshold)
    assert blocks.kv_multicast
    # with it, head_dim 64 also drops the ping-pong token ring (measured: MULTICAST_WITHOUT_PINGPONG)
    assert blocks.pingpong == (head_dim not in fm.MULTICAST_WITHOUT_PINGPONG)
    assert fm.default_block_sizes(head_dim, threshold - 1).pingpong
    # the same tiling as without it at that length (head_dim 128's long-sequence tiling starts there too)
    long_start, long_blocks = fm._LONG_SEQ_BLOCK_SIZES.get(head_dim, (math.inf, None))
    tiling = long_blocks if threshold >= long_start else fm.default_block_sizes(head_dim)
    assert dataclasses.replace(blocks, kv_multicast=False, pingpong=True) == tiling
    # which is what the defaults give without multicast (persistent builds and the studies take that)
    assert fm.default_block_sizes(head_dim, threshold, kv_multicast=False) == tiling
    # the persistent build's tiling: that one, persistent, with all four producer warps (a valid build)
    assert fm.persistent_block_sizes(head_dim, threshold) == dataclasses.replace(tiling, persistent=True,
                                                                                 warp_producer=False)
    # a call without block sizes lowers to that build on the GPU, and runs without clusters when interpreted
    assert _lower_for_cuda(threshold, head_dim, True) == _lower_for_cuda(threshold, head_dim, True, block_sizes=blocks)
    assert not fm.launch_block_sizes(threshold, head_dim, 2, None, interpret=True).kv_multicast
    assert fm.launch_block_sizes(threshold, head_dim, 2, None, interpret=False).kv_multicast


def test_interpret_mode_runs_the_default_tiling_with_two_consumers():
    # three consumer warpgroups can hang jax's interpreter: a default tiling of three runs there with two
    for head_dim in (32, 64):
        assert fm.launch_block_sizes(1000, head_dim, 2, None, interpret=False).num_compute_wgs == 3
        assert fm.launch_block_sizes(1000, head_dim, 2, None, interpret=True).num_compute_wgs == 2
        assert fm.launch_block_sizes(1000, head_dim, 2, None, interpret="detect_races").num_compute_wgs == 2
    asked = Blocks(128, 2, 3)
    assert fm.launch_block_sizes(1000, 64, 2, asked, interpret=True).num_compute_wgs == 3   # asked for: kept


def test_stages_are_clamped_to_the_sequence():
    blocks = Blocks(block_kv=128, num_stages=6)
    assert fm.resolve_block_sizes(100_000, 64, 2, blocks).num_stages == 6
    assert fm.resolve_block_sizes(300, 64, 2, blocks).num_stages == 3
    assert fm.resolve_block_sizes(5, 64, 2, blocks).num_stages == 2


def test_attention_flops():
    # The causal count: 2 * B * H * S^2 * hd.
    assert fm.attention_flops(1, 100_000, 16, 64, causal=True) == 2 * 16 * 100_000**2 * 64
    assert fm.attention_flops(2, 10, 3, 64, causal=False) == 4 * 2 * 3 * 100 * 64


@pytest.mark.parametrize("bad,match", [
    (dict(dtype=jnp.float32), "float16 or bfloat16"),
    (dict(head_dim=16), "head_dim=16"),   # (32 is supported since session 15)
    (dict(head_dim=96), "head_dim=96"),
    (dict(k_len=9), "must match"),
    (dict(causal=1), "causal=1"),
    (dict(sm_scale="0.1"), "sm_scale"),
    (dict(block_sizes=(128, 2)), "block_sizes"),
    (dict(lowering_semantics="thread"), "lowering_semantics"),
])
def test_bad_arguments_raise(bad, match):
    bad = dict(bad)
    dtype, head_dim = bad.pop("dtype", jnp.float16), bad.pop("head_dim", 64)
    q = jax.ShapeDtypeStruct((1, 8, 2, head_dim), dtype)
    k = jax.ShapeDtypeStruct((1, bad.pop("k_len", 8), 2, head_dim), dtype)
    kwargs = {"causal": True, **bad}
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda q, k, v: fm.flash_attention_mgpu(q, k, v, **kwargs)).trace(q, k, q)


# --- 3. Emulation of the schedule ---------------------------------------------------------------------

def _emulate(q, k, v, causal, blocks):
    """NumPy model of the kernel: the same plan, block order, masks and rescaling as each consumer.

    Also returns, per (tile, consumer), the K and V blocks it released in order and its token passes.
    """
    batch, seq_len, num_heads, head_dim = q.shape
    blocks = fm.resolve_block_sizes(seq_len, head_dim, q.dtype.itemsize, blocks)
    rows, block_kv = fm.ROWS_PER_CONSUMER, blocks.block_kv
    num_tiles = -(-seq_len // blocks.block_q)
    # Reads past the arrays come back as zeros (TMA's zero fill): model them with a zero tail.
    tail = num_tiles * blocks.block_q + 2 * block_kv
    pad = lambda x: np.pad(x.astype(np.float32), ((0, 0), (0, tail), (0, 0), (0, 0)))
    q32, k32, v32 = pad(q), pad(k), pad(v)
    score_scale = head_dim ** -0.5 * np.log2(np.e)
    out = np.zeros(q.shape, np.float32)
    logs = []
    for b, h, program in itertools.product(range(batch), range(num_heads), range(num_tiles)):
        tile = num_tiles - 1 - program if causal else program
        for wg in range(blocks.num_compute_wgs):
            plan = fm.consumer_plan(tile * blocks.block_q, wg, seq_len, blocks, causal)
            row_start = tile * blocks.block_q + wg * rows
            query = np.arange(row_start, row_start + rows)
            q_rows = q32[b, row_start:row_start + rows, h]
            released_k, released_v, tokens = [], [], 0

            def kv(block, x):
                return x[b, block * block_kv:(block + 1) * block_kv, h]

            def softmax(block, m, l, masked):
                scores = q_rows @ kv(block, k32).T
                if masked:
                    key = block * block_kv + np.arange(block_kv)
                    allowed = key[None, :] <= query[:, None] if causal else np.broadcast_to(key < seq_len, scores.shape)
                    scores = np.where(allowed, scores, -np.inf)
                with np.errstate(invalid="ignore"):
                    m_new = np.maximum(m, scores.max(axis=1) * score_scale)
                alpha = np.exp2(m - m_new)
                p = np.exp2(scores * score_scale - m_new[:, None])
                return m_new, l * alpha + p.sum(axis=1), p.astype(q.dtype).astype(np.float32), alpha

            acc = np.zeros((rows, head_dim), np.float32)
            m, l, p, alpha = softmax(0, np.full(rows, -np.inf, np.float32), np.zeros(rows, np.float32),
                                     plan.prologue_masked)
            released_k.append(0)
            tokens += 1
            if not blocks.overlap_softmax:
                acc *= alpha[:, None]
            for block in range(1, plan.num_visited):
                pv = p @ kv(block - 1, v32)
                m, l, p_next, alpha_next = softmax(block, m, l, masked=block >= plan.first_masked)
                released_k.append(block)
                released_v.append(block - 1)
                tokens += 1
                if blocks.overlap_softmax:
                    acc = acc * alpha[:, None] + pv
                else:
                    acc = (acc + pv) * alpha_next[:, None]
                p, alpha = p_next, alpha_next
            pv = p @ kv(plan.num_visited - 1, v32)
            acc = acc * alpha[:, None] + pv if blocks.overlap_softmax else acc + pv
            released_v.append(plan.num_visited - 1)
            tokens += 1
            for block in range(plan.num_visited, plan.tile_blocks):
                released_k.append(block)
                released_v.append(block)
                tokens += 1
            logs.append((tile, wg, plan.tile_blocks, released_k, released_v, tokens))
            valid = query < seq_len
            out[b, query[valid], h] = (acc / l[:, None])[valid]
    return out, logs


@pytest.mark.parametrize("blocks", [
    None,
    Blocks(block_kv=128, num_stages=2, overlap_softmax=False),
    Blocks(block_kv=64, num_stages=3, num_compute_wgs=3),
    Blocks(block_kv=192, num_stages=2),
    Blocks(block_kv=256, num_stages=2),
])
@pytest.mark.parametrize("seq_len", [1, 7, 64, 100, 129, 200, 453])
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_schedule_matches_reference(causal, seq_len, blocks):
    rng = np.random.default_rng(seq_len)
    q, k, v = (rng.standard_normal((2, seq_len, 2, 64)).astype(np.float16) for _ in range(3))
    out, logs = _emulate(q, k, v, causal, blocks)
    expected = np.asarray(flash_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                    causal=causal).astype(jnp.float32))
    # The harness's rule (atol 0.002, rtol 0.02); the only rounding here is P's to fp16.
    np.testing.assert_allclose(out, expected, atol=2e-3, rtol=2e-2)

    for tile, group in itertools.groupby(sorted(logs, key=lambda log: log[0]), key=lambda log: log[0]):
        group = list(group)
        tile_blocks = group[0][2]
        for _, wg, _, released_k, released_v, tokens in group:
            # Each consumer releases every block of its tile once, in order, and passes the token
            # tile_blocks + 1 times: the ring's phases and the token ring stay in step.
            assert released_k == list(range(tile_blocks)), (tile, wg)
            assert released_v == list(range(tile_blocks)), (tile, wg)
            assert tokens == tile_blocks + 1, (tile, wg)


# --- 4. The dispatch rule of `flash_attention` ------------------------------------------------------------

fa = importlib.import_module("ttj_jax.kernels.flash_attention")


@pytest.fixture
def hopper(monkeypatch):
    """Pretend jax's backend is an sm_90 GPU (the dispatch rule reads `on_hopper()` while tracing); jit
    caches are cleared around the test so no trace made under the other answer is reused."""
    monkeypatch.setattr(fa, "on_hopper", lambda: True)
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_no_hopper_kernel_on_the_cpu():
    assert not fa.on_hopper()
    assert not fa.use_mosaic_kernel(jnp.float16, 100_000, 64, masked=False, block_sizes=None, interpret=False)


def test_dispatch_rule_on_hopper(hopper):
    rule = lambda dtype=jnp.float16, s=fm.MIN_SEQ_LEN, hd=64, **kw: fa.use_mosaic_kernel(
        dtype, s, hd, **{"masked": False, "block_sizes": None, "interpret": False, **kw})
    assert rule() and rule(jnp.bfloat16, hd=128) and rule(s=100_000, hd=256)
    assert not rule(s=fm.MIN_SEQ_LEN - 1)                      # short: the generic kernel, measured there
    # ... but fused-layout calls, read in place, from the shorter lengths measured for them
    assert rule(s=128, hd=256, fused=True) and rule(s=1, hd=128, fused=True) and rule(s=1024, hd=64, fused=True)
    assert not rule(s=128, hd=256) and not rule(s=1023, hd=64, fused=True)
    assert not rule(s=128, hd=256, fused=True, masked=True)
    assert not rule(jnp.float32)                               # fp32 inputs: the generic kernel's fp16 path
    assert not rule(hd=96)                                     # a head_dim the Hopper kernel lacks
    # head_dim 32 from its own measured length on (slower than the generic kernel at S=1024)
    assert rule(s=8192, hd=32) and rule(s=8192, hd=32, fused=True)
    assert not rule(hd=32) and not rule(s=8191, hd=32) and not rule(s=1024, hd=32, fused=True)
    assert not rule(masked=True)                               # no masks in the Hopper kernel
    assert not rule(block_sizes=fa.BlockSizes(64, 64, 4, 2))   # generic tiling asked for
    assert not rule(interpret=True)
    assert not rule(implementation="generic")
    assert rule(s=16, implementation="mosaic")                 # forced, where it can run
    with pytest.raises(ValueError, match="implementation='mosaic' needs"):
        rule(masked=True, implementation="mosaic")
    with pytest.raises(ValueError, match="implementation="):
        rule(implementation="cudnn")


def _lowered_calls(fn, *shapes, dtype=jnp.float16, **kwargs) -> str:
    specs = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.jit(lambda *a: fn(*a, **kwargs)).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def test_flash_attention_runs_the_hopper_kernel_where_the_rule_says(hopper):
    shape = (1, fm.MIN_SEQ_LEN, 2, 64)
    assert _custom_calls(_lowered_calls(fa.flash_attention, shape, shape, shape, causal=True)) == ["mosaic_gpu_v2"]
    fused = (1, fm.MIN_SEQ_LEN, 3, 2, 64)
    text = _lowered_calls(fa.flash_attention_fused_qkv, fused, causal=True)
    assert _custom_calls(text) == ["mosaic_gpu_v2"] and "stablehlo.slice" not in text   # read in place
    shape_8 = (2, 128, 3, 4, 256)   # shape 8's call: the Hopper kernel at S=128 too, read in place
    text = _lowered_calls(fa.flash_attention_fused_qkv, shape_8, causal=True)
    assert _custom_calls(text) == ["mosaic_gpu_v2"] and "stablehlo.slice" not in text
    assert "mosaic_gpu" not in _lowered_calls(fa.flash_attention_fused_qkv, (2, 128, 3, 2, 64), causal=True)
    short = (1, 1024, 2, 64)
    assert "mosaic_gpu" not in _lowered_calls(fa.flash_attention, short, short, short, causal=True)
    assert "mosaic_gpu" not in _lowered_calls(fa.flash_attention, shape, shape, shape, causal=True,
                                              implementation="generic")


# --- 5. Inside a batch split (shard_map) -------------------------------------------------------------------

SHARD_SCRIPT = r"""
import re, importlib, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jax.experimental.mosaic.gpu.core as core
from ttj_jax.compat import shard_map
from ttj_jax.parallel import BATCH_AXIS
fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")

modules = []   # each kernel's module as text, just before Mosaic GPU serializes it
serde = core._run_serde_pass
def spy(module, *, serialize, **kwargs):
    if serialize:
        modules.append(module.operation.get_asm(enable_debug_info=False))
    return serde(module, serialize=serialize, **kwargs)
core._run_serde_pass = spy

def normalized(text):   # SSA value numbers differ when lines are inserted
    return [re.sub(r"%\w+", "%v", line) for line in text.splitlines()]

def unused_extra_argument(text):
    # Lane lowering inside shard_map reads one more kernel argument, a memref<16xi64> (mesh metadata for
    # collectives), and never uses it. Drop that block, after checking that its value has no use.
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if line.rstrip().endswith("to memref<16xi64>")), None)
    if end is None:
        return text
    name = lines[end].split("=")[0].strip()
    start = max(i for i in range(end) if "llvm.getelementptr %arg1[" in lines[i])
    rest = lines[:start] + lines[end + 1:]
    assert not any(re.search(re.escape(name) + r"\b", line) for line in rest), "the extra argument is used"
    return "\n".join(rest)

result = {}
for semantics in ("warpgroup", "lane"):
    modules.clear()
    body = lambda q, k, v: fm.flash_attention_mgpu(q, k, v, causal=True, lowering_semantics=semantics)
    local = jax.ShapeDtypeStruct((2, 1024, 2, 64), jnp.float16)
    jax.jit(body).trace(local, local, local).lower(lowering_platforms=("cuda",))
    mesh = Mesh(np.array(jax.devices()[:2]), (BATCH_AXIS,))
    split = jax.jit(shard_map(body, mesh=mesh, in_specs=(P(BATCH_AXIS),) * 3, out_specs=P(BATCH_AXIS)))
    spec = jax.ShapeDtypeStruct((4, 1024, 2, 64), jnp.float16)
    split.trace(spec, spec, spec).lower(lowering_platforms=("cuda",))
    plain, inside = modules
    result[semantics] = {"identical": plain == inside,
                         "same_but_unused_argument": normalized(plain) == normalized(unused_extra_argument(inside))}
print(json.dumps(result))
"""


def test_kernel_inside_a_batch_split_is_the_single_device_kernel():
    # Regression: the grid's axis names once included "batch", which inside parallel.py's shard_map
    # (mesh axis "batch") changed the lowered kernel; on two H200s the split output was wrong. Under the
    # warpgroup lowering the kernel inside the split is byte for byte the one-device kernel; under the
    # lane lowering (head_dim 64's default) it takes one extra argument it never reads, nothing else differs.
    from conftest import last_json_line, run_on_host_devices
    result = last_json_line(run_on_host_devices(["-c", SHARD_SCRIPT], 2))
    assert result["warpgroup"] == {"identical": True, "same_but_unused_argument": True}
    assert result["lane"]["same_but_unused_argument"] is True


# --- 6. Mosaic GPU interpret mode, and the pinned GPU kernel ----------------------------------------------

# (batch, seq_len, num_heads, head_dim, causal, blocks): small, the interpreter is slow. head_dim 64 runs
# with two consumers (with and without overlap_softmax): its default three-consumer tiling hung now and
# then in the interpreter on this CPU (three consumer threads waiting on barriers, the fourth inside XLA's
# execution of the interpreter's jaxpr, no kernel frame), so it is checked only by lowering and on the H200.
INTERPRET_CASES = {
    "hd128-S64-causal": (1, 64, 1, 128, True, None),
    "hd128-S113-B2": (2, 113, 1, 128, False, None),
    "hd128-S200-H2-causal": (1, 200, 2, 128, True, None),
    "hd64-S320-causal-3tiles-5blocks": (1, 320, 1, 64, True, Blocks(block_kv=64, num_stages=3)),
    "hd64-S200-overlap": (1, 200, 1, 64, False, Blocks(block_kv=128, num_stages=2, overlap_softmax=True)),
    "hd64-S113-overlap-causal": (1, 113, 1, 64, True, Blocks(block_kv=64, num_stages=2, overlap_softmax=True)),
    "hd64-S200-poly-exp-causal": (1, 200, 1, 64, True, Blocks(block_kv=128, num_stages=2, poly_exp_keys=64)),
    "hd128-S113-poly-exp": (1, 113, 1, 128, False, Blocks(block_kv=128, num_stages=2, poly_exp_keys=64)),
    "hd64-S200-row-sum-mma-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, row_sum_mma=True)),
    "hd128-S113-row-sum-mma": (2, 113, 1, 128, False, Blocks(block_kv=64, num_stages=2, row_sum_mma=True)),
    "hd64-S200-half-exp2-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, half_exp2=True)),
    "hd128-S113-half-exp2": (2, 113, 1, 128, False, Blocks(block_kv=64, num_stages=2, half_exp2=True)),
    # the one-accumulator overlap's schedule and its fp32 P held until P @ V completes (the interpreter
    # takes its accumulator store as a zero accumulator plus an add: see the kernel file's list)
    "hd64-S200-one-acc-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, overlap_softmax=True,
                                                             overlap_one_accumulator=True)),
    "hd128-S113-one-acc": (2, 113, 1, 128, False, Blocks(block_kv=64, num_stages=2, overlap_softmax=True,
                                                         overlap_one_accumulator=True)),
    # Q scaled in SMEM before its first wgmma; the row sums in fp16 (session 15)
    "hd64-S200-prescaled-q-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, prescaled_q=True)),
    "hd128-S113-prescaled-q-half-row-sum": (2, 113, 1, 128, False, Blocks(block_kv=64, num_stages=2,
                                                                          prescaled_q=True, half_row_sum=True)),
    "hd64-S200-half-row-sum-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, half_row_sum=True)),
    # no token ring: the consumers' GEMM phases in any order
    "hd64-S200-no-pingpong-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, pingpong=False)),
    # head_dim 32 (session 15): 64-byte rows, so 64-byte swizzle and wgmma K steps of 32
    "hd32-S200-causal": (1, 200, 1, 32, True, Blocks(block_kv=64, num_stages=2)),
    "hd32-S113": (2, 113, 1, 32, False, Blocks(block_kv=128, num_stages=2)),
    # per-lane row sums reduced across lanes once at the end; row max over 8-column chunks as a tree
    "hd64-S200-deferred-sum-tree-max-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2,
                                                                           deferred_row_sum=True,
                                                                           tree_row_max=True)),
    "hd128-S113-deferred-sum-one-acc": (2, 113, 1, 128, False, Blocks(block_kv=128, num_stages=2,
                                                                      overlap_softmax=True,
                                                                      overlap_one_accumulator=True,
                                                                      deferred_row_sum=True)),
    "hd64-S200-poly-deferred-sum-causal": (1, 200, 1, 64, True, Blocks(block_kv=128, num_stages=2, poly_exp_keys=64,
                                                                       deferred_row_sum=True, tree_row_max=True)),
    # the running max moves only past a threshold (session 16; the multiplies' branch is GPU-only: here
    # the plain product, equal where the factor is 1.0); test_lazy_rescale_... makes the max move late
    "hd64-S200-lazy-rescale-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, lazy_rescale=True)),
    "hd128-S113-lazy-rescale": (2, 113, 1, 128, False, Blocks(block_kv=64, num_stages=2, lazy_rescale=True)),
    # persistent blocks (session 16): PERSISTENT_INTERPRET_PROGRAMS of them over 4 tiles, so one runs two
    # (the ring restarting at slot 0, the next Q prefetched, the output staged apart, the token ring)
    "hd64-S200-persistent-causal": (1, 200, 2, 64, True, Blocks(block_kv=64, num_stages=2, persistent=True)),
    "hd64-S200-persistent-3stages": (1, 200, 2, 64, False, Blocks(block_kv=64, num_stages=3, persistent=True)),
    # Q @ K^T with Q from registers (session 18); with Q scaled in SMEM first, the registers hold the scaled Q
    "hd64-S200-q-in-registers-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, q_in_registers=True)),
    "hd64-S113-q-in-registers-prescaled": (2, 113, 1, 64, False, Blocks(block_kv=64, num_stages=2, q_in_registers=True,
                                                                       prescaled_q=True)),
    # 4 query tiles per head >= 3 blocks: the head-major order of long sequences (persistent_tile)
    "hd64-S400-persistent-head-major-causal": (1, 400, 2, 64, True, Blocks(block_kv=64, num_stages=2,
                                                                           persistent=True)),
    "hd128-S113-persistent-one-acc-causal": (2, 113, 2, 128, True, Blocks(block_kv=64, num_stages=2, overlap_softmax=True,
                                                                          overlap_one_accumulator=True, persistent=True)),
}


def _interpret_case(batch, seq_len, num_heads, head_dim, causal, blocks, interpret):
    rng = np.random.default_rng(seq_len * head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq_len, num_heads, head_dim)).astype(np.float16))
               for _ in range(3))
    out = fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=blocks, interpret=interpret)
    assert out.shape == q.shape and out.dtype == q.dtype
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(flash_attention_reference(q, k, v, causal=causal).astype(jnp.float32))
    failed, worst, _ = harness_check(out, ref)   # the harness rule
    assert int(failed) == 0, f"{int(failed)} elements fail, worst err/tol {float(worst):.2f}"


@pytest.mark.parametrize("case", sorted(INTERPRET_CASES))
def test_kernel_in_gpu_interpret_mode(case):
    # The kernel body runs on the CPU: warpgroups as threads, SMEM with the tiling/swizzle transforms,
    # TMA copies, barriers (phase checks), wgmma. Its substitutes there (P and K^T staged through SMEM,
    # no layouts, run_state as run_scoped, arrays padded to whole query tiles, the last barrier phases
    # observed) are listed at the end of ttj_jax/kernels/flash_attention_mgpu.py.
    _interpret_case(*INTERPRET_CASES[case], interpret=True)


def _scores(q, k, causal):
    """fp32 sm_scale q.k for q, k [B, S, H, hd]: [B, H, S, S], -inf above the diagonal when causal."""
    seq_len, head_dim = q.shape[1], q.shape[3]
    scores = jnp.einsum("bqhd,bkhd->bhqk", *(x.astype(jnp.float32) for x in (q, k)),
                        precision="highest") * head_dim ** -0.5
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((seq_len, seq_len), bool)), scores, -jnp.inf)
    return scores


@pytest.mark.parametrize("batch, seq_len, causal, blocks",
                         [(2, 113, False, None), (1, 200, True, None),
                          # persistent blocks store each tile's log-sum-exp rows beside its staged output
                          (1, 200, True, Blocks(block_kv=64, num_stages=2, persistent=True))])
def test_log_sum_exp_in_gpu_interpret_mode(batch, seq_len, causal, blocks):
    # return_lse: each row's log(sum_j exp(sm_scale q.k_j)) from the kernel's base-2 running max and sum
    # (what the ring merges visits with); the output is the one without it, bit for bit.
    rng = np.random.default_rng(seq_len)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, seq_len, 2, 128)).astype(np.float16)) for _ in range(3))
    out, lse = fm.flash_attention_mgpu(q, k, v, causal=causal, interpret=True, return_lse=True, block_sizes=blocks)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fm.flash_attention_mgpu(q, k, v, causal=causal,
                                                                                      interpret=True,
                                                                                      block_sizes=blocks)))
    expected = np.asarray(jax.nn.logsumexp(_scores(q, k, causal), axis=-1))
    assert lse.shape == (batch, 2, seq_len) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("causal", [True, False])
def test_lazy_rescale_when_the_max_moves_late_in_gpu_interpret_mode(causal):
    # lazy_rescale keeps each row's max until a block's scores exceed it by more than the threshold:
    # keys 150-159 scaled up so that their scores jump far past it (the moved branch, alpha < 1, in a
    # late block), while the other rows' max mostly stays (alpha exactly 1). Output and log-sum-exp
    # against the fp32 reference, and P's reach of 2^threshold is checked by the harness rule.
    rng = np.random.default_rng(16)
    q, k, v = (rng.standard_normal((1, 200, 1, 64)).astype(np.float32) for _ in range(3))
    k[:, 150:160] *= 6.0
    q, k, v = (jnp.asarray(x.astype(np.float16)) for x in (q, k, v))
    blocks = Blocks(block_kv=64, num_stages=2, lazy_rescale=True)
    out, lse = fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=blocks, interpret=True, return_lse=True)
    ref = flash_attention_reference(q, k, v, causal=causal).astype(jnp.float32)
    failed, worst, _ = harness_check(out, ref)
    assert int(failed) == 0, f"worst err/tol {float(worst):.2f}"
    scores = _scores(q, k, causal)
    # the jump is real: for the rows that see keys 150-159, the max rises by more than the threshold
    base2 = scores * fm._LOG2_E
    early_max = jnp.max(base2[..., 160:, :64], axis=-1)
    assert float(jnp.max(jnp.max(base2[..., 160:, :], axis=-1) - early_max)) > fm.LAZY_RESCALE_THRESHOLD
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(scores, axis=-1)), rtol=0, atol=1e-4)


@pytest.mark.parametrize("batch, num_heads, seq_len, causal, programs",
                         [(1, 16, 100000, True, 132), (8, 16, 100000, True, 132), (64, 4, 1024, True, 132),
                          (2, 3, 1000, False, 7), (3, 2, 1000, True, 5), (1, 1, 100, True, 1)])
def test_persistent_schedule(batch, num_heads, seq_len, causal, programs):
    blocks = Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, persistent=True)
    num_q_tiles = -(-seq_len // blocks.block_q)
    lists = fm.persistent_schedule(batch, num_heads, num_q_tiles, causal, programs)
    # every (sequence, head, tile) exactly once
    items = [item for items in lists for item in items]
    assert sorted(items) == [(b, h, t) for b in range(batch) for h in range(num_heads) for t in range(num_q_tiles)]

    def cost(item):
        return fm.kv_block_range(item[2] * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv, causal)[1]
    # balanced: no block ends more than one tile's work (plus a few blocks) after the average
    loads = [sum(cost(i) for i in items) for items in lists]
    assert max(loads) <= sum(loads) / programs + max(map(cost, items)) + 8
    # locality: each round's blocks work on consecutive sequences, as few as the round's size allows
    # (one, or two where it crosses into the next, when a sequence has more tiles than there are blocks)
    rounds = max(map(len, lists))
    span = -(-programs // (num_heads * num_q_tiles)) + 1
    for j in range(rounds):
        sequences = {items[j][0] for items in lists if len(items) > j}
        assert max(sequences) - min(sequences) < span and len(sequences) <= span
    # causal, long sequences: the schedule ends on light tiles (its tail), no block's last tile above the
    # median cost (short ones: a round spans several sequences run in both directions)
    if causal and num_q_tiles >= 4 * programs:
        assert max(cost(items[-1]) for items in lists if items) <= sorted(map(cost, items))[len(items) // 2]
    # long sequences: each round within one head, or two where it crosses into the next
    if num_q_tiles >= programs:
        for j in range(rounds):
            heads = {items[j][:2] for items in lists if len(items) > j}
            assert len(heads) <= 2
    # the kernel computes the same with traced int32 scalars
    for j in range(min(rounds, 3)):
        for program in (0, programs - 1):
            py = fm.persistent_tile(j, program, programs, batch, num_heads, num_q_tiles, causal)
            traced = jax.jit(lambda j, p: fm.persistent_tile(j, p, programs, batch, num_heads, num_q_tiles,
                                                             causal))(jnp.int32(j), jnp.int32(program))
            assert [bool(py[0])] + [int(x) for x in py[1:]] == [bool(traced[0])] + [int(x) for x in traced[1:]]


def test_log_sum_exp_is_routed_to_the_hopper_kernel(hopper):
    # flash_attention(return_lse=True) takes the Hopper kernel where the dispatch rule sends the call
    shape = (1, fm.MIN_SEQ_LEN, 2, 64)
    assert _custom_calls(_lowered_calls(lambda q, k, v: fa.flash_attention(q, k, v, causal=True, return_lse=True),
                                        shape, shape, shape)) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("batch, seq_len, num_heads, head_dim, causal, blocks",
                         [(2, 113, 2, 128, True, None), (1, 200, 1, 128, False, None),
                          # head_dim 32 with two consumers: its default has three, which the interpreter
                          # can hang on (see the kernel file's list of interpret-mode substitutes)
                          (1, 136, 2, 32, True, Blocks(block_kv=64, num_stages=2))])
def test_fused_qkv_entry_reads_q_k_v_in_place(batch, seq_len, num_heads, head_dim, causal, blocks):
    # flash_attention_mgpu_fused_qkv: the same kernel with its TMA copies indexing slot 0/1/2 of one
    # [B, S, 3, H, hd] array: equal to the kernel on the three arrays sliced out, bit for bit (GPU
    # interpret mode; odd S pads the fused array once), and lowered for CUDA with nothing sliced.
    rng = np.random.default_rng(seq_len + head_dim)
    qkv = jnp.asarray(rng.standard_normal((batch, seq_len, 3, num_heads, head_dim)).astype(np.float16))
    fused = fm.flash_attention_mgpu_fused_qkv(qkv, causal=causal, interpret=True, block_sizes=blocks)
    split = fm.flash_attention_mgpu(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, interpret=True,
                                    block_sizes=blocks)
    assert fused.shape == (batch, seq_len, num_heads, head_dim)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(split))
    spec = jax.ShapeDtypeStruct((2, 128, 3, 4, 256), jnp.float16)   # shape 8's call
    text = jax.jit(lambda a: fm.flash_attention_mgpu_fused_qkv(a, causal=True)).trace(spec).lower(
        lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    assert "stablehlo.slice" not in text and "stablehlo.pad" not in text
    with pytest.raises(ValueError, match="3, num_heads"):
        fm.flash_attention_mgpu_fused_qkv(qkv[:, :, :2], causal=True)


def test_kernel_in_gpu_interpret_mode_has_no_races():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    _interpret_case(1, 200, 1, 128, True, None, interpret="detect_races")
    assert not gpu_callbacks.get_races().races_found


def test_interpret_argument_is_checked():
    with pytest.raises(ValueError, match="interpret="):
        _lower_for_cuda(64, 64, True, interpret="yes")


# SHA-1 of the lowered `mosaic_gpu_v2` custom-call line (the whole text line: the serialized Mosaic GPU
# module, its kernel hash and attributes), lowered with source locations off (JAX_TRACEBACK_IN_LOCATIONS_LIMIT
# =0, so moving code or the checkout changes nothing) and recorded with jax 0.10.2. They equal those of
# commit 68a8a2a, the build whose default (tiles_inner) ran shape 14 on the H200 with every check clean
# (bench/results/scale-2026-11-30-h200-hopper*.json): this pins that interpret mode, added since, and
# any later edit leave the GPU kernel byte for byte as verified. Re-pin only with a GPU check. Other jax
# versions lower differently (the H200 runs 0.11.2): there the test only checks that each case lowers.
PINNED_JAX_VERSION = "0.10.2"
PINNED_KERNEL_HASHES = {
    "hd64_causalTrue_s128": "73fc7e60c26d7e24fe56d97b67d829ffe677e6f8",
    "hd64_causalTrue_s1000": "1c5c032fe1d041399a9c2781e4f77ca37fa476ef",
    "hd64_causalFalse_s128": "20e9a4a839512e88d82147d2b5701df2f35547a1",
    "hd64_causalFalse_s1000": "4300fd1b1d92b5a0a1fe389d53153b4c64b1e6d2",
    "hd128_causalTrue_s128": "2fd7aa880391d85feca38b10ec19154e83d9b887",
    "hd128_causalTrue_s1000": "40eefb6e4eef04e6b6f6e095ff9d8babf34308bb",
    "hd128_causalFalse_s128": "7d8f89fd3d632af0c895c7c9afa6e5166e428241",
    "hd128_causalFalse_s1000": "1c044f1c095676ea56fadd7a77d652f987c384ca",
    "hd256_causalTrue_s128": "3db18a32bc9cc473263f4ddbfe114be259e68025",
    "hd256_causalTrue_s1000": "018d9899f1e9ea2352391db2ad77bb1550f70598",
    "hd256_causalFalse_s128": "3c346b7fe8fe4c4ec78e49b07b9dad11cfb00570",
    "hd256_causalFalse_s1000": "e6237c737f98f51b839f35ea3aefa2c4e8f934aa",
    "hd64_causalTrue_s1000_tiles_outer": "112e941cdb93653701ee117ebd525abd62a238f9",
    "hd64_causalFalse_s1000_tiles_outer": "d39418bb42cb0349f2d1e76590f07951ec39cdcd",
    "hd64_causalTrue_s1000_lane": "0774812c70e48874ba60e5ba1b8b2f3ec05e10ba",
    "hd64_causalFalse_s1000_lane": "21978265d6ee855373487cc429c82ae41b164237",
    # head_dim 64's default lowering is lane since session 10: the default build is the lane build above.
    # Re-pinned in session 21 for the producer's loads from one warp (MgpuBlockSizes.warp_producer, the
    # default at head_dim 64): the lane hashes above were f649d577... / 8b1c5567...; the new default was
    # checked on the H200 by `python3 bench/bench_attention_mgpu.py --check` (S=1000 among its cases) and
    # issue 3's benchmark (bench/results/attention-mgpu-2026-12-02-nvidia-h200-session21-check.json,
    # attention-2026-12-02-nvidia-h200-session21.json). The warpgroup builds are unchanged.
    "hd64_causalTrue_s1000_default": "0774812c70e48874ba60e5ba1b8b2f3ec05e10ba",
    "hd64_causalFalse_s1000_default": "21978265d6ee855373487cc429c82ae41b164237",
}

PIN_SCRIPT = r"""
import hashlib, importlib, json, re
import jax, jax.numpy as jnp
fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")

def kernel_hash(seq_len, head_dim, causal, **kwargs):
    spec = jax.ShapeDtypeStruct((1, seq_len, 2, head_dim), jnp.float16)
    call = jax.jit(lambda q, k, v: fm.flash_attention_mgpu(q, k, v, causal=causal, **kwargs))
    text = call.trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
    lines = [line for line in text.splitlines() if "stablehlo.custom_call @mosaic_gpu_v2" in line]
    assert len(lines) == 1
    return hashlib.sha1(lines[0].encode()).hexdigest()

out = {}
for head_dim in (64, 128, 256):
    for causal in (True, False):
        for seq_len in (128, 1000):
            out[f"hd{head_dim}_causal{causal}_s{seq_len}"] = kernel_hash(seq_len, head_dim, causal,
                                                                         lowering_semantics="warpgroup")
for causal in (True, False):
    out[f"hd64_causal{causal}_s1000_tiles_outer"] = kernel_hash(1000, 64, causal, grid_order="tiles_outer",
                                                                lowering_semantics="warpgroup")
    out[f"hd64_causal{causal}_s1000_lane"] = kernel_hash(1000, 64, causal, lowering_semantics="lane")
    out[f"hd64_causal{causal}_s1000_default"] = kernel_hash(1000, 64, causal)   # lane: _DEFAULT_LOWERING
print(json.dumps({"jax": jax.__version__, "hashes": out}))
"""


def test_gpu_kernel_is_the_pinned_h200_build():
    import json, os, subprocess, sys
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_TRACEBACK_IN_LOCATIONS_LIMIT="0")
    done = subprocess.run([sys.executable, "-c", PIN_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["hashes"]) == set(PINNED_KERNEL_HASHES)
    if result["jax"] == PINNED_JAX_VERSION:
        assert result["hashes"] == PINNED_KERNEL_HASHES


# --- MgpuBlockSizes.kv_multicast (session 19): 2-block clusters sharing K/V by TMA multicast ---------
# The GPU kernel cannot run here (no clusters in interpret mode: the build refuses it); its pairing plan
# is checked in Python below, its lowering here, and its output on the H200 (`python3
# bench/bench_attention_mgpu.py --multicast`, results named in MgpuBlockSizes.kv_multicast's comment).

@pytest.mark.parametrize("seq_len, head_dim", [(1, 64), (113, 64), (1000, 64), (1200, 64), (2000, 128),
                                               (100000, 64), (16384, 128), (777, 256)])
@pytest.mark.parametrize("causal", [True, False])
def test_multicast_pairs_cover_every_tile_once_and_share_what_both_need(seq_len, head_dim, causal):
    blocks = dataclasses.replace(fm.default_block_sizes(head_dim, seq_len), kv_multicast=True)
    num_q_tiles = -(-seq_len // blocks.block_q)
    tiles = []
    for pair in range(-(-num_q_tiles // 2)):
        plans = [fm.multicast_pair(pair, member, num_q_tiles, seq_len, blocks, causal) for member in (0, 1)]
        assert plans[0][0], "the first member of every pair has a tile"
        assert plans[0][2] == plans[1][2], "both members agree on the shared blocks"
        shared = plans[0][2]
        for valid, tile, _ in plans:
            if not valid:
                continue
            tiles.append(tile)
            _, needed = fm.kv_block_range(tile * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv, causal)
            assert shared <= needed   # a member loads exactly [0, needed): shared ones together, the rest alone
        if plans[1][0]:   # a full pair shares all of its second member's blocks
            _, second = fm.kv_block_range(plans[1][1] * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv,
                                          causal)
            assert shared == second
            assert abs(plans[0][1] - plans[1][1]) == 1   # neighbouring tiles: the same keys, give or take
        else:
            assert shared == 0
    assert sorted(tiles) == list(range(num_q_tiles))
    if causal:   # heaviest first, as without clusters
        assert tiles[0] == num_q_tiles - 1


def test_multicast_build_lowers_to_multicast_copies():
    for causal in (True, False):
        blocks = dataclasses.replace(fm.default_block_sizes(64, 1200), kv_multicast=True)
        text = _lower_for_cuda(1200, 64, causal, block_sizes=blocks)
        assert "multicast" in text and "mosaic_gpu_v2" in text
    assert "multicast" not in _lower_for_cuda(1200, 64, True)


def test_warp_producer_is_the_lane_default_and_changes_the_lowered_kernel():
    # session 21: the producer's loads from one warp (core_map over WarpMesh) at head_dim 32 and 64
    for head_dim in (32, 64):
        assert fm.default_block_sizes(head_dim, 1000).warp_producer
        assert fm.default_block_sizes(head_dim, 100_000).warp_producer   # with multicast too
    assert not fm.default_block_sizes(128, 1000).warp_producer
    assert not fm.default_block_sizes(256, 100_000).warp_producer
    one_warp = fm.default_block_sizes(64, 1000)
    four_warps = dataclasses.replace(one_warp, warp_producer=False)
    assert _lower_for_cuda(1000, 64, True, block_sizes=one_warp) != _lower_for_cuda(1000, 64, True,
                                                                                   block_sizes=four_warps)
    # with multicast: the cluster arrive from a warp (compat.mosaic_cluster_arrive_from_warp) lowers
    multicast = dataclasses.replace(one_warp, kv_multicast=True)
    assert "multicast" in _lower_for_cuda(1200, 64, True, block_sizes=multicast)
    # the model's fused-layout call (shape 14's, run on the H200 in session 21) and the lse output too
    spec = jax.ShapeDtypeStruct((1, 1024, 3, 2, 64), jnp.float16)
    text = jax.jit(lambda a: fm.flash_attention_mgpu_fused_qkv(a, causal=True)).trace(spec).lower(
        lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    assert _custom_calls(_lower_for_cuda(1000, 64, True, return_lse=True)) == ["mosaic_gpu_v2"]


def test_warp_producer_needs_the_lane_lowering_unless_it_is_the_default():
    one_warp = fm.default_block_sizes(64, 1000)
    four_warps = dataclasses.replace(one_warp, warp_producer=False)
    # the default tiling lowered the warpgroup way runs with four producer warps: the same kernel
    assert _lower_for_cuda(1000, 64, True, lowering_semantics="warpgroup") == _lower_for_cuda(
        1000, 64, True, lowering_semantics="warpgroup", block_sizes=four_warps)
    with pytest.raises(ValueError, match="warp_producer needs lowering_semantics='lane'"):
        _lower_for_cuda(1000, 64, True, lowering_semantics="warpgroup", block_sizes=one_warp)
    with pytest.raises(ValueError, match="warp_producer"):
        dataclasses.replace(four_warps, warp_producer=True, persistent=True)
    with pytest.raises(ValueError, match="warp_producer"):
        Blocks(block_kv=128, num_stages=2, warp_producer=1)


def test_warp_producer_changes_nothing_in_interpret_mode():
    # no warps in jax's interpreter: the loads run as without it, so the output is the same to the bit
    q, k, v = (jax.random.normal(key, (1, 200, 2, 64), jnp.float16) for key in jax.random.split(
        jax.random.PRNGKey(21), 3))
    outs = [fm.flash_attention_mgpu(q, k, v, causal=True, interpret=True,
                                    block_sizes=Blocks(block_kv=64, num_stages=2, warp_producer=flag))
            for flag in (True, False)]
    assert bool(jnp.array_equal(outs[0], outs[1]))


def test_multicast_is_refused_where_there_are_no_clusters():
    blocks = dataclasses.replace(fm.default_block_sizes(64, 1000), kv_multicast=True)
    q = jnp.zeros((1, 1000, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match="kv_multicast"):
        fm.flash_attention_mgpu(q, q, q, causal=True, block_sizes=blocks, interpret=True)
    with pytest.raises(ValueError, match="kv_multicast"):
        _lower_for_cuda(1000, 64, True, block_sizes=blocks, grid_order="tiles_outer")
    with pytest.raises(ValueError, match="kv_multicast"):
        dataclasses.replace(blocks, persistent=True, warp_producer=False)
    with pytest.raises(ValueError, match="kv_multicast"):
        Blocks(block_kv=128, num_stages=2, kv_multicast=1)
