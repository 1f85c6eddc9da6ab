"""CPU checks of the Mosaic GPU whole-stack kernel's numerics (`ttj_jax/kernels/fused_stack_mgpu*.py`).

1. The ALGORITHM: `emulate` (NumPy: the kernel's tiling, warpgroup split, fp16 rounding points, fp32
   accumulation, per-block accumulation order, block-diagonal causal mask of packed sequences) against
   the fp32 reference `ttj_jax.reference` under the harness rule, and against `fused_stack_reference`
   (the Triton kernel's jnp model) to within fp16-rounding noise; plus checks that would catch a wrong
   mask, layout or packing (they make the comparison fail).
2. The kernel body in jax's Mosaic GPU interpret mode against `emulate` and the harness rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import baseline_and_params, random_input

import ttj_jax as T
from ttj_jax.kernels import fused_stack_mgpu as fsm
from ttj_jax.kernels import fused_stack_mgpu_kernel as fsm_kernel
from ttj_jax.kernels import fused_stack_mgpu_reference as fsm_reference
from ttj_jax.kernels.fused_stack import fused_stack_reference, stack_weights
from ttj_jax.kernels.pallas_common import erf

ATOL, RTOL = 0.002, 0.02   # the harness rule: |err| <= max(atol, rtol * |ref|)


# --- 1. The algorithm, emulated -----------------------------------------------------------------------

def _model(num_heads, seq_len, batch, causal=True, seed=0, num_layers=4, d_model=128):
    config = T.Config(batch, seq_len, d_model, num_heads, d_model, num_layers, causal)
    _, params = baseline_and_params(config, seed)
    x = jnp.asarray(random_input(config, seed + 1).numpy())
    return config, params, x


def _harness_failures(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    tolerance = np.maximum(ATOL, RTOL * np.abs(ref))
    ratio = np.where(np.isfinite(out) & np.isfinite(ref), np.abs(out - ref) / tolerance, np.inf)
    return int((ratio > 1).sum()), float(ratio.max())


EMULATION_CASES = {
    "shape2-B1-S128-H4": (4, 128, 1, True),
    "shape9-H1": (1, 128, 2, True),
    "shape12-S32-H4-B6-padded": (4, 32, 6, True),
    "S128-H4-noncausal": (4, 128, 1, False),
    "shape7-d32-H4": (4, 128, 2, True, 32),
    "d32-H2-S32-B4": (2, 32, 4, True, 32),
    "shape11-H16-S128-B2": (16, 128, 2, True),      # packed heads: 4 of 8 per block
    "H8-S128-B1": (8, 128, 1, True),                # 2 of 16 per block
    "H16-S32-B6-padded": (16, 32, 6, True),
    "H16-S128-noncausal": (16, 128, 1, False),
}


@pytest.mark.slow
@pytest.mark.parametrize("fast_erf", [False, True])
@pytest.mark.parametrize("case", sorted(EMULATION_CASES))
def test_emulation_meets_the_harness_rule(case, fast_erf):
    num_heads, seq_len, batch, causal, *d_model = EMULATION_CASES[case]
    config, params, x = _model(num_heads, seq_len, batch, causal, d_model=d_model[0] if d_model else 128)
    weights = fsm.stack_weights_mgpu(params, num_heads)
    out = fsm.emulate(weights, x, causal=causal, fast_erf=fast_erf)
    assert out.shape == x.shape and out.dtype == np.float32
    ref = T.reference(params, x, config=config)
    failed, worst = _harness_failures(out, ref)
    assert failed == 0, f"{case}: {failed} elements fail the harness rule, worst err/tol {worst:.2f}"
    # and the same numerics as the Triton kernel's jnp model, up to fp16-rounding flips
    fused = jax.jit(fused_stack_reference, static_argnames=("num_heads", "causal"))(
        stack_weights(T.prepare_weights(params, T.MIXED_FP16), num_heads=num_heads), x,
        num_heads=num_heads, causal=causal)
    assert np.max(np.abs(out - np.asarray(fused))) < 4 * 3e-4, case


def test_emulation_detects_a_wrong_mask_and_a_wrong_layout():
    # The comparison can fail: the same emulation with the causal mask dropped, or with the per-head
    # out-projection blocks in the wrong order, is far outside the harness rule.
    config, params, x = _model(4, 128, 1, True)
    weights = fsm.stack_weights_mgpu(params, 4)
    ref = np.asarray(T.reference(params, x, config=config))
    failed, _ = _harness_failures(fsm.emulate(weights, x, causal=False), ref)
    assert failed > 1000
    swapped = fsm.MgpuStackWeights(weights.mats.at[:, 3].set(weights.mats[:, 3, ::-1]), weights.vecs,
                                   num_heads=4)
    failed, _ = _harness_failures(fsm.emulate(swapped, x), ref)
    assert failed > 1000


@pytest.mark.parametrize("num_heads", [8, 16])
def test_emulation_of_packed_heads_detects_a_wrong_packing(num_heads, monkeypatch):
    """The packed emulation meets the harness rule (test_emulation_meets_the_harness_rule) and the
    comparison can fail: the same weights run as 4 heads of 32 (no q masking, no column select, scale
    32^-0.5), as heads of the wrong width (16 heads' weights as 8, or 8 heads' as 16: other sub-heads
    and scales), or with the right sub-heads but the score scale of head_dim 32, are far outside it."""
    config, params, x = _model(num_heads, 128, 1, True)
    weights = fsm.stack_weights_mgpu(params, num_heads)
    ref = np.asarray(T.reference(params, x, config=config))
    assert _harness_failures(fsm.emulate(weights, x), ref)[0] == 0
    other = 8 if num_heads == 16 else 16
    for wrong_heads in (4, other):
        wrong = fsm.MgpuStackWeights(weights.mats, weights.vecs, num_heads=wrong_heads)
        failed, _ = _harness_failures(fsm.emulate(wrong, x), ref)
        assert failed > 1000, wrong_heads
    hd = 128 // num_heads   # the scale is hd^-0.5 log2(e): make it 32^-0.5 log2(e)
    monkeypatch.setattr(fsm_reference, "LOG2_E", fsm_reference.LOG2_E * (hd / 32) ** 0.5)
    failed, _ = _harness_failures(fsm.emulate(weights, x), ref)
    assert failed > 1000


def test_packed_sequences_do_not_see_each_other():
    # S=32: 4 sequences share a tile; each output equals that sequence run alone (padded tile).
    config, params, x = _model(2, 32, 4, True, num_layers=1)
    weights = fsm.stack_weights_mgpu(params, 2)
    together = fsm.emulate(weights, x)
    alone = np.concatenate([fsm.emulate(weights, x[b:b + 1]) for b in range(4)])
    np.testing.assert_allclose(together, alone, rtol=0, atol=1e-6)


MASK_CASES = {   # (num_heads, seq_len, batch, causal[, d_model]): each key layout
    "S128-causal-split": (4, 128, 1, True),
    "S128-noncausal-all": (2, 128, 1, False),
    "S32-B6-own-padded": (2, 32, 6, True),
    "S64-noncausal-own": (1, 64, 2, False),
    "d32-S128-causal": (4, 128, 1, True, 32),
    "H16-S32-packed": (16, 32, 4, False),
}


@pytest.mark.parametrize("kind", ["all_true", "prefix", "random", "all_invalid"])
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_emulation_with_a_token_mask_meets_the_harness_rule(case, kind):
    """The masked build's algorithm (invalid keys' scores + MASKED_SCORE, invalid rows zeroed at the end)
    against the fp32 reference with the same mask: any mask, prefix or with holes, causal or not, a
    sequence with no valid token included (zeros, never NaN)."""
    from conftest import make_mask
    num_heads, seq_len, batch, causal, *d_model = MASK_CASES[case]
    config, params, x = _model(num_heads, seq_len, batch, causal, num_layers=2, d_model=d_model[0] if d_model else 128)
    mask = jnp.asarray(make_mask(kind, batch, seq_len, 3).numpy())
    x = jnp.where(mask[..., None], x, 0.0)
    weights = fsm.stack_weights_mgpu(params, num_heads)
    out = fsm.emulate(weights, x, mask, causal=causal)
    failed, worst = _harness_failures(out, T.reference(params, x, mask, config=config))
    assert failed == 0, f"{case}, {kind}: {failed} elements fail the harness rule, worst err/tol {worst:.2f}"
    assert np.isfinite(out).all() and (out[~np.asarray(mask)] == 0).all()
    if kind == "all_true":   # the mask-free algorithm's output, bit for bit
        assert np.array_equal(out, fsm.emulate(weights, x, causal=causal))


def test_emulation_with_a_token_mask_detects_a_key_left_in():
    """The comparison can fail: the keys left unmasked (the mask-free algorithm, rows zeroed after it) give
    a non-causal model with holes in its mask far outside the harness rule."""
    from conftest import make_mask
    config, params, x = _model(2, 128, 1, False, num_layers=2)
    mask = jnp.asarray(make_mask("random", 1, 128, 3).numpy())
    weights = fsm.stack_weights_mgpu(params, 2)
    keys_left_in = np.where(np.asarray(mask)[..., None], fsm.emulate(weights, x, causal=False), 0.0)
    failed, _ = _harness_failures(keys_left_in, T.reference(params, x, mask, config=config))
    assert failed > 1000


def test_numpy_erf_matches_the_kernels_erf():
    x = np.linspace(-6, 6, 10001, dtype=np.float32)
    np.testing.assert_allclose(fsm_reference.np_erf(x), np.asarray(erf(jnp.asarray(x))), rtol=0, atol=2e-7)


def test_fast_erf_is_the_erf():
    """The fast_erf build's 1 + erf (A&S 7.1.26): within 1.5e-6 of the exact erf over the range (its
    error bound 1.5e-7 plus fp32 rounding), odd-symmetric, and the NumPy model computes the same steps."""
    import math
    z = np.linspace(-9, 9, 40001, dtype=np.float32)
    exact = np.array([1.0 + math.erf(float(v)) for v in z])
    fast = np.asarray(fsm_kernel.one_plus_erf_fast(jnp.asarray(z)), np.float64)
    assert np.max(np.abs(fast - exact)) < 1.5e-6
    np.testing.assert_allclose(fsm_reference.np_one_plus_erf_fast(z), fast, rtol=0, atol=1.5e-6)   # fp32 ulps
    np.testing.assert_allclose(fast + fast[::-1], 2.0, rtol=0, atol=3e-6)   # 1+erf(z) + 1+erf(-z) = 2
    # and the GELU built from it, against the exact erf GELU
    pre = np.linspace(-10, 10, 2001, dtype=np.float32)
    gelu = np.asarray(fsm_kernel.gelu(jnp.asarray(pre), True), np.float64)
    exact_gelu = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in pre.astype(np.float64)])
    assert np.max(np.abs(gelu - exact_gelu)) < 1e-5


# --- 2. The kernel itself, in Mosaic GPU's interpret mode ---------------------------------------------

# Small cases: the interpreter is slow. At most 2 heads in process: 4-block builds (and d_model 32's
# 16-wide builds even at 2 heads) hang GPU interpret mode on a 2-core machine (CI's); those run in a
# 4-device subprocess below. The 2-head cases take the same code paths (split key blocks at S=128, own
# keys at S=32/64).
INTERPRET_CASES = {   # (num_heads, seq_len, batch, num_layers[, d_model])
    "S128-H2-B1-L2-races": (2, 128, 1, 2),
    "S32-H2-B6-L1-padded": (2, 32, 6, 1),
    "S64-H1-B2-L1": (1, 64, 2, 1),
}


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(INTERPRET_CASES))
def test_kernel_in_gpu_interpret_mode(case):
    # jax's GPU interpret mode runs the kernel body on the CPU: simulated warpgroups as threads, SMEM
    # with the tiling/swizzle transforms, TMA copies, barriers (it raises on a phase completed twice
    # unobserved, and hangs on a deadlock), wgmma. Differences from the GPU build: wgmma's A operand and
    # transposed B operands are staged through SMEM (the interpreter takes neither registers nor
    # transposed views), and layout casts are skipped. The "races" case adds its race detector.
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    num_heads, seq_len, batch, num_layers, *d_model = INTERPRET_CASES[case]
    d_model = d_model[0] if d_model else 128
    config, params, x = _model(num_heads, seq_len, batch, True, num_layers=num_layers, d_model=d_model)
    weights = fsm.stack_weights_mgpu(params, num_heads)
    races = case.endswith("races")
    if races:
        padded = batch + (-batch % (128 // seq_len))
        assert padded == batch
        y = fsm.kernel_function(batch, seq_len, num_heads, num_layers, True, "detect_races", d_model=d_model)(
            x, weights.mats, weights.vecs)
        y = np.asarray(y)
        assert not gpu_callbacks.get_races().races_found
    else:
        y = np.asarray(fsm.fused_stack_mgpu_forward(weights, x, num_heads=num_heads, interpret=True))
    assert y.shape == x.shape
    # The same algorithm as the emulation (up to fp32 summation order and the fp16 flips it causes) ...
    assert np.max(np.abs(y - fsm.emulate(weights, x))) < 2e-3
    # ... and within the harness rule of the fp32 reference.
    failed, worst = _harness_failures(y, T.reference(params, x, config=config))
    assert failed == 0, f"{case}: {failed} elements fail, worst err/tol {worst:.2f}"


# Packed heads (8 or 16 at d_model 128) have the 4-head build's four head blocks, and such builds hang in
# GPU interpret mode on two cores (above): 16 heads, S=128, 1 layer made no progress in 11 minutes (2% of
# a core busy). Split the host platform in 3 or more devices and the same build runs in ~10 s (a 4-head
# build too, in 5 s, with 8 devices; measured on a 2-core machine). So the hang is in XLA's CPU runtime,
# not in the kernel: the interpreter runs each of the 3 warpgroups as its own XLA computation on a
# thread, and (as far as we can tell) these wait for the CPU client's thread pool, sized by the larger of
# the core and device counts, while the running warpgroups block in barrier callbacks on the one left
# waiting. jax fixes the device count when it starts, hence a subprocess (conftest.run_on_host_devices,
# 4 devices) per case.
HOST_DEVICES_INTERPRET_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests")
import jax.numpy as jnp, numpy as np
import ttj_jax as T
from conftest import baseline_and_params, random_input
from ttj_jax.kernels import fused_stack_mgpu as fsm
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
num_heads, seq_len, batch, num_layers, causal, mode, *d_model = json.loads(sys.argv[1])
d_model = d_model[0] if d_model else 128
config = T.Config(batch, seq_len, d_model, num_heads, d_model, num_layers, causal)
_, params = baseline_and_params(config, 0)
x = jnp.asarray(random_input(config, 1).numpy())
weights = fsm.stack_weights_mgpu(params, num_heads)
if mode == "forward":   # the jax entry point: argument checks, batch padding
    y = fsm.fused_stack_mgpu_forward(weights, x, num_heads=num_heads, causal=causal, interpret=True)
else:
    y = fsm.kernel_function(batch, seq_len, num_heads, num_layers, causal, mode, d_model=d_model)(
        x, weights.mats, weights.vecs)
y = np.asarray(y)
ref = np.asarray(T.reference(params, x, config=config), np.float64)
ratio = np.abs(y - ref) / np.maximum(0.002, 0.02 * np.abs(ref))
emulated = fsm.emulate(weights, x, causal=causal)
print(json.dumps({"shape_ok": y.shape == x.shape, "emulate_diff": float(np.max(np.abs(y - emulated))),
                  "failed": int((~(ratio <= 1)).sum()), "worst": float(np.nanmax(ratio)),
                  "races": bool(gpu_callbacks.get_races().races_found) if mode == "detect_races" else None}))
"""
PACKED_INTERPRET_CASES = {   # (num_heads, seq_len, batch, num_layers, causal, how it is called)
    "S128-H16-B1-L2-races": (16, 128, 1, 2, True, "detect_races"),   # split key blocks (shape 11's layout)
    "S32-H16-B6-L1-padded": (16, 32, 6, 1, True, "forward"),          # own keys, 4 sequences per tile
    "S128-H8-B1-L1-noncausal": (8, 128, 1, 1, False, True),           # all 128 keys
}


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(PACKED_INTERPRET_CASES))
def test_packed_heads_kernel_in_gpu_interpret_mode(case):
    """The packed-heads kernel body (q masked per sub-head, scores against the whole block's k, P v
    selected per sub-head) in GPU interpret mode, in each key layout: the same output as `emulate` (as
    test_kernel_in_gpu_interpret_mode) and the harness rule against the fp32 reference; no races."""
    import json

    from conftest import last_json_line, run_on_host_devices
    done = run_on_host_devices(["-c", HOST_DEVICES_INTERPRET_SCRIPT, json.dumps(PACKED_INTERPRET_CASES[case])], 4,
                               timeout=600)
    result = last_json_line(done)
    assert result["shape_ok"]
    assert result["emulate_diff"] < 2e-3, result
    assert result["failed"] == 0, f"{case}: {result['failed']} elements fail, worst err/tol {result['worst']:.2f}"
    assert result["races"] in (None, False)


# The masked build in GPU interpret mode, in a 4-device subprocess like the cases above: in process on
# two cores even a 2-head masked build hangs there (its consumers wait for the producer's mask copy).
MASKED_INTERPRET_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests")
import jax.numpy as jnp, numpy as np
import ttj_jax as T
from conftest import baseline_and_params, make_mask, random_input
from ttj_jax.kernels import fused_stack_mgpu as fsm
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
num_heads, seq_len, batch, num_layers, causal, kind, mode, *d_model = json.loads(sys.argv[1])
d_model = d_model[0] if d_model else 128
config = T.Config(batch, seq_len, d_model, num_heads, d_model, num_layers, causal)
_, params = baseline_and_params(config, 0)
mask = jnp.asarray(make_mask(kind, batch, seq_len, 3).numpy())
x = jnp.where(mask[..., None], jnp.asarray(random_input(config, 1).numpy()), 0.0)
weights = fsm.stack_weights_mgpu(params, num_heads)
if mode == "forward":   # the jax entry point: mask checks and conversion, batch padding
    y = fsm.fused_stack_mgpu_forward(weights, x, mask, num_heads=num_heads, causal=causal, interpret=True)
else:
    y = fsm.kernel_function(batch, seq_len, num_heads, num_layers, causal, mode, d_model=d_model, masked=True)(
        x, mask.astype(jnp.uint8).reshape(-1, 128), weights.mats, weights.vecs)
y = np.asarray(y)
ref = np.asarray(T.reference(params, x, mask, config=config), np.float64)
ratio = np.abs(y - ref) / np.maximum(0.002, 0.02 * np.abs(ref))
print(json.dumps({"shape_ok": y.shape == x.shape,
                  "emulate_diff": float(np.max(np.abs(y - fsm.emulate(weights, x, mask, causal=causal)))),
                  "failed": int((~(ratio <= 1)).sum()), "worst": float(np.nanmax(ratio)),
                  "invalid_rows_zero": bool((y[~np.asarray(mask)] == 0).all()),
                  "races": bool(gpu_callbacks.get_races().races_found) if mode == "detect_races" else None}))
"""
MASKED_INTERPRET_CASES = {   # (num_heads, seq_len, batch, num_layers, causal, mask kind, how it is called[, d_model])
    "S128-H2-B1-L2-random-races": (2, 128, 1, 2, True, "random", "detect_races"),   # split key blocks
    "S128-H2-B1-L1-noncausal-prefix": (2, 128, 1, 1, False, "prefix", True),         # all 128 keys
    "S32-H2-B6-L1-all-invalid-padded": (2, 32, 6, 1, True, "all_invalid", "forward"),   # own keys, padded
    "d32-S128-H4-B1-L1-random": (4, 128, 1, 1, True, "random", "forward", 32),      # shape 7's build
    # a tile whose tokens are all valid (the branch to the mask-free layers) beside one that is not
    "S32-H2-B8-L2-first-tile-valid": (2, 32, 8, 2, True, "first_tile_valid", "forward"),
}


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(MASKED_INTERPRET_CASES))
def test_masked_kernel_in_gpu_interpret_mode(case):
    """The masked build's body (the producer's mask copies, the key bias on every score block or, in a
    tile whose tokens are all valid, the mask-free layers, the epilogue's zeroed rows) in GPU interpret
    mode: `emulate`'s output, the harness rule against the fp32 reference with the mask, invalid rows
    exactly zero, no races."""
    import json

    from conftest import last_json_line, run_on_host_devices
    done = run_on_host_devices(["-c", MASKED_INTERPRET_SCRIPT, json.dumps(MASKED_INTERPRET_CASES[case])], 4,
                               timeout=600)
    result = last_json_line(done)
    assert result["shape_ok"] and result["invalid_rows_zero"], result
    assert result["emulate_diff"] < 2e-3, result
    assert result["failed"] == 0, f"{case}: {result['failed']} elements fail, worst err/tol {result['worst']:.2f}"
    assert result["races"] in (None, False)


# The builds the in-process cases above avoid for the hang they describe, the same way in a 4-device
# subprocess: the 4-head build itself (shapes 1-6's: four 32-column head blocks, one head each) and the
# d_model 32 builds (16-wide blocks: shape 7's).
HOST_DEVICES_INTERPRET_CASES = {   # as PACKED_INTERPRET_CASES
    "S128-H4-B1-L1-races": (4, 128, 1, 1, True, "detect_races"),   # split key blocks (shape 1's layout)
    "S32-H4-B6-L1-padded": (4, 32, 6, 1, True, "forward"),          # own keys (shape 12's), batch padded
    # shape 7's build: d_model 32, 4 heads of 8 zero-padded to MIN_BLOCK (16) columns, split key blocks
    "d32-S128-H4-B1-L2-races": (4, 128, 1, 2, True, "detect_races", 32),
    "d32-S128-H2-B1-L2": (2, 128, 1, 2, True, "forward", 32),   # 2 heads of 16: 16-wide, unpadded
}


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(HOST_DEVICES_INTERPRET_CASES))
def test_kernel_on_host_devices_in_gpu_interpret_mode(case):
    """The default 4-head and d_model-32 kernel bodies in GPU interpret mode: `emulate`'s output, the harness rule against
    the fp32 reference, no races (as test_packed_heads_kernel_in_gpu_interpret_mode)."""
    import json

    from conftest import last_json_line, run_on_host_devices
    done = run_on_host_devices(["-c", HOST_DEVICES_INTERPRET_SCRIPT, json.dumps(HOST_DEVICES_INTERPRET_CASES[case])],
                               4, timeout=600)
    result = last_json_line(done)
    assert result["shape_ok"]
    assert result["emulate_diff"] < 2e-3, result
    assert result["failed"] == 0, f"{case}: {result['failed']} elements fail, worst err/tol {result['worst']:.2f}"
    assert result["races"] in (None, False)


# Builds reading and writing a half dtype, in a 4-device subprocess like the cases above (in process on two
# cores they hang as the masked build does). GPU interpret mode takes no aliased shared memory, so there
# the half x / y staging is a buffer of its own (on the GPU it lies over the residual: kernel_function);
# the rest (the copies in and out, the conversions, the layers between) is the GPU build's.
HALF_IO_INTERPRET_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests")
import jax.numpy as jnp, numpy as np
import ttj_jax as T
from conftest import baseline_and_params, make_mask, random_input
from ttj_jax.kernels import fused_stack_mgpu as fsm
num_heads, seq_len, batch, num_layers, dtype, d_model, kind = json.loads(sys.argv[1])
config = T.Config(batch, seq_len, d_model, num_heads, d_model, num_layers, True)
_, params = baseline_and_params(config, 0)
x = jnp.asarray(random_input(config, 1).numpy()).astype(dtype)
mask = () if kind == "none" else (jnp.asarray(make_mask(kind, batch, seq_len, 3).numpy()),)
weights = fsm.stack_weights_mgpu(params, num_heads)
y = fsm.fused_stack_mgpu_forward(weights, x, *mask, num_heads=num_heads, interpret=True)
y32 = fsm.fused_stack_mgpu_forward(weights, x.astype(jnp.float32), *mask, num_heads=num_heads, interpret=True)
print(json.dumps({"dtype": str(y.dtype), "shape_ok": y.shape == x.shape,
                  "equal": bool(np.array_equal(np.asarray(y, np.float32), np.asarray(y32.astype(dtype), np.float32)))}))
"""
HALF_IO_INTERPRET_CASES = {   # (num_heads, seq_len, batch, num_layers, dtype, d_model, mask kind)
    "fp16-S64-H1-B2-L1": (1, 64, 2, 1, "float16", 128, "none"),      # one copy a consumer
    "bf16-S32-H2-B6-L1-padded": (2, 32, 6, 1, "bfloat16", 128, "none"),   # two copies a consumer, padded
    "fp16-S128-H2-B1-L1-random-mask": (2, 128, 1, 1, "float16", 128, "random"),   # the masked build
}


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.parametrize("case", sorted(HALF_IO_INTERPRET_CASES))
def test_half_io_kernel_is_the_fp32_kernel_cast_in_gpu_interpret_mode(case):
    """A build reading and writing fp16 / bf16 (mask-free or masked) computes exactly what the fp32 build
    computes on the same values: its output equals the fp32 build's output rounded to the dtype, element
    for element."""
    import json

    from conftest import last_json_line, run_on_host_devices
    done = run_on_host_devices(["-c", HALF_IO_INTERPRET_SCRIPT, json.dumps(HALF_IO_INTERPRET_CASES[case])], 4,
                               timeout=600)
    result = last_json_line(done)
    assert result["shape_ok"] and result["dtype"] == HALF_IO_INTERPRET_CASES[case][4], result
    assert result["equal"], result
