"""The Pallas flash-attention kernel in interpret mode on the CPU, against its plain-jnp reference.

The GPU (Triton-lowered) path of this same kernel is checked on the H200 by
`bench/bench_attention.py --check`, not in CI.

Every comparison is against `flash_attention_reference` run on the inputs upcast to fp32, with
precision=HIGHEST. Tolerances are absolute and scale with max|v| (every output is a convex combination of
rows of v, so max|v| bounds the output and its error), in units of the dot operands' unit roundoff u:
- fp16 inputs (u = 2**-11): q, k, v reach the reference exactly. The kernel rounds the probabilities to
  fp16 before the p @ v dot (an error <= u * max|v|, the weights summing to 1) and rounds the output to
  fp16 (<= u * max|v|): bound 2u. Measured worst over S, head_dim, masks and causal: 0.75u.
- fp32 inputs: the kernel rounds q, k, v to fp16 for the dots (module docstring). v's rounding and the
  probabilities' rounding give 2u as above; rounding q and k perturbs each score by about u * |score|,
  which moves the output by a similar fraction of max|v|; the output stays fp32. Tolerance 4u; measured 0.8u.
- bf16 inputs (u = 2**-8): as fp16, bound 2u; measured 0.74u.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttj_jax.kernels import BlockSizes, flash_attention, flash_attention_fused_qkv, flash_attention_reference
from ttj_jax.kernels.flash_attention import default_block_sizes, padded_head_dim, resolve_block_sizes, seq_len_bucket

# Tolerance in units of u * max|v|, and u itself, per input dtype (see the module docstring).
_TOLERANCE_UNITS = {jnp.float16: (2, 2.0 ** -11), jnp.float32: (4, 2.0 ** -11), jnp.bfloat16: (2, 2.0 ** -8)}
SMALL_BLOCKS = BlockSizes(block_q=16, block_k=16, num_warps=4, num_stages=2)
UNEVEN_BLOCKS = BlockSizes(block_q=32, block_k=16, num_warps=4, num_stages=2)
BATCH, HEADS = 2, 2


def _inputs(seed, seq_len, head_dim, dtype=jnp.float16, batch=BATCH, heads=HEADS):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((batch, seq_len, heads, head_dim)), dtype) for _ in range(3))


def _random_mask(seed, batch, seq_len, fully_masked_row=None):
    mask = np.random.default_rng(seed).random((batch, seq_len)) < 0.6
    if fully_masked_row is not None:
        mask[fully_masked_row] = False
    return jnp.asarray(mask)


def _check(q, k, v, *, causal, block_sizes=None, **masks):
    out = flash_attention(q, k, v, causal=causal, block_sizes=block_sizes, interpret=True, **masks)
    assert out.shape == q.shape and out.dtype == q.dtype
    out32 = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out32).all()
    ref = np.asarray(flash_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal, **masks))
    units, unit_roundoff = _TOLERANCE_UNITS[q.dtype.type]
    atol = units * unit_roundoff * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
    np.testing.assert_allclose(out32, ref, rtol=0, atol=atol)
    return out32


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len", [1, 7, 33, 127])
@pytest.mark.interpret
def test_odd_sequence_lengths(seq_len, causal):
    _check(*_inputs(seq_len, seq_len, 32), causal=causal)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 128, 256, 48])  # 8 and 48 take the head_dim padding
@pytest.mark.interpret
def test_every_head_dim(head_dim, causal):
    _check(*_inputs(head_dim, 33, head_dim), causal=causal)


@pytest.mark.parametrize("seq_len,head_dim,causal", [(7, 8, True), (33, 64, False), (127, 256, True), (127, 32, False)])
@pytest.mark.interpret
def test_float32_inputs(seq_len, head_dim, causal):
    _check(*_inputs(1, seq_len, head_dim, jnp.float32), causal=causal, block_sizes=SMALL_BLOCKS)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.interpret
def test_bfloat16_inputs(causal):
    _check(*_inputs(2, 33, 64, jnp.bfloat16), causal=causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_sizes", [SMALL_BLOCKS, UNEVEN_BLOCKS, BlockSizes(16, 64, 4, 2)],
                         ids=["16x16", "32x16", "16x64"])
@pytest.mark.interpret
def test_block_size_settings(block_sizes, causal):
    # S=127 with 16-wide blocks runs both key loops (unmasked, then diagonal/limit) for several blocks,
    # with block_q > block_k and block_q < block_k both exercised.
    _check(*_inputs(3, 127, 32), causal=causal, block_sizes=block_sizes)


@pytest.mark.interpret
def test_medium_sequence_default_blocks_for_head_dim_64():
    """S past the short-sequence cutoff picks the medium entry (128x64 blocks for head_dim 64; a causal
    call its own, 64x64), with a ragged tail and several query blocks on and off the causal diagonal,
    causal and with a key mask."""
    assert default_block_sizes(300, 64) == BlockSizes(block_q=128, block_k=64, num_warps=8, num_stages=3)
    assert default_block_sizes(300, 64, causal=True) == BlockSizes(64, 64, num_warps=4, num_stages=2)
    q, k, v = _inputs(11, 300, 64, batch=1, heads=1)
    _check(q, k, v, causal=True)
    mask = jnp.arange(300)[None, :] < 211
    _check(q, k, v, causal=True, key_mask=mask)
    _check(q, k, v, causal=False, key_mask=mask)


def test_default_blocks_by_length_bucket():
    """The table's buckets: S <= 256 short, <= 2048 medium, longer long; every padded head_dim has all
    three, and a tiny S clamps the blocks to the next power of two."""
    assert [seq_len_bucket(s) for s in (1, 256, 257, 2048, 2049, 100_000)] == [
        "short", "short", "medium", "medium", "long", "long"]
    for head_dim in (8, 32, 64, 100, 128, 256):
        for seq_len in (100, 1000, 10_000):
            assert isinstance(default_block_sizes(seq_len, head_dim), BlockSizes)
    assert default_block_sizes(16384, 64) == BlockSizes(block_q=128, block_k=128, num_warps=8, num_stages=3)
    tiny = resolve_block_sizes(20, 64, None)
    assert (tiny.block_q, tiny.block_k) == (32, 32)


def test_causal_entries_fall_back_to_the_shared_table():
    """A causal call takes its own entry only where the causal table has one (medium, head_dim 32 and
    64); elsewhere it runs the shared entry, and a non-causal call always does."""
    for head_dim in (8, 32, 64, 100, 128, 256):
        for seq_len in (100, 1000, 10_000):
            shared = default_block_sizes(seq_len, head_dim)
            causal = default_block_sizes(seq_len, head_dim, causal=True)
            own = seq_len_bucket(seq_len) == "medium" and padded_head_dim(head_dim) in (32, 64)
            assert (causal != shared) == own, (head_dim, seq_len)
    assert resolve_block_sizes(1000, 32, None, causal=True) == BlockSizes(64, 64, num_warps=4, num_stages=2)
    given = BlockSizes(128, 64, 4, 3)
    assert resolve_block_sizes(1000, 32, given, causal=True) == given   # given block sizes win


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_sizes", [None, SMALL_BLOCKS], ids=["default", "16x16"])
@pytest.mark.interpret
def test_kv_lengths(block_sizes, causal):
    q, k, v = _inputs(4, 127, 32)
    lengths = jnp.asarray([0, 50], jnp.int32)  # 0: no key at all -> zeros
    out = _check(q, k, v, causal=causal, kv_lengths=lengths, block_sizes=block_sizes)
    assert (out[0] == 0).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_sizes", [None, SMALL_BLOCKS], ids=["default", "16x16"])
@pytest.mark.interpret
def test_key_mask_with_a_fully_masked_row(block_sizes, causal):
    q, k, v = _inputs(5, 127, 32)
    mask = _random_mask(5, BATCH, 127, fully_masked_row=1)
    out = _check(q, k, v, causal=causal, key_mask=mask, block_sizes=block_sizes)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.interpret
def test_kv_lengths_and_key_mask_together(causal):
    q, k, v = _inputs(6, 33, 16)
    lengths = jnp.asarray([20, 33], jnp.int32)
    _check(q, k, v, causal=causal, kv_lengths=lengths, key_mask=_random_mask(6, BATCH, 33),
           block_sizes=SMALL_BLOCKS)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(seq_len=st.integers(1, 130), head_dim=st.sampled_from([8, 16, 24, 32, 64]), causal=st.booleans(),
       masks=st.sampled_from(["none", "lengths", "mask", "both"]), dtype=st.sampled_from([jnp.float16, jnp.float32]),
       block_sizes=st.sampled_from([None, SMALL_BLOCKS, UNEVEN_BLOCKS]), seed=st.integers(0, 2**16))
@pytest.mark.slow
@pytest.mark.interpret
def test_property_any_shape_and_masks(seq_len, head_dim, causal, masks, dtype, block_sizes, seed):
    q, k, v = _inputs(seed, seq_len, head_dim, dtype)
    kwargs = {}
    if masks in ("lengths", "both"):
        kwargs["kv_lengths"] = jnp.asarray(np.random.default_rng(seed).integers(0, seq_len + 1, BATCH), jnp.int32)
    if masks in ("mask", "both"):
        kwargs["key_mask"] = _random_mask(seed, BATCH, seq_len)
    _check(q, k, v, causal=causal, block_sizes=block_sizes, **kwargs)


@pytest.mark.interpret
def test_out_of_range_kv_lengths_are_clamped():
    q, k, v = _inputs(7, 33, 16)
    out = flash_attention(q, k, v, causal=False, kv_lengths=jnp.asarray([-3, 1000], jnp.int32), interpret=True)
    expected = flash_attention(q, k, v, causal=False, kv_lengths=jnp.asarray([0, 33], jnp.int32), interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.interpret
def test_custom_sm_scale():
    q, k, v = _inputs(8, 33, 32)
    out = flash_attention(q, k, v, causal=True, sm_scale=0.3, interpret=True)
    ref = flash_attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True, sm_scale=0.3)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref),
                               rtol=0, atol=2 * 2.0 ** -11 * float(jnp.max(jnp.abs(v))))


@pytest.mark.parametrize("seq_len,head_dim,causal,masked", [(33, 32, True, False), (127, 8, False, True),
                                                           (64, 64, True, True)])
@pytest.mark.interpret
def test_fused_qkv_matches_separate_layout(seq_len, head_dim, causal, masked):
    rng = np.random.default_rng(9)
    qkv = jnp.asarray(rng.standard_normal((BATCH, seq_len, 3, HEADS, head_dim)), jnp.float16)
    masks = {}
    if masked:
        masks = dict(kv_lengths=jnp.asarray([seq_len, seq_len // 3], jnp.int32),
                     key_mask=_random_mask(9, BATCH, seq_len))
    fused = flash_attention_fused_qkv(qkv, causal=causal, block_sizes=SMALL_BLOCKS, interpret=True, **masks)
    separate = flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal,
                               block_sizes=SMALL_BLOCKS, interpret=True, **masks)
    assert fused.shape == separate.shape == (BATCH, seq_len, HEADS, head_dim)
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(separate))  # same kernel, same data


@pytest.mark.interpret
def test_two_runs_are_bit_identical():
    q, k, v = _inputs(10, 127, 64, jnp.float32)
    mask = _random_mask(10, BATCH, 127)
    first = np.asarray(flash_attention(q, k, v, causal=True, key_mask=mask, interpret=True))
    second = np.asarray(flash_attention(q, k, v, causal=True, key_mask=mask, interpret=True))
    np.testing.assert_array_equal(first.view(np.uint32), second.view(np.uint32))


def test_default_block_table_covers_every_padded_head_dim():
    for head_dim in (8, 16, 32, 48, 64, 96, 128, 256):
        for seq_len in (1, 128, 1000, 100_000):
            assert isinstance(default_block_sizes(seq_len, head_dim), BlockSizes)
    assert {padded_head_dim(hd) for hd in range(8, 257)} == {16, 32, 64, 128, 256}


def test_blocks_are_clamped_for_a_tiny_sequence():
    blocks = resolve_block_sizes(7, 64, BlockSizes(128, 64, 4, 3))
    assert (blocks.block_q, blocks.block_k) == (16, 16)
    blocks = resolve_block_sizes(40, 64, BlockSizes(128, 32, 4, 3))
    assert (blocks.block_q, blocks.block_k) == (64, 32)


@pytest.mark.parametrize("field,value", [("block_q", 48), ("block_k", 8), ("num_warps", 3), ("num_stages", 0)])
def test_block_sizes_validate_themselves(field, value):
    kwargs = dict(block_q=64, block_k=64, num_warps=4, num_stages=2) | {field: value}
    with pytest.raises(ValueError, match=field):
        BlockSizes(**kwargs)


_Q = jnp.zeros((2, 5, 2, 16), jnp.float16)


@pytest.mark.parametrize("args,kwargs,name", [
    ((_Q[0], _Q[0], _Q[0]), {}, "q.shape"),                                          # rank 3
    ((_Q, _Q[:, :4], _Q), {}, "k.shape"),                                            # shapes differ
    ((_Q, _Q, _Q.astype(jnp.float32)), {}, "v.dtype"),                               # dtypes differ
    ((_Q.astype(jnp.int32),) * 3, {}, "q.dtype"),                                    # unsupported dtype
    ((jnp.zeros((2, 5, 2, 4), jnp.float16),) * 3, {}, "head_dim"),                   # head_dim < 8
    ((jnp.zeros((2, 5, 2, 512), jnp.float16),) * 3, {}, "head_dim"),                 # head_dim > 256
    ((_Q, _Q, _Q), {"kv_lengths": jnp.zeros((3,), jnp.int32)}, "kv_lengths"),       # wrong batch
    ((_Q, _Q, _Q), {"kv_lengths": jnp.zeros((2,), jnp.float32)}, "kv_lengths"),     # not integer
    ((_Q, _Q, _Q), {"key_mask": jnp.ones((2, 4), bool)}, "key_mask"),               # wrong length
    ((_Q, _Q, _Q), {"key_mask": jnp.ones((2, 5), jnp.int32)}, "key_mask"),          # not bool
    ((_Q, _Q, _Q), {"block_sizes": (64, 64)}, "block_sizes"),                        # not a BlockSizes
])
@pytest.mark.interpret
def test_bad_inputs_name_the_argument(args, kwargs, name):
    with pytest.raises(ValueError, match=name):
        flash_attention(*args, causal=True, interpret=True, **kwargs)


@pytest.mark.interpret
def test_bad_causal_and_fused_layout_name_the_argument():
    with pytest.raises(ValueError, match="causal"):
        flash_attention(_Q, _Q, _Q, causal=1, interpret=True)
    with pytest.raises(ValueError, match="qkv.shape"):
        flash_attention_fused_qkv(jnp.zeros((2, 5, 2, 2, 16), jnp.float16), causal=True, interpret=True)
    with pytest.raises(ValueError, match="key_mask"):
        flash_attention_fused_qkv(jnp.zeros((2, 5, 3, 2, 16), jnp.float16), causal=True,
                                  key_mask=jnp.ones((2, 6), bool), interpret=True)


def _lower_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("fused,causal,dtype,head_dim", [(False, True, jnp.float16, 64), (True, False, jnp.float32, 8),
                                                         (False, False, jnp.bfloat16, 256)])
def test_kernel_lowers_through_triton_for_cuda(fused, causal, dtype, head_dim):
    # Runs Pallas's Triton lowering (to Triton IR, no GPU needed) on the CPU: catches a primitive the
    # Triton backend cannot lower long before the H200 does. Compiling that IR to PTX still needs the GPU.
    try:
        _lower_for_cuda(lambda x: x + 1, jnp.zeros(4))
    except Exception as exc:  # noqa: BLE001 - this jaxlib cannot lower for CUDA at all
        pytest.skip(f"no CUDA lowering in this jaxlib: {exc}")
    seq_len = 100
    q = jax.ShapeDtypeStruct((2, seq_len, 2, head_dim), dtype)
    masks = dict(kv_lengths=jax.ShapeDtypeStruct((2,), jnp.int32), key_mask=jax.ShapeDtypeStruct((2, seq_len), bool))
    if fused:
        qkv = jax.ShapeDtypeStruct((2, seq_len, 3, 2, head_dim), dtype)
        text = _lower_for_cuda(lambda x, m: flash_attention_fused_qkv(x, causal=causal, **m), qkv, masks)
    else:
        text = _lower_for_cuda(lambda a, m: flash_attention(*a, causal=causal, **m), (q, q, q), masks)
    assert "triton" in text


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seq_len, block_sizes", [(37, None), (64, SMALL_BLOCKS), (50, UNEVEN_BLOCKS)])
@pytest.mark.slow
@pytest.mark.interpret
def test_log_sum_exp(causal, seq_len, block_sizes):
    """return_lse: each row's log(sum_j exp(sm_scale q.k_j)) over its allowed keys (what ring_attention
    merges visits with), -inf where no key is allowed; the output itself is unchanged."""
    q, k, v = _inputs(3, seq_len, 16)
    lengths = jnp.asarray([seq_len - 5, 0])                        # the second sequence: no key at all
    for masks in ({}, {"key_mask": _random_mask(4, BATCH, seq_len, fully_masked_row=1)}, {"kv_lengths": lengths}):
        out, lse = flash_attention(q, k, v, causal=causal, block_sizes=block_sizes, interpret=True,
                                   return_lse=True, **masks)
        plain = flash_attention(q, k, v, causal=causal, block_sizes=block_sizes, interpret=True, **masks)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
        scores = jnp.einsum("bqhd,bkhd->bhqk", *(x.astype(jnp.float32) for x in (q, k)),
                            precision="highest") * 16 ** -0.5
        allowed = jnp.tril(jnp.ones((seq_len, seq_len), bool)) if causal else jnp.ones((seq_len, seq_len), bool)
        allowed = allowed[None, None]
        if "key_mask" in masks:
            allowed = allowed & masks["key_mask"][:, None, None, :]
        if "kv_lengths" in masks:
            allowed = allowed & (jnp.arange(seq_len)[None, :] < lengths[:, None])[:, None, None, :]
        expected = np.asarray(jax.nn.logsumexp(jnp.where(allowed, scores, -jnp.inf), axis=-1))
        lse = np.asarray(lse)
        assert lse.shape == (BATCH, HEADS, seq_len) and lse.dtype == np.float32
        assert (np.isneginf(lse) == np.isneginf(expected)).all() and np.isneginf(lse[1]).any() == bool(masks)
        finite = np.isfinite(expected)
        np.testing.assert_allclose(lse[finite], expected[finite], rtol=0, atol=1e-4)


@pytest.mark.interpret
def test_log_sum_exp_argument_is_checked():
    q, k, v = _inputs(0, 16, 64)
    with pytest.raises(ValueError, match="return_lse"):
        flash_attention(q, k, v, causal=True, return_lse=1, interpret=True)


# UNPADDED_SEQUENCE: a sequence that is not a block multiple read in place, its overhanging blocks under
# masks. Interpret mode fills what overhangs an array with NaN, so an unmasked read or write shows up as a
# NaN or a wrong row here. The unpadded call must give exactly the padded call's output and log-sum-exp:
# the same kernel on the same values, only without the copies.
_RAGGED_CASES = [  # (S, head_dim, causal, masks, block_sizes)
    (77, 64, False, "key_mask", None),          # clip-text-like: 64-row blocks, 51 rows past S
    (77, 64, True, "none", None),
    (45, 32, True, "key_mask", UNEVEN_BLOCKS),  # q and k blocks of different sizes
    (33, 16, False, "kv_lengths", SMALL_BLOCKS),
    (200, 64, True, "both", None),              # several key blocks before the overhanging one
]


def _ragged_masks(kind: str, seq_len: int):
    masks = {}
    if kind in ("key_mask", "both"):
        masks["key_mask"] = _random_mask(3, BATCH, seq_len, fully_masked_row=None)
    if kind in ("kv_lengths", "both"):
        masks["kv_lengths"] = jnp.asarray([seq_len, max(seq_len // 2, 1)], jnp.int32)
    return masks


@pytest.fixture
def unpadded(monkeypatch):
    """Returns a function that sets UNPADDED_SEQUENCE (on by default; the tests compute the padded call
    with it off first). flash_attention is jitted and the switch is read while tracing, so jax's caches
    are cleared when it changes and again after the test: no trace made with it off is left for later
    tests."""
    module = importlib.import_module("ttj_jax.kernels.flash_attention")   # the package exports the function

    def turn(on: bool = True):
        monkeypatch.setattr(module, "UNPADDED_SEQUENCE", on)
        jax.clear_caches()
    yield turn
    jax.clear_caches()


@pytest.mark.parametrize("seq_len,head_dim,causal,kind,block_sizes", _RAGGED_CASES)
@pytest.mark.interpret
def test_an_unpadded_sequence_gives_the_padded_calls_output(unpadded, seq_len, head_dim, causal, kind, block_sizes):
    q, k, v = _inputs(11, seq_len, head_dim)
    masks = _ragged_masks(kind, seq_len)
    unpadded(False)
    padded = flash_attention(q, k, v, causal=causal, block_sizes=block_sizes, interpret=True, return_lse=True,
                             **masks)
    unpadded()
    out, lse = flash_attention(q, k, v, causal=causal, block_sizes=block_sizes, interpret=True, return_lse=True,
                               **masks)
    _check(q, k, v, causal=causal, block_sizes=block_sizes, **masks)
    assert out.shape == q.shape and lse.shape == (BATCH, HEADS, seq_len)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(padded[0]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(padded[1]))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.interpret
def test_an_unpadded_fused_sequence_reads_the_projection_in_place(unpadded, causal):
    """The fused layout's unpadded call: no pad, no slice in its program, and the padded call's output."""
    seq_len = 77
    q, k, v = _inputs(5, seq_len, 64)
    qkv = jnp.stack([q, k, v], axis=2)
    mask = _random_mask(4, BATCH, seq_len)
    unpadded(False)
    padded = flash_attention_fused_qkv(qkv, causal=causal, key_mask=mask, interpret=True)
    unpadded()
    call = lambda x, m: flash_attention_fused_qkv(x, causal=causal, key_mask=m, interpret=True)  # noqa: E731
    text = str(jax.make_jaxpr(call)(qkv, mask))
    assert " pad[" not in text and "slice[" not in text, "the unpadded call still copies around the kernel"
    np.testing.assert_array_equal(np.asarray(call(qkv, mask)), np.asarray(padded))
