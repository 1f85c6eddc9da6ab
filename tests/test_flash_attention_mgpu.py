"""CPU checks of the Hopper (Mosaic GPU) flash-attention kernel, `ttj_jax/kernels/flash_attention_mgpu*.py`.

Mosaic GPU kernels execute only on sm_90 GPUs; there `bench/bench_attention_mgpu.py` checks the kernel
against `flash_attention_reference` and times it. On the CPU:
1. Lowering for CUDA succeeds and emits one Mosaic GPU custom call (Pallas -> Mosaic GPU, layout
   inference, wgmma operand and shape checks, TMA slicing, the shared-memory budget; PTX generation,
   ptxas and execution happen only on the GPU).
2. The pure-Python pieces: KV block ranges (against explicit masks), padding, block-size validation and
   tables, the multicast pairing, argument validation.
3. A NumPy emulation of each consumer warpgroup's schedule, driven by the kernel's own `consumer_plan`,
   against the reference, and the barrier bookkeeping that keeps the kernel from deadlocking.
4. `flash_attention`'s dispatch rule, and the kernel inside a batch split.
The kernel body in interpret mode: test_flash_attention_mgpu_interpret.py; the lowered kernel pinned by
hash: test_flash_attention_mgpu_pinned.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ttj_jax.kernels import flash_attention_mgpu_config as config
from ttj_jax.kernels import flash_attention_mgpu_kernel as kern
from ttj_jax.kernels import flash_attention_reference

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")   # the package exports a function of that name
Blocks = config.MgpuBlockSizes


def _lower_for_cuda(seq_len, head_dim, causal, *, dtype=jnp.float16, batch=1, num_heads=2, **kwargs) -> str:
    spec = jax.ShapeDtypeStruct((batch, seq_len, num_heads, head_dim), dtype)
    call = jax.jit(lambda q, k, v: fm.flash_attention_mgpu(q, k, v, causal=causal, **kwargs))
    return call.trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("seq_len, head_dim, causal, kwargs", [
    (4096, 64, True, {}), (32768, 64, True, {}), (1000, 64, True, {"lowering_semantics": "warpgroup"}),
    (4096, 128, False, {}), (16384, 256, True, {}), (8192, 32, True, {}), (4096, 64, True, {"return_lse": True})])
def test_key_masked_build_lowers_for_cuda(seq_len, head_dim, causal, kwargs):
    """The key-masked build of each head_dim's default tiling (multicast and the one-warp producer where
    those defaults take them, both lowerings) lowers for CUDA: Mosaic GPU's layout inference included.
    (The fused entry: the next test.)"""
    spec = jax.ShapeDtypeStruct((2, seq_len, 2, head_dim), jnp.float16)
    mask = jax.ShapeDtypeStruct((2, seq_len), jnp.bool_)
    call = jax.jit(lambda q, k, v, m: fm.flash_attention_mgpu(q, k, v, causal=causal, key_mask=m, clean_blocks=False,
                                                              **kwargs))
    text = call.trace(spec, spec, spec, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text).count("mosaic_gpu_v2") == 1
    # the mask-free build's text is another kernel
    assert text != _lower_for_cuda(seq_len, head_dim, causal, batch=2, **kwargs)
    # and so is the build with clean-block bounds (their copy and a scalar read, four loop segments; the
    # default since their first GPU run)
    bounded = jax.jit(lambda q, k, v, m: fm.flash_attention_mgpu(q, k, v, causal=causal, key_mask=m, clean_blocks=True,
                                                                 **kwargs))
    bounded_text = bounded.trace(spec, spec, spec, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(bounded_text).count("mosaic_gpu_v2") == 1 and bounded_text != text


def test_key_masked_fused_entry_lowers_for_cuda():   # shape 8's call
    fused = jax.ShapeDtypeStruct((2, 128, 3, 4, 256), jnp.float16)
    for clean in (False, True):
        text = jax.jit(lambda a, m, clean=clean: fm.flash_attention_mgpu_fused_qkv(a, causal=True, key_mask=m,
                                                                                  clean_blocks=clean)).trace(
            fused, jax.ShapeDtypeStruct((2, 128), jnp.bool_)).lower(lowering_platforms=("cuda",)).as_text()
        assert _custom_calls(text).count("mosaic_gpu_v2") == 1
    # the training forward's call: hd64 at S=4096 (GPT-2-like), the log-sum-exp returned
    fused = jax.ShapeDtypeStruct((1, 4096, 3, 12, 64), jnp.float16)
    text = jax.jit(lambda a, m: fm.flash_attention_mgpu_fused_qkv(a, causal=True, key_mask=m, return_lse=True)).trace(
        fused, jax.ShapeDtypeStruct((1, 4096), jnp.bool_)).lower(lowering_platforms=("cuda",)).as_text()
    assert _custom_calls(text).count("mosaic_gpu_v2") == 1


def test_key_mask_must_be_bool_batch_by_seq_len():
    q = jnp.zeros((2, 64, 1, 64), jnp.float16)
    for bad in (jnp.ones((2, 63), bool), jnp.ones((2, 64), jnp.int32)):
        with pytest.raises(ValueError, match="key_mask"):
            fm.flash_attention_mgpu(q, q, q, causal=True, key_mask=bad, interpret=True)


def _custom_calls(text: str) -> list[str]:
    return re.findall(r"stablehlo\.custom_call @(\w+)", text)


# --- 1. Lowering for CUDA -----------------------------------------------------------------------------

@pytest.mark.parametrize("seq_len", [128, 100_000])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_lowers_to_one_mosaic_gpu_kernel(head_dim, causal, seq_len):
    # S=100000 takes each head_dim's long-sequence build (multicast; head_dim 128's softmax overlap)
    text = _lower_for_cuda(seq_len, head_dim, causal)
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    # S is a multiple of 8: q, k, v are read in place and the output written in place.
    assert "stablehlo.pad" not in text and "stablehlo.slice" not in text


@pytest.mark.parametrize("seq_len", [1, 7, 113, 1023])
@pytest.mark.parametrize("causal", [False, True])
def test_lowers_at_odd_lengths(seq_len, causal):
    text = _lower_for_cuda(seq_len, 64, causal)
    assert _custom_calls(text) == ["mosaic_gpu_v2"]
    needs_padding = fm.padded_seq_len(seq_len) != seq_len
    assert ("stablehlo.pad" in text) == needs_padding


@pytest.mark.parametrize("head_dim,blocks", [
    (64, Blocks(block_kv=128, num_stages=4, num_compute_wgs=2)),
    (64, Blocks(block_kv=256, num_stages=2)),
    (64, Blocks(block_kv=192, num_stages=3)),
    (64, Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, overlap_softmax=True)),
    (128, Blocks(block_kv=64, num_stages=4, num_compute_wgs=3)),
    (64, Blocks(block_kv=128, num_stages=4, num_compute_wgs=3, pingpong=False)),
])
def test_lowers_with_other_block_sizes(head_dim, blocks):
    assert _custom_calls(_lower_for_cuda(1000, head_dim, True, block_sizes=blocks)) == ["mosaic_gpu_v2"]


@pytest.mark.parametrize("lowering_semantics", ["lane", "warpgroup"])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_lowers_in_both_semantics_and_dtypes(lowering_semantics, dtype):
    text = _lower_for_cuda(1000, 128, True, dtype=dtype, batch=2, lowering_semantics=lowering_semantics)
    assert _custom_calls(text) == ["mosaic_gpu_v2"]


def test_lowered_kernel_depends_on_causal_and_blocks():
    """The lowered module carries the kernel: different statics give a different serialized module."""
    def module_of(**kwargs):
        return re.search(r'module = "([^"]*)"', _lower_for_cuda(1000, 64, **kwargs)).group(1)
    causal, full = module_of(causal=True), module_of(causal=False)
    other = module_of(causal=True, block_sizes=Blocks(block_kv=256, num_stages=2))
    assert len({causal, full, other}) == 3


def test_multicast_build_lowers_to_multicast_copies():
    for causal in (True, False):
        blocks = dataclasses.replace(config.default_block_sizes(64, 1200), kv_multicast=True)
        text = _lower_for_cuda(1200, 64, causal, block_sizes=blocks)
        assert "multicast" in text and "mosaic_gpu_v2" in text
    assert "multicast" not in _lower_for_cuda(1200, 64, True)


def test_warp_producer_changes_the_lowered_kernel():
    for head_dim in (32, 64):
        assert config.default_block_sizes(head_dim, 1000).warp_producer
        assert config.default_block_sizes(head_dim, 100_000).warp_producer   # with multicast too
    assert not config.default_block_sizes(128, 1000).warp_producer
    assert not config.default_block_sizes(256, 100_000).warp_producer
    one_warp = config.default_block_sizes(64, 1000)
    four_warps = dataclasses.replace(one_warp, warp_producer=False)
    assert _lower_for_cuda(1000, 64, True, block_sizes=one_warp) != _lower_for_cuda(1000, 64, True,
                                                                                   block_sizes=four_warps)
    # with multicast: the cluster arrive from a warp (mosaic_primitives.mosaic_cluster_arrive_from_warp)
    multicast = dataclasses.replace(one_warp, kv_multicast=True)
    assert "multicast" in _lower_for_cuda(1200, 64, True, block_sizes=multicast)


def test_warp_producer_needs_the_lane_lowering_unless_it_is_the_default():
    one_warp = config.default_block_sizes(64, 1000)
    four_warps = dataclasses.replace(one_warp, warp_producer=False)
    # the default tiling lowered the warpgroup way runs with four producer warps: the same kernel
    assert _lower_for_cuda(1000, 64, True, lowering_semantics="warpgroup") == _lower_for_cuda(
        1000, 64, True, lowering_semantics="warpgroup", block_sizes=four_warps)
    with pytest.raises(ValueError, match="warp_producer needs lowering_semantics='lane'"):
        _lower_for_cuda(1000, 64, True, lowering_semantics="warpgroup", block_sizes=one_warp)


def test_multicast_is_refused_where_there_are_no_clusters():
    blocks = dataclasses.replace(config.default_block_sizes(64, 1000), kv_multicast=True)
    q = jnp.zeros((1, 1000, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match="kv_multicast"):
        fm.flash_attention_mgpu(q, q, q, causal=True, block_sizes=blocks, interpret=True)


def test_fused_qkv_lowers_with_nothing_sliced():
    for shape in ((2, 128, 3, 4, 256), (1, 1024, 3, 2, 64)):   # shape 8's call; the model's head_dim-64 call
        spec = jax.ShapeDtypeStruct(shape, jnp.float16)
        text = jax.jit(lambda a: fm.flash_attention_mgpu_fused_qkv(a, causal=True)).trace(spec).lower(
            lowering_platforms=("cuda",)).as_text()
        assert _custom_calls(text) == ["mosaic_gpu_v2"]
        assert "stablehlo.slice" not in text and "stablehlo.pad" not in text
    with pytest.raises(ValueError, match="3, num_heads"):
        fm.flash_attention_mgpu_fused_qkv(jnp.zeros((1, 8, 2, 1, 64), jnp.float16), causal=True)


def test_interpret_argument_is_checked():
    with pytest.raises(ValueError, match="interpret="):
        _lower_for_cuda(64, 64, True, interpret="yes")


# --- 2. Pure-Python pieces ----------------------------------------------------------------------------

def test_padded_seq_len():
    assert [fm.padded_seq_len(s) for s in (1, 7, 8, 9, 100, 1000, 1001, 100_000)] == \
        [1, 7, 8, 16, 104, 1000, 1008, 100_000]


@pytest.mark.parametrize("block_kv", [64, 128, 192, 256])
def test_kv_block_range_matches_explicit_masks(block_kv):
    rows = config.ROWS_PER_CONSUMER
    for seq_len in range(1, 600, 7):
        num_kv_blocks = -(-seq_len // block_kv)
        for row_start in range(0, seq_len, rows):
            real_rows = np.arange(row_start, min(row_start + rows, seq_len))
            num_unmasked, num_visited = kern.kv_block_range(row_start, rows, seq_len, block_kv, causal=True)
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
            full_unmasked, full_visited = kern.kv_block_range(row_start, rows, seq_len, block_kv, causal=False)
            assert (full_unmasked, full_visited) == (seq_len // block_kv, num_kv_blocks)


@pytest.mark.parametrize("seq_len, head_dim", [(1, 64), (113, 64), (1000, 64), (1200, 64), (2000, 128),
                                               (100000, 64), (16384, 128), (777, 256)])
@pytest.mark.parametrize("causal", [True, False])
def test_multicast_pairs_cover_every_tile_once_and_share_what_both_need(seq_len, head_dim, causal):
    blocks = dataclasses.replace(config.default_block_sizes(head_dim, seq_len), kv_multicast=True)
    num_q_tiles = -(-seq_len // blocks.block_q)
    tiles = []
    for pair in range(-(-num_q_tiles // 2)):
        plans = [kern.multicast_pair(pair, member, num_q_tiles, seq_len, blocks, causal) for member in (0, 1)]
        assert plans[0][0], "the first member of every pair has a tile"
        assert plans[0][2] == plans[1][2], "both members agree on the shared blocks"
        shared = plans[0][2]
        for valid, tile, _ in plans:
            if not valid:
                continue
            tiles.append(tile)
            _, needed = kern.kv_block_range(tile * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv, causal)
            assert shared <= needed   # a member loads exactly [0, needed): shared ones together, the rest alone
        if plans[1][0]:   # a full pair shares all of its second member's blocks
            _, second = kern.kv_block_range(plans[1][1] * blocks.block_q, blocks.block_q, seq_len, blocks.block_kv,
                                          causal)
            assert shared == second
            assert abs(plans[0][1] - plans[1][1]) == 1   # neighbouring tiles: the same keys, give or take
        else:
            assert shared == 0
    assert sorted(tiles) == list(range(num_q_tiles))
    if causal:   # heaviest first, as without clusters
        assert tiles[0] == num_q_tiles - 1


def test_block_sizes_validate_themselves():
    for bad in (dict(block_kv=100, num_stages=2), dict(block_kv=32, num_stages=2),
                dict(block_kv=320, num_stages=2), dict(block_kv=128, num_stages=1),
                dict(block_kv=True, num_stages=2), dict(block_kv=128, num_stages=2, num_compute_wgs=4),
                dict(block_kv=128, num_stages=2, overlap_softmax=1), dict(block_kv=128, num_stages=2, pingpong=0),
                dict(block_kv=128, num_stages=2, kv_multicast=1), dict(block_kv=128, num_stages=2, warp_producer=1)):
        with pytest.raises(ValueError):
            Blocks(**bad)
    assert Blocks(block_kv=128, num_stages=2, num_compute_wgs=3).block_q == 192


@pytest.mark.parametrize("head_dim", config.SUPPORTED_HEAD_DIMS)
def test_defaults_fit_and_oversized_blocks_are_refused(head_dim):
    for seq_len in (None, 1 << 20):
        blocks = config.default_block_sizes(head_dim, seq_len)
        config.check_block_sizes(head_dim, 2, blocks)
        assert config.smem_bytes(head_dim, 2, blocks) <= config.SMEM_BUDGET_BYTES
    too_deep = Blocks(block_kv=blocks.block_kv, num_stages=64)
    with pytest.raises(ValueError, match="shared memory"):
        config.check_block_sizes(head_dim, 2, too_deep)


def test_register_bound_tilings_are_refused():
    with pytest.raises(ValueError, match="head_dim=256 must be 64"):
        config.check_block_sizes(256, 2, Blocks(block_kv=64, num_stages=2, overlap_softmax=True))
    with pytest.raises(ValueError, match="block_kv=256 <= 128"):
        config.check_block_sizes(64, 2, Blocks(block_kv=256, num_stages=2, overlap_softmax=True))
    with pytest.raises(ValueError, match="head_dim=128 must be 64"):   # 128 overlaps with two consumers only
        config.check_block_sizes(128, 2, Blocks(block_kv=128, num_stages=2, num_compute_wgs=3, overlap_softmax=True))
    config.check_block_sizes(128, 2, Blocks(128, 2, 2, overlap_softmax=True))
    config.check_block_sizes(64, 2, Blocks(128, 4, 3, overlap_softmax=True))
    with pytest.raises(ValueError, match="head_dim=256 must be <= 128"):
        config.check_block_sizes(256, 2, Blocks(block_kv=64, num_stages=2, num_compute_wgs=3))
    with pytest.raises(ValueError, match="wrong outputs on the H200"):
        config.check_block_sizes(64, 2, Blocks(256, 2, 3))


def test_long_sequences_at_head_dim_128_default_to_the_softmax_overlap():
    long_blocks = config.default_block_sizes(128, 4096, kv_multicast=False)
    assert long_blocks == Blocks(128, 2, 2, overlap_softmax=True)
    assert config.default_block_sizes(128, 4095) == config.default_block_sizes(128) == Blocks(128, 2, 2)
    # at head_dim 64 the long default is the short one, plus K/V multicast (below)
    assert dataclasses.replace(config.default_block_sizes(64, 100_000), kv_multicast=False,
                               pingpong=True) == config.default_block_sizes(64)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_kv_multicast_is_the_default_from_its_measured_lengths(head_dim):
    threshold = config.MULTICAST_MIN_SEQ_LEN.get(head_dim)
    assert not config.default_block_sizes(head_dim).kv_multicast
    if threshold is None:
        assert not config.default_block_sizes(head_dim, 1 << 20).kv_multicast
        return
    assert not config.default_block_sizes(head_dim, threshold - 1).kv_multicast
    blocks = config.default_block_sizes(head_dim, threshold)
    assert blocks.kv_multicast
    # with it, head_dim 64 also drops the ping-pong token ring
    assert blocks.pingpong == (head_dim not in config.MULTICAST_WITHOUT_PINGPONG)
    assert config.default_block_sizes(head_dim, threshold - 1).pingpong
    tiling = config.default_block_sizes(head_dim, threshold, kv_multicast=False)
    assert dataclasses.replace(blocks, kv_multicast=False, pingpong=True) == tiling
    assert config.with_kv_multicast(tiling, head_dim) == blocks
    # a call without block sizes runs it on the GPU, and without clusters when interpreted
    assert not config.launch_block_sizes(threshold, head_dim, 2, None, interpret=True).kv_multicast
    assert config.launch_block_sizes(threshold, head_dim, 2, None, interpret=False).kv_multicast


def test_interpret_mode_runs_the_default_tiling_with_two_consumers():
    # three consumer warpgroups can hang jax's interpreter: a default tiling of three runs there with two
    for head_dim in (32, 64):
        assert config.launch_block_sizes(1000, head_dim, 2, None, interpret=False).num_compute_wgs == 3
        assert config.launch_block_sizes(1000, head_dim, 2, None, interpret=True).num_compute_wgs == 2
        assert config.launch_block_sizes(1000, head_dim, 2, None, interpret="detect_races").num_compute_wgs == 2
    asked = Blocks(128, 2, 3)
    assert config.launch_block_sizes(1000, 64, 2, asked, interpret=True).num_compute_wgs == 3   # asked for: kept


def test_stages_are_clamped_to_the_sequence():
    blocks = Blocks(block_kv=128, num_stages=6)
    assert config.resolve_block_sizes(100_000, 64, 2, blocks).num_stages == 6
    assert config.resolve_block_sizes(300, 64, 2, blocks).num_stages == 3
    assert config.resolve_block_sizes(5, 64, 2, blocks).num_stages == 2


def test_attention_flops():
    # The causal count: 2 * B * H * S^2 * hd.
    assert fm.attention_flops(1, 100_000, 16, 64, causal=True) == 2 * 16 * 100_000**2 * 64
    assert fm.attention_flops(2, 10, 3, 64, causal=False) == 4 * 2 * 3 * 100 * 64


@pytest.mark.parametrize("bad,match", [
    (dict(dtype=jnp.float32), "float16 or bfloat16"),
    (dict(head_dim=16), "head_dim=16"),
    (dict(head_dim=96), "head_dim=96"),
    (dict(k_len=9), "must match"),
    (dict(causal=1), "causal=1"),
    (dict(sm_scale="0.1"), "sm_scale"),
    (dict(block_sizes=(128, 2)), "block_sizes"),
    (dict(lowering_semantics="thread"), "lowering_semantics"),
    (dict(return_lse=1), "return_lse"),
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
    blocks = config.resolve_block_sizes(seq_len, head_dim, q.dtype.itemsize, blocks)
    rows, block_kv = config.ROWS_PER_CONSUMER, blocks.block_kv
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
            plan = kern.consumer_plan(tile * blocks.block_q, wg, seq_len, blocks, causal)
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
    Blocks(block_kv=128, num_stages=2),
    Blocks(block_kv=64, num_stages=3, num_compute_wgs=3),
    Blocks(block_kv=128, num_stages=2, overlap_softmax=True),
    Blocks(block_kv=192, num_stages=2),
    Blocks(block_kv=256, num_stages=2),
])
@pytest.mark.parametrize("seq_len", [1, 129, 453])
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


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_len", [1, 129, 453, 1000])
def test_loop_segments_cover_the_main_loop_in_order(seq_len, causal):
    """Every consumer plan of every tile, with every clean-block bound 0..num_blocks + 1: the segments run
    blocks 1..num_visited - 1 once each, in order, masked exactly from first_masked on, and with the
    key mask's bias exactly from max(clean, 1) on; without bounds, the bias everywhere."""
    blocks = Blocks(block_kv=128, num_stages=2)
    num_blocks = -(-seq_len // 128)
    for tile, wg in itertools.product(range(-(-seq_len // blocks.block_q)), range(blocks.num_compute_wgs)):
        plan = kern.consumer_plan(tile * blocks.block_q, wg, seq_len, blocks, causal)
        for clean in [None, *range(num_blocks + 2)]:
            segments = kern.loop_segments(plan, None if clean is None else jnp.int32(clean))
            steps = [(block, masked, key_bias) for lower, upper, masked, key_bias in segments
                     for block in range(int(lower), int(upper))]
            visited = int(plan.num_visited)
            assert [block for block, _, _ in steps] == list(range(1, visited)), (tile, wg, clean)
            first_bias = 1 if clean is None else max(clean, 1)
            assert all(masked == (block >= int(plan.first_masked)) for block, masked, _ in steps)
            assert all(key_bias == (block >= first_bias) for block, _, key_bias in steps), (tile, wg, clean)


def test_clean_block_bounds():
    mask = np.ones((5, 300), bool)
    mask[1, 299] = False   # in the last, partial block
    mask[2, 130] = False   # block 1 of 128-key blocks
    mask[3] = False
    mask[4, 250:] = False  # a padding mask: blocks 0 and 1 clean
    bounds = np.asarray(fm.clean_block_bounds(jnp.asarray(mask), 128))
    assert bounds.shape == (5, kern.BOUNDS_ROW) and bounds.dtype == np.int32
    np.testing.assert_array_equal(bounds[:, 0], [3, 2, 1, 0, 1])   # keys past S count as valid
    assert not bounds[:, 1:].any()
    np.testing.assert_array_equal(np.asarray(fm.clean_block_bounds(jnp.asarray(mask), 64))[:, 0], [5, 4, 2, 0, 3])


# --- 4. The dispatch rule of `flash_attention`, and the kernel inside a batch split ----------------------

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


def test_dispatch_rule_on_hopper(hopper, monkeypatch):
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
    assert not rule(masked=True)                               # no kv_lengths in the Hopper kernel
    # a key mask: the key-masked build, from the same lengths; forced only where KEY_MASK_DISPATCH is off
    assert rule(key_mask=True) and not rule(key_mask=True, s=fm.MIN_SEQ_LEN - 1) and not rule(key_mask=True, masked=True)
    monkeypatch.setattr(fa, "KEY_MASK_DISPATCH", False)
    assert not rule(key_mask=True) and rule(key_mask=True, implementation="mosaic")
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


@pytest.mark.slow
def test_kernel_inside_a_batch_split_is_the_single_device_kernel():
    # Regression: the grid's axis names once included "batch", which inside parallel.py's shard_map
    # (mesh axis "batch") changed the lowered kernel; on two H200s the split output was wrong. Under the
    # warpgroup lowering the kernel inside the split is byte for byte the one-device kernel; under the
    # lane lowering (head_dim 64's default) it takes one extra argument it never reads, nothing else differs.
    from conftest import last_json_line, run_on_host_devices
    result = last_json_line(run_on_host_devices(["-c", SHARD_SCRIPT], 2))
    assert result["warpgroup"] == {"identical": True, "same_but_unused_argument": True}
    assert result["lane"]["same_but_unused_argument"] is True
