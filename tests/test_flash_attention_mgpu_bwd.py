"""CPU checks of the Hopper attention backward (ttj_jax/kernels/flash_attention_mgpu_bwd.py): the kernel body
in jax's Mosaic GPU interpret mode against jax.vjp of the fp32 reference, the race detector, lowering for
CUDA (the TMA reduce-add of dQ, which the interpreter lacks, is lowered there), the schedule's pieces and
argument checks. On the GPU: `python3 -m bench.bench_attention_bwd --variants default,mgpu-s2,mgpu-s3`."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ttj_jax.kernels import flash_attention_mgpu_bwd as fb
from ttj_jax.kernels.attention_common import attention_reference

# (batch, seq_len, heads, head_dim, causal, config): one KV tile (consumer 1 skips the tile's first query
# block); padding to whole tiles with several tiles, causal and not (keys past S masked); head_dim 128; a
# 3-slot ring over 8 query blocks; 128-query blocks with dQ split by rows, causal and not.
Config = fb.MgpuBwdConfig
CASES = {
    "hd64-S128-causal": (1, 128, 1, 64, True, Config()),
    "hd64-S300-B2-causal": (2, 300, 1, 64, True, Config()),
    "hd64-S300-B2-full": (2, 300, 1, 64, False, Config()),
    "hd128-S200-causal": (1, 200, 2, 128, True, Config()),
    "hd128-S256-full": (1, 256, 1, 128, False, Config()),
    "hd64-S512-causal-3stages": (1, 512, 1, 64, True, Config(num_stages=3)),
    "hd64-S300-B2-causal-q128": (2, 300, 1, 64, True, Config(block_q=128, overlap=True)),
    "hd64-S300-full-q128": (1, 300, 1, 64, False, Config(block_q=128)),
    "hd64-S300-B2-causal-q128-unsplit": (2, 300, 1, 64, True, Config(block_q=128, dq_split=False, dq_buffers=2)),
}


def _case_inputs(batch, seq_len, heads, head_dim, causal, seed=0, key_mask=None):
    """Random fp16 q, k, v, dO, the fp32 reference's o and log-sum-exp (-inf on a row with no allowed key,
    which the reference gives zero output and zero gradient), and its gradients; key_mask bool [B, S] or
    None."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (jnp.asarray(rng.standard_normal((batch, seq_len, heads, head_dim)).astype(np.float16))
                   for _ in range(4))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    o, pull = jax.vjp(lambda a, b, c: attention_reference(a, b, c, causal=causal, key_mask=key_mask), *f32)
    scores = jnp.einsum("bqhd,bkhd->bhqk", f32[0], f32[1], precision="highest") * head_dim ** -0.5
    allowed = jnp.ones((batch, 1, seq_len, seq_len), bool)
    if key_mask is not None:
        allowed &= key_mask[:, None, None, :]
    if causal:
        allowed &= jnp.tril(jnp.ones((seq_len, seq_len), bool))
    lse = jax.nn.logsumexp(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    return (q, k, v, o.astype(jnp.float16), lse, do), pull(do.astype(jnp.float32))


def _rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_in_gpu_interpret_mode(case):
    batch, seq_len, heads, head_dim, causal, config = CASES[case]
    inputs, want = _case_inputs(batch, seq_len, heads, head_dim, causal)
    got = fb.flash_attention_mgpu_bwd(*inputs, causal=causal, interpret=True, config=config)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == jnp.float16, name
        # fp16 operands and outputs: measured 3e-4 here; the bar for gradients is 1e-2
        assert _rel_l2(a, b) < 2e-3, (name, _rel_l2(a, b))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=5e-3, rtol=2e-2, err_msg=name)


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("causal, config", [(True, Config(block_q=128)), (False, Config())])
def test_key_mask_in_gpu_interpret_mode(causal, config):
    """A key mask: sequence 0 pads its last 100 keys, sequence 1 has holes and its first 10 keys masked
    (causal: its first 10 rows see no key). Masked keys get exactly zero dk and dv, rows with no allowed
    key exactly zero dq, the rest matches the reference's gradients."""
    seq_len = 300
    positions = np.arange(seq_len)
    key_mask = jnp.asarray(np.stack([positions < 200, (positions >= 10) & (positions % 7 != 3)]))
    inputs, want = _case_inputs(2, seq_len, 1, 64, causal, seed=5, key_mask=key_mask)
    got = fb.flash_attention_mgpu_bwd(*inputs, causal=causal, key_mask=key_mask, interpret=True, config=config)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and np.isfinite(np.asarray(a, np.float32)).all(), name
        assert _rel_l2(a, b) < 2e-3, (name, _rel_l2(a, b))
    dq, dk, dv = (np.asarray(g, np.float32) for g in got)
    masked = ~np.asarray(key_mask)
    assert not dk[masked].any() and not dv[masked].any()
    if causal:
        assert not dq[1, :10].any()


@pytest.mark.slow
@pytest.mark.interpret
def test_options_change_no_bit():
    """The overlapped GEMMs, the double-buffered dQ copies, the ring's depth and the register split
    reorder waits, not arithmetic (128-query blocks change the GEMMs' shapes, so only among themselves)."""
    inputs, _ = _case_inputs(1, 300, 1, 64, True, seed=3)
    for family in ((Config(), Config(num_stages=3, overlap=True, dq_buffers=2)),
                   (Config(block_q=128), Config(block_q=128, overlap_grads=True, registers=240, eager_ds=True))):
        runs = [fb.flash_attention_mgpu_bwd(*inputs, causal=True, interpret=True, config=config)
                for config in family]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("config", [Config(), Config(overlap=True, dq_buffers=2), Config(block_q=128, overlap=True),
                                    Config(block_q=128, eager_ds=True)])
def test_no_races_in_gpu_interpret_mode(config):
    """The race detector on each build. It does not see a wgmma's reads of shared memory: with the
    128-query build's last barrier removed (a consumer then writes dK over its K while the other's last
    dQ GEMM may still read it) this passes, and only the gradients came out wrong, in some runs."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    inputs, _ = _case_inputs(1, 300, 1, 64, True)
    fb.flash_attention_mgpu_bwd(*inputs, causal=True, interpret="detect_races", config=config)
    assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("seq_len, head_dim, causal, config", [
    (4096, 64, True, None), (1000, 64, False, None), (16384, 128, True, None),
    (4096, 64, True, fb.MgpuBwdConfig(overlap=True, dq_buffers=2)), (4096, 128, True, fb.MgpuBwdConfig(overlap=True)),
    (4096, 64, True, fb.MgpuBwdConfig(num_stages=3, overlap=True, dq_buffers=2)),
    (4096, 64, True, fb.MgpuBwdConfig(block_q=128)), (1000, 64, False, fb.MgpuBwdConfig(block_q=128, overlap=True)),
    (4096, 64, True, fb.MgpuBwdConfig(block_q=128, overlap_grads=True, registers=240)),
    (4096, 128, True, fb.MgpuBwdConfig(overlap_grads=True, registers=240)),
    (4096, 64, True, fb.MgpuBwdConfig(block_q=128, eager_ds=True)), (1000, 64, False, fb.MgpuBwdConfig(eager_ds=True)),
    (4096, 64, True, fb.MgpuBwdConfig(block_q=128, dq_split=False)),
    (1000, 64, False, fb.MgpuBwdConfig(block_q=128, dq_split=False, dq_buffers=2, eager_ds=True))])
def test_lowers_for_cuda_to_one_kernel(seq_len, head_dim, causal, config):
    """The GPU build (dQ added with TMA reduce-add copies into an accumulator the kernel takes as a Ref,
    dS^T read transposed as a wgmma operand), with each option, lowers for CUDA: Mosaic GPU's layout
    inference included."""
    x = jax.ShapeDtypeStruct((2, seq_len, 2, head_dim), jnp.float16)
    lse = jax.ShapeDtypeStruct((2, 2, seq_len), jnp.float32)
    fn = jax.jit(lambda q, k, v, o, l, do: fb.flash_attention_mgpu_bwd(q, k, v, o, l, do, causal=causal,
                                                                         config=config))
    text = fn.trace(x, x, x, x, lse, x).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo\.custom_call @(\w+)", text) == ["mosaic_gpu_v2"]


def test_key_mask_lowers_for_cuda_and_is_checked():
    x = jax.ShapeDtypeStruct((2, 1000, 2, 64), jnp.float16)
    lse = jax.ShapeDtypeStruct((2, 2, 1000), jnp.float32)
    mask = jax.ShapeDtypeStruct((2, 1000), jnp.bool_)
    for causal, config in ((True, Config(block_q=128)), (False, Config(overlap=True))):
        fn = jax.jit(lambda q, k, v, o, l, do, m: fb.flash_attention_mgpu_bwd(q, k, v, o, l, do, causal=causal,
                                                                              key_mask=m, config=config))
        text = fn.trace(x, x, x, x, lse, x, mask).lower(lowering_platforms=("cuda",)).as_text()
        assert re.findall(r"stablehlo\.custom_call @(\w+)", text) == ["mosaic_gpu_v2"]
    q = jnp.zeros((1, 128, 1, 64), jnp.float16)
    for bad in (jnp.ones((1, 127), bool), jnp.ones((1, 128), jnp.int32)):
        with pytest.raises(ValueError, match="key_mask"):
            fb.flash_attention_mgpu_bwd(q, q, q, q, jnp.zeros((1, 1, 128)), q, causal=True, key_mask=bad,
                                        interpret=True)


def test_configs_validate_and_fit_shared_memory():
    for bad in ({"num_stages": 1}, {"overlap": 1}, {"dq_buffers": 3}, {"block_q": 32}, {"overlap_grads": 1},
                {"eager_ds": 0}, {"dq_split": None}, {"registers": 256}):
        with pytest.raises(ValueError, match="MgpuBwdConfig"):
            fb.MgpuBwdConfig(**bad)
    assert fb.smem_bytes(64, 2, fb.MgpuBwdConfig(num_stages=4, dq_buffers=2)) <= fb.SMEM_BUDGET_BYTES
    # three warpgroups of 128 threads share the SM's 64K registers
    for registers in fb.CONSUMER_REGISTERS:
        config = fb.MgpuBwdConfig(registers=registers)
        assert 128 * (fb.NUM_CONSUMERS * registers + config.producer_registers) <= 65536
        assert config.producer_registers >= 24 and config.producer_registers % 8 == 0
    too_big = fb.MgpuBwdConfig(num_stages=3, dq_buffers=2)
    assert fb.smem_bytes(128, 2, too_big) > fb.SMEM_BUDGET_BYTES
    x = jnp.zeros((1, 128, 1, 128), jnp.float16)
    with pytest.raises(ValueError, match="shared memory"):
        fb.flash_attention_mgpu_bwd(x, x, x, x, jnp.zeros((1, 1, 128)), x, causal=True, interpret=True, config=too_big)
    with pytest.raises(ValueError, match="head_dim 64 only"):
        fb.flash_attention_mgpu_bwd(x, x, x, x, jnp.zeros((1, 1, 128)), x, causal=True, interpret=True,
                                    config=Config(block_q=128))


def test_schedule_pieces():
    assert fb.padded_len(1) == fb.BLOCK_KV and fb.padded_len(fb.BLOCK_KV) == fb.BLOCK_KV
    assert fb.padded_len(300) == 3 * fb.BLOCK_KV
    per_tile = fb.BLOCK_KV // fb.BLOCK_Q
    for tile in range(4):
        assert fb.first_query_block(tile, False) == 0 and fb.consumer_first_block(tile, 1, False) == 0
        # causal: the tile starts at its first key's block; each consumer at its own diagonal
        assert fb.first_query_block(tile, True) == tile * per_tile
        for wg, block_q in itertools.product(range(fb.NUM_CONSUMERS), (fb.BLOCK_Q, fb.BLOCK_KV)):
            first = fb.consumer_first_block(tile, wg, True, block_q)
            key = tile * fb.BLOCK_KV + wg * fb.KEYS_PER_CONSUMER
            assert first * block_q <= key < (first + 1) * block_q
            assert first >= fb.first_query_block(tile, True, block_q)
        assert fb.first_query_block(tile, True, fb.BLOCK_KV) == tile == fb.consumer_first_block(tile, 1, True, fb.BLOCK_KV)


@pytest.mark.parametrize("change, match", [
    ({"dtype": jnp.float32}, "float16 or bfloat16"),
    ({"head_dim": 32}, "head_dim"),
    ({"lse_shape": (1, 2, 100)}, "lse.shape"),
    ({"do_shape": (1, 64, 2, 64)}, "do"),
])
def test_bad_arguments_raise(change, match):
    dtype, head_dim = change.get("dtype", jnp.float16), change.get("head_dim", 64)
    x = jnp.zeros((1, 128, 2, head_dim), dtype)
    lse = jnp.zeros(change.get("lse_shape", (1, 2, 128)), jnp.float32)
    do = jnp.zeros(change.get("do_shape", x.shape), dtype)
    with pytest.raises(ValueError, match=match):
        fb.flash_attention_mgpu_bwd(x, x, x, x, lse, do, causal=True, interpret=True)


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("seq_len, causal, config", [(300, True, Config(block_q=128, eager_ds=True)),
                                                     (256, False, Config())])
def test_fused_entry_reads_and_writes_the_projection_layout(seq_len, causal, config):
    """flash_attention_mgpu_bwd_fused_qkv: q, k, v read from slots of one [B, S, 3, H, hd] array, dk and dv
    written into slots 1 and 2 of the result and dq into slot 0: bit for bit the three-array call's
    gradients stacked, with a key mask (S=300: padded to whole KV tiles, the result sliced back)."""
    positions = np.arange(seq_len)
    key_mask = jnp.asarray(np.stack([positions < 200, (positions >= 10) & (positions % 7 != 3)]))
    (q, k, v, o, lse, do), _ = _case_inputs(2, seq_len, 2, 64, causal, seed=3, key_mask=key_mask)
    split = fb.flash_attention_mgpu_bwd(q, k, v, o, lse, do, causal=causal, key_mask=key_mask, interpret=True,
                                        config=config)
    fused = fb.flash_attention_mgpu_bwd_fused_qkv(jnp.stack([q, k, v], axis=2), o, lse, do, causal=causal,
                                                  key_mask=key_mask, interpret=True, config=config)
    assert fused.shape == (2, seq_len, 3, 2, 64) and fused.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(jnp.stack(split, axis=2)))


@pytest.mark.parametrize("seq_len, causal, masked", [(4096, True, True), (512, False, True), (1000, False, False)])
def test_fused_entry_lowers_for_cuda_to_one_kernel(seq_len, causal, masked):
    """The fused entry's GPU build (TMA copies into and out of slots of 5-D arrays) lowers for CUDA to the
    one kernel; dq's rounding into slot 0 is XLA's."""
    qkv = jax.ShapeDtypeStruct((2, seq_len, 3, 2, 64), jnp.float16)
    x = jax.ShapeDtypeStruct((2, seq_len, 2, 64), jnp.float16)
    lse = jax.ShapeDtypeStruct((2, 2, seq_len), jnp.float32)
    mask = jax.ShapeDtypeStruct((2, seq_len), jnp.bool_)
    fn = jax.jit(lambda a, o, l, do, m: fb.flash_attention_mgpu_bwd_fused_qkv(
        a, o, l, do, causal=causal, key_mask=m if masked else None, config=Config(block_q=128, eager_ds=True)))
    traced = fn.trace(qkv, x, lse, x, mask)
    assert traced.out_info.shape == qkv.shape and traced.out_info.dtype == jnp.float16
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r"stablehlo\.custom_call @(\w+)", text) == ["mosaic_gpu_v2"]
    with pytest.raises(ValueError, match="qkv.shape"):
        fb.flash_attention_mgpu_bwd_fused_qkv(jnp.zeros((2, 128, 2, 64), jnp.float16), *(jnp.zeros(1),) * 3,
                                              causal=True)
