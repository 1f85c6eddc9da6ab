"""The Hopper attention kernel body in jax's Mosaic GPU interpret mode on the CPU, against the fp32
reference under the harness rule. The interpreter is slow (seconds per case), so the cases are the
smallest that reach each code path; the substitutes it needs are listed in
ttj_jax/kernels/flash_attention_mgpu_interpret.py."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ttj_jax.kernels import flash_attention_reference
from ttj_jax.kernels.flash_attention_mgpu_config import MgpuBlockSizes as Blocks
from ttj_jax.numerics import harness_check

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")   # the package exports a function of that name

pytestmark = [pytest.mark.interpret, pytest.mark.slow]

# (batch, seq_len, num_heads, head_dim, causal, blocks). Defaults with three consumers run with two here
# (launch_block_sizes): the interpreter can hang with three.
INTERPRET_CASES = {
    # one tile, one block: the prologue, the epilogue, the causal mask in block 0
    "hd128-S64-causal": (1, 64, 1, 128, True, None),
    # odd S (padding, the key < S mask), two sequences
    "hd128-S113-B2": (2, 113, 1, 128, False, None),
    # 3 query tiles x 5 KV blocks through a 3-slot ring: unmasked and masked loop steps, skipped blocks
    "hd64-S320-causal-3tiles-5blocks": (1, 320, 1, 64, True, Blocks(block_kv=64, num_stages=3)),
    # the softmax overlap (head_dim 128's long-sequence default), causal and with an odd S
    "hd64-S200-overlap-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, overlap_softmax=True)),
    "hd128-S113-overlap": (2, 113, 1, 128, False, Blocks(block_kv=64, num_stages=2, overlap_softmax=True)),
    # no token ring (head_dim 64's multicast default)
    "hd64-S200-no-pingpong-causal": (1, 200, 1, 64, True, Blocks(block_kv=64, num_stages=2, pingpong=False)),
    # head_dim 32: 64-byte rows, so 64-byte swizzle and wgmma K steps of 32
    "hd32-S113": (2, 113, 1, 32, False, Blocks(block_kv=128, num_stages=2)),
}


def _inputs(batch, seq_len, num_heads, head_dim, seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((batch, seq_len, num_heads, head_dim)).astype(np.float16))
                 for _ in range(3))


def _interpret_case(batch, seq_len, num_heads, head_dim, causal, blocks, interpret=True):
    q, k, v = _inputs(batch, seq_len, num_heads, head_dim, seq_len * head_dim)
    out = fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=blocks, interpret=interpret)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = np.asarray(flash_attention_reference(q, k, v, causal=causal).astype(jnp.float32))
    failed, worst, _ = harness_check(np.asarray(out.astype(jnp.float32)), ref)   # the harness rule
    assert int(failed) == 0, f"{int(failed)} elements fail, worst err/tol {float(worst):.2f}"


@pytest.mark.parametrize("case", sorted(INTERPRET_CASES))
def test_kernel_in_gpu_interpret_mode(case):
    _interpret_case(*INTERPRET_CASES[case])


def test_kernel_in_gpu_interpret_mode_has_no_races():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    _interpret_case(1, 64, 1, 128, True, None, interpret="detect_races")
    assert not gpu_callbacks.get_races().races_found


@pytest.mark.parametrize("batch, seq_len, causal", [(1, 113, False), (1, 136, True)])   # 1 and 2 query tiles
def test_log_sum_exp_in_gpu_interpret_mode(batch, seq_len, causal):
    # return_lse: each row's log(sum_j exp(sm_scale q.k_j)) from the kernel's base-2 running max and sum;
    # the output is the one without it, bit for bit.
    q, k, v = _inputs(batch, seq_len, 1, 128, seq_len)
    out, lse = fm.flash_attention_mgpu(q, k, v, causal=causal, interpret=True, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fm.flash_attention_mgpu(q, k, v, causal=causal,
                                                                                      interpret=True)))
    scores = jnp.einsum("bqhd,bkhd->bhqk", *(x.astype(jnp.float32) for x in (q, k)),
                        precision="highest") * 128 ** -0.5
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((seq_len, seq_len), bool)), scores, -jnp.inf)
    assert lse.shape == (batch, 1, seq_len) and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse), np.asarray(jax.nn.logsumexp(scores, axis=-1)), rtol=0, atol=1e-4)


@pytest.mark.parametrize("batch, seq_len, num_heads, head_dim, causal, blocks",
                         [(1, 113, 1, 128, True, None), (1, 70, 1, 32, False, Blocks(block_kv=64, num_stages=2))])
def test_fused_qkv_entry_reads_q_k_v_in_place(batch, seq_len, num_heads, head_dim, causal, blocks):
    # the same kernel with its TMA copies indexing slot 0/1/2 of one [B, S, 3, H, hd] array: equal to the
    # kernel on the three arrays sliced out, bit for bit
    rng = np.random.default_rng(seq_len + head_dim)
    qkv = jnp.asarray(rng.standard_normal((batch, seq_len, 3, num_heads, head_dim)).astype(np.float16))
    fused = fm.flash_attention_mgpu_fused_qkv(qkv, causal=causal, interpret=True, block_sizes=blocks)
    split = fm.flash_attention_mgpu(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, interpret=True,
                                    block_sizes=blocks)
    assert fused.shape == (batch, seq_len, num_heads, head_dim)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(split))


def test_fused_qkv_entry_returns_the_log_sum_exp_of_the_split_call():
    # return_lse through the fused entry (the training forward's): output and log-sum-exp equal to the
    # three-array call's, bit for bit, with a key mask
    rng = np.random.default_rng(7)
    qkv = jnp.asarray(rng.standard_normal((1, 136, 3, 2, 64)).astype(np.float16))
    mask = _key_mask(1, 136, 3)
    fused = fm.flash_attention_mgpu_fused_qkv(qkv, causal=True, interpret=True, key_mask=mask, return_lse=True)
    split = fm.flash_attention_mgpu(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, interpret=True,
                                    key_mask=mask, return_lse=True)
    assert fused[1].shape == (1, 2, 136) and fused[1].dtype == jnp.float32
    for a, b in zip(fused, split):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _masked_reference(q, k, v, mask, causal):
    """fp32 attention over the valid keys (and causal), zeros for a row with no allowed key."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", *(x.astype(jnp.float32) for x in (q, k)),
                        precision="highest") * q.shape[-1] ** -0.5
    allowed = mask[:, None, None, :]
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((q.shape[1],) * 2, bool))
    probs = jnp.where(allowed.any(-1, keepdims=True), jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), -1), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32), precision="highest"), allowed.any(-1)


# The key-masked build: (batch, seq_len, head_dim, causal, blocks). The mask has holes, sequence 0's first 7
# keys invalid (its first rows see no key under causal attention) and, with B = 2, sequence 1 all invalid.
KEY_MASK_CASES = {
    "hd128-S113-B2": (2, 113, 128, False, None),
    # 5 KV blocks through a 3-slot mask ring, the epilogue's skipped blocks waiting on the mask too
    "hd64-S320-causal-3tiles-5blocks": (1, 320, 64, True, Blocks(block_kv=64, num_stages=3)),
    "hd64-S200-overlap-causal": (1, 200, 64, True, Blocks(block_kv=64, num_stages=2, overlap_softmax=True)),
    "hd64-S200-no-pingpong-causal": (1, 200, 64, True, Blocks(block_kv=64, num_stages=2, pingpong=False)),
}


def _key_mask(batch, seq_len, seed):
    mask = np.random.default_rng(seed).random((batch, seq_len)) >= 0.3
    mask[0, :7] = False
    if batch > 1:
        mask[1] = False
    return jnp.asarray(mask)


@pytest.mark.parametrize("case", sorted(KEY_MASK_CASES))
def test_key_masked_build_in_gpu_interpret_mode(case):
    batch, seq_len, head_dim, causal, blocks = KEY_MASK_CASES[case]
    q, k, v = _inputs(batch, seq_len, 2, head_dim, seq_len)
    mask = _key_mask(batch, seq_len, seq_len)
    out, lse = fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=blocks, interpret=True, key_mask=mask,
                                       return_lse=True)
    ref, saw_a_key = _masked_reference(q, k, v, mask, causal)
    failed, worst, _ = harness_check(np.asarray(out.astype(jnp.float32)), np.asarray(ref))
    assert int(failed) == 0, f"{int(failed)} elements fail, worst err/tol {float(worst):.2f}"
    assert not bool(saw_a_key.all())                                   # rows with no valid key are in the case
    none = np.broadcast_to(~np.asarray(saw_a_key), lse.shape)          # [B, H, S]
    assert (np.asarray(out).transpose(0, 2, 1, 3)[none] == 0).all()    # zeros there, not a mean of v
    assert np.isneginf(np.asarray(lse)[none]).all()
    assert np.isfinite(np.asarray(lse)[~none]).all()
    # an all-True mask gives the mask-free build's output
    plain = fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=blocks, interpret=True)
    all_valid = fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=blocks, interpret=True,
                                        key_mask=jnp.ones((batch, seq_len), bool))
    np.testing.assert_array_equal(np.asarray(all_valid), np.asarray(plain))


def test_key_masked_fused_entry_equals_the_split_one():
    rng = np.random.default_rng(3)
    qkv = jnp.asarray(rng.standard_normal((2, 113, 3, 1, 128)).astype(np.float16))
    mask = _key_mask(2, 113, 5)
    fused = fm.flash_attention_mgpu_fused_qkv(qkv, causal=True, interpret=True, key_mask=mask)
    split = fm.flash_attention_mgpu(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, interpret=True,
                                    key_mask=mask)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(split))


def _mask_with_clean_blocks(batch, seq_len):
    """Sequence 0 valid but for one key past two thirds; sequence 1 a padding mask (its last 30% invalid):
    both with leading KV blocks holding no invalid key, which clean-block bounds skip the bias in."""
    mask = np.ones((batch, seq_len), bool)
    mask[0, (2 * seq_len) // 3] = False
    if batch > 1:
        mask[1, int(seq_len * 0.7):] = False
    return jnp.asarray(mask)


@pytest.mark.parametrize("case", sorted(KEY_MASK_CASES))
def test_clean_block_bounds_change_no_bit(case):
    """With clean-block bounds the bias (0 for a valid key) is left out where a block has no invalid key:
    an exact no-op, so the output and log-sum-exp equal the build without them to the bit; and against the
    reference with the holes mask."""
    batch, seq_len, head_dim, causal, blocks = KEY_MASK_CASES[case]
    q, k, v = _inputs(batch, seq_len, 2, head_dim, seq_len + 1)
    for mask in (_mask_with_clean_blocks(batch, seq_len), _key_mask(batch, seq_len, seq_len)):
        runs = [fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=blocks, interpret=True, key_mask=mask,
                                        return_lse=True, clean_blocks=clean) for clean in (False, True)]
        for without, with_bounds in zip(*runs):
            np.testing.assert_array_equal(np.asarray(with_bounds), np.asarray(without))
    ref, _ = _masked_reference(q, k, v, mask, causal)
    failed, worst, _ = harness_check(np.asarray(runs[1][0].astype(jnp.float32)), np.asarray(ref))
    assert int(failed) == 0, f"{int(failed)} elements fail, worst err/tol {float(worst):.2f}"


def test_key_masked_build_has_no_races():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    q, k, v = _inputs(1, 200, 1, 64, 9)
    for clean, mask in ((False, _key_mask(1, 200, 9)), (True, _mask_with_clean_blocks(1, 200))):
        fm.flash_attention_mgpu(q, k, v, causal=True, interpret="detect_races", key_mask=mask,
                                block_sizes=Blocks(block_kv=64, num_stages=2), clean_blocks=clean)
        assert not gpu_callbacks.get_races().races_found


def test_warp_producer_changes_nothing_in_interpret_mode():
    # no warps in jax's interpreter: the loads run as without it, so the output is the same to the bit
    q, k, v = _inputs(1, 64, 1, 64, 21)
    outs = [fm.flash_attention_mgpu(q, k, v, causal=True, interpret=True,
                                    block_sizes=Blocks(block_kv=64, num_stages=2, warp_producer=flag))
            for flag in (True, False)]
    assert bool(jnp.array_equal(outs[0], outs[1]))
