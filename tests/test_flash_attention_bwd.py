"""The flash attention backward kernels (kernels/flash_attention_bwd.py), interpreted on the CPU: dq, dk
and dv against jax.vjp of the fp32 reference attention, causal or not, padded lengths and head_dims, key
masks with a row that sees no key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ttj_jax.kernels.attention_common import attention_reference
from ttj_jax.kernels.flash_attention import flash_attention, flash_attention_fused_qkv
from ttj_jax.kernels.flash_attention_bwd import (
    DEFAULT_BLOCKS,
    BwdBlocks,
    default_bwd_blocks,
    flash_attention_bwd,
    flash_attention_bwd_fused_qkv,
    flash_attention_fused_vjp,
    flash_attention_vjp,
)

pytestmark = pytest.mark.interpret

# relative L2 per gradient (fp16 dot operands, fp32 accumulation)
MAX_REL_L2 = 1e-2


def _inputs(batch, seq_len, heads, head_dim, seed, dtype=jnp.float16):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v, do = (jax.random.normal(key, (batch, seq_len, heads, head_dim), jnp.float32) for key in keys)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), do


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _reference_grads(q, k, v, do, causal, key_mask):
    f = lambda a, b, c: attention_reference(a, b, c, causal=causal, key_mask=key_mask)   # noqa: E731
    _, pull = jax.vjp(f, *(x.astype(jnp.float32) for x in (q, k, v)))
    return pull(do)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 64, 2, 32), (1, 40, 3, 24), (2, 130, 1, 64)],
                         ids=["aligned", "padded-S-and-hd", "three-blocks"])
@pytest.mark.parametrize("masked", [False, True])
def test_gradients_match_the_reference(causal, shape, masked):
    q, k, v, do = _inputs(*shape, seed=sum(shape))
    key_mask = None
    if masked:
        rng = np.random.default_rng(0)
        mask = rng.random(shape[:2]) > 0.3
        mask[-1, 0] = False   # causal: query 0 of the last sequence sees no key
        mask[0, :] = mask[0, :] if causal else False   # non-causal: a sequence with no valid key at all
        key_mask = jnp.asarray(mask)
    o, lse = flash_attention(q, k, v, causal=causal, key_mask=key_mask, interpret=True, implementation="generic",
                             return_lse=True)
    dq, dk, dv = flash_attention_bwd(q, k, v, o, lse, do.astype(q.dtype), causal=causal, key_mask=key_mask,
                                     interpret=True)
    rq, rk, rv = _reference_grads(q, k, v, do.astype(q.dtype).astype(jnp.float32), causal, key_mask)
    for name, ours, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert np.isfinite(np.asarray(ours, np.float32)).all(), name
        assert _rel(ours, ref) <= MAX_REL_L2, (name, _rel(ours, ref))
    if key_mask is not None:   # masked keys: exactly zero dk and dv
        excluded = ~np.asarray(key_mask)
        assert not np.asarray(dk, np.float32)[excluded].any() and not np.asarray(dv, np.float32)[excluded].any()


def test_the_differentiable_attention_under_jax_grad():
    q, k, v, do = _inputs(2, 48, 2, 16, seed=3)
    loss = lambda a, b, c: jnp.sum(flash_attention_vjp(a, b, c, True, True).astype(jnp.float32) * do)   # noqa: E731
    ours = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    ref = _reference_grads(q, k, v, do, True, None)
    for got, want in zip(ours, ref):
        assert got.dtype == q.dtype and _rel(got, want) <= MAX_REL_L2


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 64, 2, 32), (1, 40, 3, 24)], ids=["aligned", "padded-S-and-hd"])
def test_the_fused_layout_gives_the_separate_layouts_gradients(causal, shape):
    """flash_attention_fused_vjp reads q, k and v in place from [B, S, 3, H, hd]: its output and dL/dqkv are
    those of flash_attention_vjp on the three slices, bit for bit, with a key mask too."""
    batch, seq_len, heads, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(seq_len), 2)
    qkv = jax.random.normal(keys[0], (batch, seq_len, 3, heads, head_dim), jnp.float32).astype(jnp.float16)
    do = jax.random.normal(keys[1], (batch, seq_len, heads, head_dim), jnp.float32)
    key_mask = jnp.asarray(np.random.default_rng(1).random((batch, seq_len)) > 0.3)
    fused = lambda t: flash_attention_fused_vjp(t, causal, True, key_mask)   # noqa: E731
    separate = lambda t: flash_attention_vjp(t[:, :, 0], t[:, :, 1], t[:, :, 2], causal, True, key_mask)  # noqa: E731
    results = []
    for attention in (fused, separate):
        out, pull = jax.vjp(attention, qkv)
        results.append((out, pull(do.astype(out.dtype))[0]))
    (out, dqkv), (want_out, want_dqkv) = results
    assert dqkv.shape == qkv.shape and dqkv.dtype == qkv.dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(dqkv), np.asarray(want_dqkv))
    assert np.abs(np.asarray(dqkv, np.float32)).sum() > 0


@pytest.mark.parametrize("blocks", [BwdBlocks(32, 64, 64, 32), BwdBlocks(64, 32, 32, 64), BwdBlocks(16, 16, 16, 16)],
                         ids=["dkdv-tall-keys", "dkdv-tall-queries", "small"])
@pytest.mark.parametrize("causal", [True, False])
def test_unequal_tiles_split_the_diagonal_correctly(blocks, causal):
    """The causal loops run masked tiles apart from fully visible ones; with query and key tiles of
    different sizes a tile straddling the diagonal must still be masked (and a visible one not)."""
    q, k, v, do = _inputs(1, 150, 2, 32, seed=11)
    o, lse = flash_attention(q, k, v, causal=causal, interpret=True, implementation="generic", return_lse=True)
    got = flash_attention_bwd(q, k, v, o, lse, do.astype(q.dtype), causal=causal, interpret=True, blocks=blocks)
    want = _reference_grads(q, k, v, do.astype(q.dtype).astype(jnp.float32), causal, None)
    for name, ours, ref in zip(("dq", "dk", "dv"), got, want):
        assert _rel(ours, ref) <= MAX_REL_L2, (name, _rel(ours, ref))


def test_head_dim_256_takes_its_own_tiles_and_matches_the_reference():
    """default_bwd_blocks: head_dim 256 (and widths padded to it) gets 32 x 32 tiles, every other width the
    shared default; the default call at head_dim 200 (padded to 256) runs those tiles, key-masked, causal,
    with a ragged S, and matches the fp32 reference."""
    assert default_bwd_blocks(256) == default_bwd_blocks(200) == BwdBlocks(32, 32, 32, 32, 4, 2)
    assert all(default_bwd_blocks(hd) == DEFAULT_BLOCKS for hd in (8, 16, 32, 64, 100, 128))
    q, k, v, do = _inputs(1, 70, 2, 200, seed=3)
    mask = jnp.arange(70)[None, :] < 61
    o, lse = flash_attention(q, k, v, causal=True, key_mask=mask, interpret=True, implementation="generic",
                             return_lse=True)
    got = flash_attention_bwd(q, k, v, o, lse, do.astype(q.dtype), causal=True, key_mask=mask, interpret=True)
    want = _reference_grads(q, k, v, do.astype(q.dtype).astype(jnp.float32), True, mask)
    for name, ours, ref in zip(("dq", "dk", "dv"), got, want):
        assert _rel(ours, ref) <= MAX_REL_L2, (name, _rel(ours, ref))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(2, 64, 2, 32), (1, 70, 3, 24)], ids=["aligned", "padded-S-and-hd"])
def test_the_gradient_written_in_place_is_the_stacked_one(causal, shape):
    """in_place (GRADIENT_IN_PLACE): the dk/dv kernel writes slots 1 and 2 of one [B, S, 3, H, hd] buffer
    and the dq kernel slot 0 of the same (aliased) buffer; the result is the stacked gradient exactly,
    key-masked or not, and the program has no stacking of three arrays."""
    batch, seq_len, heads, head_dim = shape
    keys = jax.random.split(jax.random.PRNGKey(seq_len), 2)
    qkv = jax.random.normal(keys[0], (batch, seq_len, 3, heads, head_dim), jnp.float32).astype(jnp.float16)
    do = jax.random.normal(keys[1], (batch, seq_len, heads, head_dim), jnp.float32).astype(jnp.float16)
    for key_mask in (None, jnp.arange(seq_len)[None, :] < seq_len - 9):
        key_mask = None if key_mask is None else jnp.broadcast_to(key_mask, (batch, seq_len))
        o, lse = flash_attention_fused_qkv(qkv, causal=causal, key_mask=key_mask, interpret=True,
                                           implementation="generic", return_lse=True)
        args = dict(causal=causal, key_mask=key_mask, interpret=True)
        stacked = flash_attention_bwd_fused_qkv(qkv, o, lse, do, in_place=False, **args)
        written = flash_attention_bwd_fused_qkv(qkv, o, lse, do, in_place=True, **args)
        assert written.shape == stacked.shape == qkv.shape and written.dtype == qkv.dtype
        np.testing.assert_array_equal(np.asarray(written, np.float32), np.asarray(stacked, np.float32))
    program = str(jax.make_jaxpr(lambda *a: flash_attention_bwd_fused_qkv(*a, causal=causal, interpret=True,
                                                                           in_place=True))(qkv, o, lse, do))
    assert program.count("pallas_call") == 2 and "input_output_aliases=((6, 0),)" in program
    assert "concatenate" not in program


def test_hopper_backward_dispatch_rule(monkeypatch):
    """flash_attention_vjp's backward takes the Hopper kernel only where mgpu_backward_applies: switched on,
    on sm_90, at its head_dims and lengths, fp16/bf16, not interpreted; the key mask is passed on."""
    from ttj_jax.kernels import flash_attention_bwd as fab
    x = lambda s, hd, dtype=jnp.float16: jnp.zeros((1, s, 1, hd), dtype)   # noqa: E731
    monkeypatch.setattr(fab, "on_hopper", lambda: True)
    monkeypatch.setattr(fab, "MGPU_BACKWARD_DISPATCH", True)
    assert fab.mgpu_backward_applies(x(4096, 64), interpret=False)
    assert not fab.mgpu_backward_applies(x(4096, 64), interpret=True)
    assert not fab.mgpu_backward_applies(x(4096, 128), interpret=False)
    assert not fab.mgpu_backward_applies(x(fab.MGPU_BACKWARD_MIN_SEQ_LEN - 1, 64), interpret=False)
    assert not fab.mgpu_backward_applies(x(4096, 64, jnp.float32), interpret=False)
    monkeypatch.setattr(fab, "on_hopper", lambda: False)
    assert not fab.mgpu_backward_applies(x(4096, 64), interpret=False)

    monkeypatch.setattr(fab, "on_hopper", lambda: True)
    calls = []

    def spy(q, k, v, o, lse, do, *, causal, key_mask, config, interpret=False):
        calls.append((causal, key_mask is not None, config))
        return q, k, v
    monkeypatch.setattr(fab, "flash_attention_mgpu_bwd", spy)
    q = x(4096, 64)
    residuals = (q, q, q, q, jnp.zeros((1, 1, 4096)), jnp.ones((1, 4096), bool))
    fab._vjp_bwd(True, False, residuals, q)
    assert calls == [(True, True, fab.MGPU_BACKWARD_CONFIG)]
    fab._vjp_bwd(False, False, residuals, q)
    assert calls[-1] == (False, True, fab.MGPU_BACKWARD_CONFIG)


@pytest.mark.slow
@pytest.mark.interpret
def test_hopper_backward_in_place_is_the_stacked_one(monkeypatch):
    """MGPU_BACKWARD_IN_PLACE: the fused layout's Hopper backward through jax.vjp of
    flash_attention_fused_vjp (the kernel in Mosaic GPU interpret mode) gives the stacked path's dL/dqkv
    exactly, key-masked, and its program slices and stacks nothing."""
    from ttj_jax.kernels import flash_attention_bwd as fab
    monkeypatch.setattr(fab, "mgpu_backward_applies", lambda q, interpret: True)
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    qkv = jax.random.normal(keys[0], (2, 256, 3, 2, 64), jnp.float32).astype(jnp.float16)
    do = jax.random.normal(keys[1], (2, 256, 2, 64), jnp.float32).astype(jnp.float16)
    mask = jnp.arange(256)[None, :] < jnp.array([[256], [200]])
    grads = {}
    for in_place in (False, True):
        monkeypatch.setattr(fab, "MGPU_BACKWARD_IN_PLACE", in_place)
        _, pull = jax.vjp(lambda a: fab.flash_attention_fused_vjp(a, True, True, mask), qkv)
        grads[in_place] = pull(do)[0]
        program = str(jax.make_jaxpr(pull)(do))
        stacks = "concatenate" in program or "= stack[" in program
        assert stacks != in_place
    assert grads[True].shape == qkv.shape and grads[True].dtype == qkv.dtype
    np.testing.assert_array_equal(np.asarray(grads[True], np.float32), np.asarray(grads[False], np.float32))


def test_the_training_forward_follows_the_hopper_backward_only_when_switched_on(monkeypatch):
    """VJP_FORWARD_WITH_HOPPER_BACKWARD: where the Hopper backward runs, the forward is forced onto the
    Hopper kernel; off, or with a forced implementation, the forward keeps VJP_FORWARD_IMPLEMENTATION."""
    import jax.numpy as jnp

    from ttj_jax.kernels import flash_attention_bwd as fab
    q = jnp.zeros((1, 512, 2, 64), jnp.float16)
    monkeypatch.setattr(fab, "mgpu_backward_applies", lambda q, interpret: not interpret)
    monkeypatch.setattr(fab, "VJP_FORWARD_IMPLEMENTATION", "auto")
    monkeypatch.setattr(fab, "VJP_FORWARD_WITH_HOPPER_BACKWARD", True)
    assert fab._vjp_forward_implementation(q, interpret=False) == "mosaic"
    assert fab._vjp_forward_implementation(q, interpret=True) == "auto"
    monkeypatch.setattr(fab, "VJP_FORWARD_IMPLEMENTATION", "generic")
    assert fab._vjp_forward_implementation(q, interpret=False) == "generic"
    monkeypatch.setattr(fab, "VJP_FORWARD_IMPLEMENTATION", "auto")
    monkeypatch.setattr(fab, "VJP_FORWARD_WITH_HOPPER_BACKWARD", False)
    assert fab._vjp_forward_implementation(q, interpret=False) == "auto"
