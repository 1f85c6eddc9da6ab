"""The numerics policy: which dtype each stage of the layer computes in. No other module decides this.

docs/spec.md ("Numerics known to matter") sets the constraints this policy encodes:
- FP16 GEMM operands with FP32 accumulation and FP32 outputs pass the harness rule; the residual stream
  must stay FP32 (an FP16 residual fails: the final LayerNorm amplifies its rounding near the row mean).
- BF16 cannot meet atol 0.002, so no bf16 policy is offered for fp32 inputs.
- LayerNorm statistics and the softmax are computed in FP32.
- The GELU is the erf GELU, except in the GEMM-bound policy `mixed_fp16_gemm16_tanh`, whose tanh
  approximation cuBLASLt computes in the GEMM's epilogue (chosen by measured time and margin: planner.py).
  The fast policies evaluate it as PyTorch writes it (gelu_erf); EXACT_FP32 through erfc (gelu_exact).
`EXACT_FP32` is the policy tests compare against: FP32 everywhere with the highest matmul precision.
`MIXED_FP16_TRAIN` is the gradients' policy: mixed_fp16_gemm16's forward (q/k/v and the MLP's
pre-activation written in fp16 by their GEMMs, erf GELU), whose backward GEMMs take fp16 operands too
(the incoming cotangent rounded to fp16, fp32 accumulation), with fp32 weights kept by the program
and rounded inside each GEMM, so each weight's gradient comes back in fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

LAYER_NORM_EPS = 1e-5

# The harness's pass rule (docs/spec.md, "Accuracy rule"), which every policy here is chosen against: an element passes
# when both values are finite and |out - ref| <= HARNESS_ATOL or <= HARNESS_RTOL * |ref|, i.e. the
# tolerance is max(atol, rtol |ref|), not their sum. bench.baseline.check_close is the same rule on torch
# tensors (tests/test_numerics_rule.py holds the two equal).
HARNESS_ATOL, HARNESS_RTOL = 0.002, 0.02


@dataclasses.dataclass(frozen=True)
class NumericsPolicy:
    name: str
    gemm_dtype: np.dtype          # operands of every matmul (projections, MLP, attention's two dots)
    precision: jax.lax.Precision  # XLA precision for those matmuls (matters only for fp32 operands)
    # Always fp32 here, named so that every reader sees the choice:
    accumulate_dtype: np.dtype = np.dtype(np.float32)   # matmul accumulation and outputs
    residual_dtype: np.dtype = np.dtype(np.float32)     # the residual stream between blocks
    statistics_dtype: np.dtype = np.dtype(np.float32)   # LayerNorm mean/variance and softmax
    # The q/k/v projection's output, which only attention reads (in gemm_dtype): fp32, or gemm_dtype
    # itself so the GEMM writes half the bytes and no separate pass rounds it (GEMM-bound shape 8, where
    # that fp32 tensor is ~100 MB per layer; the program adds the bias after the GEMM, which cuBLAS
    # takes into its epilogue: see planner.GEMM_BOUND_XLA_OPTIONS).
    projection_dtype: np.dtype = np.dtype(np.float32)
    # The MLP's pre-activation (first GEMM plus bias), which only the GELU reads and whose output the
    # second GEMM takes in gemm_dtype: fp32, or gemm_dtype so the GEMM writes half the bytes and the
    # GELU pass reads half (one more fp16 rounding, of the GELU's input).
    hidden_dtype: np.dtype = np.dtype(np.float32)
    # "erf": the model's GELU (docs/spec.md) as PyTorch writes it, x (1 + erf(x / sqrt 2)) / 2
    # (gelu_erf). "erfc": the same function through erfc (gelu_exact, jax.nn.gelu's form), accurate
    # to fp32's relative precision in the far negative tail, at the cost of an exponential and a
    # division per element: the pass that reads a GEMM's fp32 output, adds the bias and applies it
    # took 43 us per layer at gpt2-s4096 on an H100, against 26 us for the peer's erf pass
    # (bench/results/infer-kernels-2026-12-07-h100.json). "tanh": its tanh approximation (within
    # 4.8e-4 of it, under half an fp16 ulp of the hidden value there), evaluated on the pre-activation
    # in hidden_dtype without a conversion between, the pattern cuBLASLt can take into its epilogue.
    gelu: str = "erf"
    # Whether the backward of `matmul` (under jax.vjp / jax.grad) takes fp16 operands too: the cotangent
    # rounded to fp16, fp32 accumulation (as torch's fp16 autocast does). Without it, differentiation
    # pairs an fp32 cotangent with the fp16 operand and the backward GEMMs run in fp32 (TF32 on the
    # GPU): 3.47 of the 6.05 ms of bert-base's backward program on the H200
    # (bench/results/train-2026-12-03-h200-kernels.json).
    fp16_cotangents: bool = False
    # The dtype params.prepare_weights keeps the matrices in: gemm_dtype, or fp32 (rounded inside each
    # GEMM) where a weight's gradient must come back in fp32.
    weight_dtype: np.dtype | None = None
    # 1: each projection one fp16 product. 3: a compensated product, each fp32 operand split into an
    # fp16 head and an fp16 tail (scaled by 2**11 so it stays a normal number) and x_h w_h + x_h w_t +
    # x_t w_h summed in fp32: about fp32's accuracy from three fp16 tensor-core GEMMs (needs fp32
    # weights, weight_dtype). Attention's two dots stay single fp16 products.
    split_products: int = 1

    def __post_init__(self):
        if self.gelu not in ("erf", "erfc", "tanh"):
            raise ValueError(f"NumericsPolicy.gelu={self.gelu!r} must be 'erf', 'erfc' or 'tanh'")
        if self.split_products not in (1, 3):
            raise ValueError(f"NumericsPolicy.split_products={self.split_products!r} must be 1 or 3")
        if self.split_products == 3 and (np.dtype(self.weight_dtype or self.gemm_dtype) != np.float32
                                         or self.fp16_cotangents):
            raise ValueError("a compensated product (split_products=3) takes fp32 weights and no fp16 cotangents")

    def shares_weights_with(self, other: NumericsPolicy) -> bool:
        """Whether weights prepared for this policy serve `other` too: params.prepare_weights depends
        only on the stored weights' dtype (projection_dtype changes the program, not the weights), and
        every policy but a compensated one rounds its weights to gemm_dtype inside each GEMM anyway; a
        compensated one needs the fp32 weights its tails come from."""
        if other.split_products > 1:
            return self.stored_weight_dtype == other.stored_weight_dtype
        return self.gemm_dtype == other.gemm_dtype

    @property
    def stored_weight_dtype(self) -> np.dtype:
        return np.dtype(self.weight_dtype or self.gemm_dtype)

    def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x @ w with this policy's operands, accumulated and returned in fp32. `w` is already in
        stored_weight_dtype (prepared once, see params.prepare_weights)."""
        return self._gemm(x, w, self.accumulate_dtype)

    def _gemm(self, x: jax.Array, w: jax.Array, out_dtype) -> jax.Array:
        """x @ w in gemm_dtype, fp32 accumulation, written in out_dtype."""
        if self.fp16_cotangents:
            return _matmul_with_fp16_cotangents(np.dtype(x.dtype), np.dtype(w.dtype), np.dtype(out_dtype),
                                                DX_IN_INPUT_DTYPE, WEIGHT_RESIDUAL_TRANSPOSED)(x, w)
        if self.split_products == 3:
            return compensated_matmul(x, w, self.gemm_dtype).astype(out_dtype)
        return jnp.matmul(x.astype(self.gemm_dtype), w.astype(self.gemm_dtype),
                          precision=self.precision, preferred_element_type=out_dtype)

    def project_qkv(self, x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        """x @ w + b for the q/k/v projection, returned in projection_dtype (fp32 accumulation)."""
        if self.projection_dtype == self.accumulate_dtype:
            return self.matmul(x, w) + b
        return self._affine_in(x, w, b, self.projection_dtype)

    def _affine_in(self, x: jax.Array, w: jax.Array, b: jax.Array, dtype) -> jax.Array:
        """x @ w + b written in `dtype` by the GEMM (fp32 accumulation), the bias added in `dtype`."""
        if self.fp16_cotangents:   # (the bias's gradient summed in fp32, not in `dtype`)
            return _affine_with_fp16_cotangents(np.dtype(x.dtype), np.dtype(w.dtype), np.dtype(b.dtype),
                                                np.dtype(dtype), DX_IN_INPUT_DTYPE,
                                                WEIGHT_RESIDUAL_TRANSPOSED)(x, w, b)
        return self._gemm(x, w, dtype) + b.astype(dtype)

    def mlp_hidden(self, x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
        """GELU(x @ w + b), the MLP's hidden layer in hidden_dtype: the pre-activation accumulated in
        fp32 and written in hidden_dtype; the erf GELU evaluated in fp32, the tanh GELU directly on the
        pre-activation (XLA hands that expression to cuBLASLt's epilogue where it can)."""
        if self.hidden_dtype == self.accumulate_dtype and self.gelu != "tanh":
            return self._gelu_fp32(self.matmul(x, w) + b)
        if self.fp16_cotangents and self.gelu == "erf" and MLP_BIAS_IN_GELU:
            return _bias_gelu(self._gemm(x, w, self.hidden_dtype), b).astype(self.hidden_dtype)
        pre = self._affine_in(x, w, b, self.hidden_dtype)
        if self.gelu == "tanh":
            return jax.nn.gelu(pre, approximate=True)
        if self.fp16_cotangents:
            return _gelu_saving_its_input(pre).astype(self.hidden_dtype)
        return self._gelu_fp32(pre.astype(jnp.float32)).astype(self.hidden_dtype)

    def _gelu_fp32(self, pre: jax.Array) -> jax.Array:
        """The erf GELU of an fp32 pre-activation in this policy's form (`gelu`)."""
        return gelu_exact(pre) if self.gelu == "erfc" else gelu_erf(pre)

    @property
    def norm_dtype(self):
        """The dtype a LayerNorm that feeds this policy's GEMMs returns: fp32 (None), or fp16 for a training
        policy (fp16_cotangents) with single fp16 products where LAYER_NORM_OUT_IN_GEMM_DTYPE is set."""
        if LAYER_NORM_OUT_IN_GEMM_DTYPE and self.fp16_cotangents and self.split_products == 1:
            return self.gemm_dtype
        return None

    def einsum(self, spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.einsum(spec, a.astype(self.gemm_dtype), b.astype(self.gemm_dtype),
                          precision=self.precision, preferred_element_type=self.accumulate_dtype)


MIXED_FP16 = NumericsPolicy("mixed_fp16", gemm_dtype=np.dtype(np.float16),
                            precision=jax.lax.Precision.DEFAULT)
EXACT_FP32 = NumericsPolicy("exact_fp32", gemm_dtype=np.dtype(np.float32),
                            precision=jax.lax.Precision.HIGHEST, gelu="erfc")
# The planner's choice for GEMM-bound calls (planner.GEMM_BOUND_MIN_D_MODEL, with cuBLAS GEMMs: see there
# for the measurement); mixed_fp16 elsewhere. Weights prepared for either serve both.
MIXED_FP16_QKV16 = NumericsPolicy("mixed_fp16_qkv16", gemm_dtype=np.dtype(np.float16),
                                  precision=jax.lax.Precision.DEFAULT, projection_dtype=np.dtype(np.float16))

# An experiment for the same GEMM-bound calls: q/k/v and the MLP's pre-activation both written in fp16.
MIXED_FP16_GEMM16 = NumericsPolicy("mixed_fp16_gemm16", gemm_dtype=np.dtype(np.float16),
                                   precision=jax.lax.Precision.DEFAULT, projection_dtype=np.dtype(np.float16),
                                   hidden_dtype=np.dtype(np.float16))

# And with the tanh GELU, so that the MLP's first GEMM can carry bias and GELU in its epilogue.
MIXED_FP16_GEMM16_TANH = dataclasses.replace(MIXED_FP16_GEMM16, name="mixed_fp16_gemm16_tanh", gelu="tanh")

# The gradients' policy (module docstring).
MIXED_FP16_TRAIN = dataclasses.replace(MIXED_FP16_GEMM16, name="mixed_fp16_train", fp16_cotangents=True,
                                       weight_dtype=np.dtype(np.float32))

# The projections as compensated products (split_products=3): for inputs whose scale leaves the residual
# stream to computed values (the harness's --input-scale 0.25 and below), where one fp16 product per
# projection fails the rule (docs/decisions.md, "Numerics"). Requested by name; the planner does not
# choose it (1.3-2.2x the default policy's time on the H200, and which inputs need it only their scale says).
MIXED_FP16X3 = NumericsPolicy("mixed_fp16x3", gemm_dtype=np.dtype(np.float16), precision=jax.lax.Precision.DEFAULT,
                              weight_dtype=np.dtype(np.float32), split_products=3)

# fp32 operands at XLA's DEFAULT precision: on an Ampere or later GPU the TF32 tensor cores, the arithmetic
# of the harness's own baseline under torch's allow_tf32 (the harness's default on CUDA), so its rounding
# follows that baseline's where one fp16 product per GEMM, or an exact product, is judged against the
# baseline's own TF32 error (input scales <= 0.25: docs/decisions.md, "Numerics"). Exact fp32 on the CPU.
# Requested by name; the planner does not choose it.
TF32 = NumericsPolicy("tf32", gemm_dtype=np.dtype(np.float32), precision=jax.lax.Precision.DEFAULT)

POLICIES: dict[str, NumericsPolicy] = {p.name: p for p in (MIXED_FP16, EXACT_FP32, MIXED_FP16_QKV16,
                                                           MIXED_FP16_GEMM16, MIXED_FP16_GEMM16_TANH,
                                                           MIXED_FP16_TRAIN, MIXED_FP16X3, TF32)}

# The tail's scale in a compensated product: 2**11, fp16's precision, so x - head (at most half an ulp of
# x) becomes a normal fp16 number unless x itself is below ~2**-14 * 2**11.
_TAIL_SCALE = 2.0 ** 11


def compensated_matmul(x: jax.Array, w: jax.Array, half=np.float16) -> jax.Array:
    """x @ w (fp32 operands) from three fp16 products with fp32 accumulation: x = x_h + x_t / s and
    w = w_h + w_t / s with fp16 heads and scaled fp16 tails; x_h w_h + (x_h w_t + x_t w_h) / s in fp32.
    The dropped x_t w_t term is ~2**-22 of the product, fp32's own rounding."""
    f32 = jnp.float32
    x, w = x.astype(f32), w.astype(f32)
    x_h, w_h = x.astype(half), w.astype(half)
    x_t = ((x - x_h.astype(f32)) * _TAIL_SCALE).astype(half)
    w_t = ((w - w_h.astype(f32)) * _TAIL_SCALE).astype(half)

    def product(a, b):
        return jnp.matmul(a, b, preferred_element_type=f32)
    return product(x_h, w_h) + (product(x_h, w_t) + product(x_t, w_h)) / _TAIL_SCALE


def _fp16_matmul(a: jax.Array, b: jax.Array, out_dtype=jnp.float32) -> jax.Array:
    return jnp.matmul(a.astype(jnp.float16), b.astype(jnp.float16), preferred_element_type=out_dtype)


# Whether the backward's dx GEMM writes an fp16 x's gradient in fp16 itself (True), or in fp32 rounded
# by a separate convert (False). The same rounding (fp32 accumulation, one rounding to x's dtype),
# fewer bytes: at bert-base the MLP's hidden layer is [16384, 3072], 200 MB in fp32. Predicted ~0.1 ms
# of bert-base's step on an H100; measured 3.498 against 3.545 ms for its backward program, shape 8's
# unchanged (3.382 / 3.386; `python3 -m bench.train_programs`, then variant "dx16", the other form now
# "dx32"; bench/results/train-programs-2026-12-07-h100-weight-t.json).
DX_IN_INPUT_DTYPE = True

# Whether a training GEMM keeps its fp16 weight for the backward as w^T ([n, k]: torch's [out, in], the
# layout the parameter arrives in, prepare_weights' transpose undone) instead of w ([k, n]). The forward
# then converts the parameter to fp16 in its own layout, the GEMM reads it transposed (a cuBLAS flag),
# and the backward's dx = g w^T reads it as stored while dw is formed as (g^T x)^T, whose transpose
# cancels prepare_weights'; the kept w ([k, n], a jit output in the default layout) is a transposed copy
# of each weight per step, and its f32 transpose another. The same products (summed in another order).
# Predicted 0.1-0.2 ms of shape 8's step on an H100 (24M weights, ~12 bytes and ~2 launches each fewer);
# measured: forward program 1.711 against 1.916 ms at shape 8, 1.807 against 1.955 at bert-base
# (`python3 -m bench.train_programs`, then variant "weight-t", the other form now "weight-kn";
# train-programs-2026-12-07-h100-weight-t.json).
WEIGHT_RESIDUAL_TRANSPOSED = True


@functools.cache
def _matmul_with_fp16_cotangents(x_dtype: np.dtype, w_dtype: np.dtype, out_dtype: np.dtype,
                                 dx_in_input_dtype: bool = False, weight_transposed: bool = False):
    """x @ w (x [..., k], w [k, n]) in fp16 with fp32 accumulation, written in out_dtype, whose backward
    GEMMs take fp16 operands as well: dx = g w^T and dw = x^T g, g rounded to fp16, fp32 accumulation;
    dx and dw come back in x's and w's dtypes (dx_in_input_dtype: an fp16 x's dx written in fp16 by the
    GEMM; DX_IN_INPUT_DTYPE). The residuals are x and w in fp16 (weight_transposed: w^T, and dw formed
    as (g^T x)^T; WEIGHT_RESIDUAL_TRANSPOSED)."""

    @jax.custom_vjp
    def matmul(x, w):
        return _fp16_matmul(x, w, out_dtype)

    def forward(x, w):
        x16 = x.astype(jnp.float16)
        if weight_transposed:
            wt16 = w.T.astype(jnp.float16)
            return _fp16_matmul(x16, wt16.T, out_dtype), (x16, wt16)
        w16 = w.astype(jnp.float16)
        return _fp16_matmul(x16, w16, out_dtype), (x16, w16)

    def backward(residuals, g):
        x16, kept = residuals
        g16 = g.astype(jnp.float16)
        written = x_dtype if dx_in_input_dtype and np.dtype(x_dtype) == np.float16 else jnp.float32
        rows_x, rows_g = x16.reshape(-1, x16.shape[-1]), g16.reshape(-1, g16.shape[-1])
        if weight_transposed:
            dx = _fp16_matmul(g16, kept, written).astype(x_dtype)
            dw = _fp16_matmul(rows_g.T, rows_x).T.astype(w_dtype)
        else:
            dx = _fp16_matmul(g16, kept.T, written).astype(x_dtype)
            dw = _fp16_matmul(rows_x.T, rows_g).astype(w_dtype)
        return dx, dw

    matmul.defvjp(forward, backward)
    return matmul


@functools.cache
def _affine_with_fp16_cotangents(x_dtype: np.dtype, w_dtype: np.dtype, b_dtype: np.dtype, out_dtype: np.dtype,
                                 dx_in_input_dtype: bool = False, weight_transposed: bool = False):
    """x @ w + b as _matmul_with_fp16_cotangents, the bias added in out_dtype; the bias's gradient is the
    cotangent summed over the rows in fp32 (a sum in fp16 over thousands of rows loses its precision)."""
    product = _matmul_with_fp16_cotangents(x_dtype, w_dtype, out_dtype, dx_in_input_dtype, weight_transposed)

    @jax.custom_vjp
    def affine(x, w, b):
        return product(x, w) + b.astype(out_dtype)

    def forward(x, w, b):
        y, residuals = jax.vjp(product, x, w)
        return y + b.astype(out_dtype), residuals

    def backward(pull, g):
        dx, dw = pull(g)
        db = g.astype(jnp.float32).reshape(-1, g.shape[-1]).sum(axis=0)
        return dx, dw, db.astype(b_dtype)

    affine.defvjp(forward, backward)
    return affine


def get_policy(policy: str | NumericsPolicy) -> NumericsPolicy:
    if isinstance(policy, NumericsPolicy):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(f"unknown numerics policy {policy!r}; known: {sorted(POLICIES)}") from None


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, out_dtype=None) -> jax.Array:
    """LayerNorm over the last axis, biased variance, eps 1e-5, statistics in fp32; returns fp32, or
    out_dtype (rounded once, inside the rule: its cotangent then arrives in out_dtype too).
    Computed on the rows as one 2-D array (a free reshape): XLA's GPU fusion of a [B, S, d] LayerNorm
    tiled it [32, 1, d], 32 rows a whole sequence apart, at 21 us per LayerNorm of vit-s197's residual
    where [B*S, d] tiles take 7 (docs/decisions.md, "Planner and stacks"). Its backward keeps the fp32
    input and the rows' mean and reciprocal deviation, and recomputes the normalised rows from them
    (jax's own rule keeps two fp32 [rows, d] tensors). It keeps x in its own shape, so that a program's
    fp32 input kept for the backward is that input itself (training.Residuals leaves it out)."""
    return _layer_norm_rows(x.astype(jnp.float32), weight, bias, np.dtype(out_dtype or np.float32))


# Whether a LayerNorm's row statistics come from one pass over the rows (True): the sums of x - x0 and of
# its square, x0 each row's first element, are sibling reductions XLA computes in one kernel (with the
# residual add before them), where the two-pass form (the mean, then the squares about it) makes the
# variance a second pass over the rows. The shift by x0 keeps the subtraction E[y^2] - E[y]^2 from
# cancelling when a row's mean is large against its deviation (the cancellation grows with
# ((x0 - mean) / deviation)^2, O(1-10) for a row's own element, against (mean / deviation)^2 unshifted).
# Prediction: ~10 us per LayerNorm of shape 8's [8192, 1024] residual on an H100 (one 34 MB read of the
# new residual fewer), ~0.1 ms of its training step. Measured on one H100 (variant "ln-one-pass" of
# `python3 -m bench.train_programs`, train-programs-2026-12-07-h100-cuts.json): shape 8's step 4.936 ->
# 4.942 ms, bert-base 5.315 -> 5.312, gpt2-s4096 2.314 -> 2.302; no gain worth the cancellation risk. Off.
LAYER_NORM_ONE_PASS = False


def _row_statistics(x):
    if LAYER_NORM_ONE_PASS:
        first = x[..., :1]
        shifted = x - first
        shift_mean = jnp.mean(shifted, axis=-1, keepdims=True)
        variance = jnp.maximum(jnp.mean(shifted * shifted, axis=-1, keepdims=True) - shift_mean * shift_mean, 0.0)
        mean = first + shift_mean
        return mean, x - mean, jax.lax.rsqrt(variance + LAYER_NORM_EPS)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    variance = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return mean, centered, jax.lax.rsqrt(variance + LAYER_NORM_EPS)


# Whether LayerNorm's backward rule keeps the rows' mean and reciprocal deviation beside the input (True),
# or recomputes them from the input (False): the kept statistics are outputs of the forward program, which
# splits its LayerNorm into five passes on the GPU (mean, scale, variance, rsqrt, normalise). An
# alternative to measure (`python3 -m bench.train_programs`, variant "ln-recompute").
LAYER_NORM_KEEPS_STATISTICS = True


def _rows(x):
    return x.reshape(-1, x.shape[-1])


def _layer_norm_forward(x, weight, bias, dtype):
    mean, centered, rstd = _row_statistics(_rows(x))
    kept = (mean, rstd) if LAYER_NORM_KEEPS_STATISTICS else (None, None)
    return (centered * rstd * weight + bias).astype(dtype).reshape(x.shape), (x, *kept, weight, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm_rows(x, weight, bias, dtype):
    """The LayerNorm of fp32 x (..., d), computed on its rows, its output rounded to dtype inside the rule
    (the cotangent then comes in dtype; fp32: no rounding)."""
    return _layer_norm_forward(x, weight, bias, dtype)[0]


def _layer_norm_backward(dtype, residuals, g):   # g comes in dtype
    x_in, mean, rstd, weight, bias = residuals
    x = _rows(x_in)
    if mean is None:
        mean, _, rstd = _row_statistics(x)
    g = _rows(g).astype(jnp.float32)
    normalised = (x - mean) * rstd
    if LAYER_NORM_JOINT_PARAMETER_SUMS:   # one reduction over the rows of [g * normalised, g]
        sums = jnp.sum(jnp.stack([g * normalised, g], axis=1), axis=0)
        dw, db = sums[0], sums[1]
    else:
        dw, db = jnp.sum(g * normalised, axis=0), jnp.sum(g, axis=0)
    dw = dw.reshape(weight.shape).astype(weight.dtype)
    db = db.reshape(bias.shape).astype(bias.dtype)
    gw = g * weight
    dx = rstd * (gw - jnp.mean(gw, axis=-1, keepdims=True)
                 - normalised * jnp.mean(gw * normalised, axis=-1, keepdims=True))
    return dx.reshape(x_in.shape), dw, db


_layer_norm_rows.defvjp(_layer_norm_forward, _layer_norm_backward)

# Whether a LayerNorm's backward sums its weight's and bias's gradients over the rows as one reduction (of
# [g * normalised, g] stacked), not two: on the GPU the two column sums ran as separate passes over g (at
# shape 8 on an H100, 26 us for the weight's, reading g and x, and 12 us for the bias's, reading g again;
# train-2026-12-07-h100-8-kernels.json). The same sums. Prediction: ~10 us per LayerNorm, ~0.1 ms of shape
# 8's step. Measured on one H100 (variant "ln-joint-sums", train-programs-2026-12-07-h100-cuts.json):
# backward 3.227 -> 3.190 ms at shape 8, 3.496 -> 3.485 at bert-base, 1.532 -> 1.512 at gpt2-s4096 (XLA
# still splits the stacked reduction in two kernels at shape 8: a third of the prediction).
LAYER_NORM_JOINT_PARAMETER_SUMS = True


# Whether a training LayerNorm that feeds a GEMM returns its output in the GEMM's fp16 (rounded inside
# its rule) instead of fp32 rounded by the GEMM (policies with fp16_cotangents: `NumericsPolicy.norm_dtype`).
# The forward's values are the same; in the backward the GEMM writes dL/dh in fp16 (DX_IN_INPUT_DTYPE) and
# the LayerNorm's two passes read it in fp16: half the bytes of that [rows, d] cotangent written once and
# read twice (torch's autocast does the same: its fp16 linear hands its fp32 LayerNorm an fp16-rounded
# gradient). Prediction: ~18 us per LayerNorm at shape 8 ([8192, 1024]), ~0.15 ms of its step on an
# H100. Measured there (variant "ln-out16", train-programs-2026-12-07-h100-cuts.json): backward 3.227 ->
# 3.082 ms at shape 8, 3.496 -> 3.421 at bert-base, 1.532 -> 1.535 at gpt2-s4096 (S=4096, B=1: its
# LayerNorms are small); gradients within 2.5e-4 relative L2 of the fp32-cotangent form.
LAYER_NORM_OUT_IN_GEMM_DTYPE = True


def gelu_exact(x: jax.Array) -> jax.Array:
    """The erf GELU (PyTorch's default), not the tanh approximation."""
    return jax.nn.gelu(x, approximate=False)


def gelu_erf(x: jax.Array) -> jax.Array:
    """The erf GELU written as PyTorch writes it, x (1 + erf(x / sqrt 2)) / 2: jax.nn.gelu's form goes
    through erfc, which XLA evaluates with an exponential and a division beside erf's polynomial. Within
    fp32 rounding of gelu_exact (1 - erf(-t) against erfc(t) for x < 0 loses only absolute accuracy,
    ~6e-8 |x|)."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))


@jax.custom_vjp
def _gelu_saving_its_input(x: jax.Array) -> jax.Array:
    """The erf GELU of x (any float dtype; gelu_erf) computed and returned in fp32, whose backward
    recomputes the derivative from x, the one residual (in its own dtype), instead of the forward
    writing the derivative's terms out as residuals (jax's own rule)."""
    return gelu_erf(x.astype(jnp.float32))


def _gelu_forward(x):
    return gelu_erf(x.astype(jnp.float32)), x


def _gelu_derivative(h):
    cdf = 0.5 * (1.0 + jax.lax.erf(h * 0.7071067811865476))
    pdf = 0.3989422804014327 * jnp.exp(-0.5 * h * h)
    return cdf + h * pdf


def _gelu_backward(x, g):
    return ((g * _gelu_derivative(x.astype(jnp.float32))).astype(x.dtype),)


_gelu_saving_its_input.defvjp(_gelu_forward, _gelu_backward)


# Whether the training MLP adds its first bias inside the GELU's rule (_bias_gelu: the residual is the GEMM's
# own output, the pre-activation never written; the sum formed in fp32) or before it (the GEMM's output plus
# the bias written in fp16 as the GELU's residual). Measured on one H100 (`python3 -m bench.train_programs`,
# variant "bias-gelu", train-programs-2026-12-07-h100-residuals-a.json, -b.json): programs 5.197 -> 5.157
# and 5.172 -> 5.149 ms at bert-base, 2.179 -> 2.166 at gpt2-s4096, 4.624 -> 4.612 at shape 8 (predicted
# 0.05-0.1 ms at bert-base: a third to a half of it); outputs within 1.2e-4, gradients 5e-4 relative L2 of
# the fp16 pre-activation's.
MLP_BIAS_IN_GELU = True


@jax.custom_vjp
def _bias_gelu(y: jax.Array, b: jax.Array) -> jax.Array:
    """gelu_erf(y + b) in fp32 (y [..., n] any float dtype, b [n]), the sum formed in fp32. Its backward
    recomputes y + b from y and b, the residuals, returns dy in y's dtype and db summed over the rows in
    fp32."""
    return _bias_gelu_forward(y, b)[0]


def _bias_gelu_forward(y, b):
    return gelu_erf(y.astype(jnp.float32) + b.astype(jnp.float32)), (y, b)


def _bias_gelu_backward(residuals, g):
    y, b = residuals
    d = g * _gelu_derivative(y.astype(jnp.float32) + b.astype(jnp.float32))
    return d.astype(y.dtype), d.reshape(-1, d.shape[-1]).sum(axis=0).astype(b.dtype)


_bias_gelu.defvjp(_bias_gelu_forward, _bias_gelu_backward)


@jax.jit
def harness_check(out: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The harness rule on jax arrays of one shape: (failing elements, worst |err| / tolerance, max |err|)
    as jax scalars, computed in fp32. A non-finite value on either side fails with ratio inf."""
    out, ref = jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32)
    err = jnp.abs(out - ref)
    tolerance = jnp.maximum(HARNESS_ATOL, HARNESS_RTOL * jnp.abs(ref))
    ratio = jnp.where(jnp.isfinite(out) & jnp.isfinite(ref), err / tolerance, jnp.inf)
    return jnp.sum(ratio > 1), jnp.max(ratio), jnp.max(jnp.where(jnp.isfinite(err), err, jnp.inf))
