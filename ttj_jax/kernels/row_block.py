"""Everything a layer does between two attentions, as one generic (Triton-style) Pallas kernel per row tile.

Outside attention, every step of a pre-LN layer is row-local: the out-projection and its bias, the
residual add, LayerNorm, the MLP with its GELU, the second residual add, and then the next layer's
LayerNorm and q/k/v projections. The XLA program runs them as about eight kernels, each a pass over the
fp32 residual in device memory; at shape 13 (65,536 rows) those passes cost about as much as attention.
Here one kernel per tile of rows reads the residual and the attention context once and writes the new
residual once and the next layer's q, k and v (fp16) once. With our flash-attention kernel in between,
a layer is two launches (`rows_forward`; the planner's "rows" stack, once measured on the GPU).

Kernels (each a `pl.pallas_call` over row tiles of `block_rows` rows; widths must be powers of two
>= 16 and d_model <= MAX_D_MODEL, since each program holds whole rows and whole [d, d] weights):
- `_entry_kernel`: LN1 of layer 0 and its q, k, v projections.
- `_between_kernel`: a = context @ W_out + b_out (zeroed on invalid rows); x += a; x += MLP(LN2(x))
  (zeroed on invalid rows); then either the next layer's q, k, v or, after the last layer, the final
  LayerNorm (zeroed on invalid rows).

Heads narrower than the flash kernel's smallest width (head_dim 8, shape 11): `rows_weights` zero-pads
each head's q/k/v columns and out-projection rows to the width the kernel runs at (`padded_head_dim`),
so the row kernels write q, k, v already padded and read the padded context: no pad or slice copies
around attention (12 pads and 4 slices per call at shape 11: ~50 of its ~170 us on the H200, and a
dozen kernel launches). The padded columns are exact zeros (zero weights, zero bias), as the flash
kernel's own padding would make them; the softmax scale stays head_dim ** -0.5.

Numerics are the project's mixed policy (numerics.MIXED_FP16), as in the XLA program: fp16 dot operands
with fp32 accumulation, fp32 residual, LayerNorm in fp32, q/k/v rounded to fp16 (what attention reads),
GELU on fp32 with the erf evaluated by XLA's rational approximation (pallas_common.erf, within 4e-7).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ttj_jax.kernels.pallas_common import GEMM_DTYPE, dot, gelu, layer_norm_rows, loop
from ttj_jax.numerics import MIXED_FP16
from ttj_jax.params import LayerStackWeights, PreparedWeights, stacked_layers

MAX_D_MODEL = 128
MAX_FFN_DIM = 1024


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supports(config) -> bool:
    """Whether these kernels run a model of this config's widths (any batch and sequence length)."""
    return (_power_of_two(config.d_model) and config.d_model <= MAX_D_MODEL
            and _power_of_two(config.ffn_dim) and config.ffn_dim <= MAX_FFN_DIM)


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    block_rows: int = 64   # rows per program
    ffn_block: int = 64    # MLP hidden columns per step
    num_warps: int = 4


def _row_spec(rows: int, width: int):
    return pl.BlockSpec((rows, width), lambda i: (i, 0))


def _layer_block(stacked: jax.Array, layer: int):
    """Layer `layer` of a weight stacked over layers ([L, ...]): the whole of it in every program."""
    return pl.BlockSpec((None,) + stacked.shape[1:], lambda i, ndim=stacked.ndim: (layer,) + (0,) * (ndim - 1))


def _whole(array):
    return pl.BlockSpec(array.shape, lambda i, ndim=array.ndim: (0,) * ndim)


def _project_qkv(h, qkv_w_ref, qkv_b_ref, q_ref, k_ref, v_ref, d_model: int):
    """q, k, v of the rows h, each out of its `width` columns of the fused [d, 3 width] projection
    (width = d_model, or wider with padded heads), in column chunks of d_model (one accumulator of
    block_rows x d_model at a time)."""
    width = q_ref.shape[-1]
    for slot, out_ref in enumerate((q_ref, k_ref, v_ref)):
        for start in range(0, width, d_model):
            columns = pl.ds(slot * width + start, d_model)
            out_ref[:, pl.ds(start, d_model)] = (
                dot(h, qkv_w_ref[:, columns]) + qkv_b_ref[columns][None, :]).astype(out_ref.dtype)


def _entry_kernel(x_ref, n_w_ref, n_b_ref, qkv_w_ref, qkv_b_ref, q_ref, k_ref, v_ref, *, d_model: int):
    h = layer_norm_rows(x_ref[...].astype(jnp.float32), n_w_ref[...], n_b_ref[...], d_model=d_model)
    _project_qkv(h.astype(GEMM_DTYPE), qkv_w_ref, qkv_b_ref, q_ref, k_ref, v_ref, d_model)


def _between_kernel(*refs, d_model: int, ffn_block: int, masked: bool, last: bool):
    # refs: x, context, [mask], out_w, out_b, norm2_w, norm2_b, ffn_in_w, ffn_in_b, ffn_out_w, ffn_out_b,
    # then (next layer) norm1_w, norm1_b, qkv_w, qkv_b -> x_out, q, k, v
    #      or (last)   final_w, final_b -> y
    x_ref, context_ref, *refs = refs
    mask_ref = refs.pop(0) if masked else None
    (out_w_ref, out_b_ref, n2_w_ref, n2_b_ref, f_in_w_ref, f_in_b_ref, f_out_w_ref, f_out_b_ref), refs = \
        refs[:8], refs[8:]
    row_valid = (mask_ref[...] != 0)[:, None] if masked else None

    x = x_ref[...].astype(jnp.float32)
    attended = x + dot(context_ref[...], out_w_ref[...]) + out_b_ref[...][None, :]
    x = attended if row_valid is None else jnp.where(row_valid, attended, x)
    h = layer_norm_rows(x, n2_w_ref[...], n2_b_ref[...], d_model=d_model).astype(GEMM_DTYPE)

    def mlp_slice(block, residual):
        start = block * ffn_block
        if not isinstance(start, int):
            start = pl.multiple_of(start, ffn_block)
        columns = pl.ds(start, ffn_block)
        hidden = gelu(dot(h, f_in_w_ref[:, columns]) + f_in_b_ref[columns][None, :])
        return residual + dot(hidden, f_out_w_ref[columns, :])

    x = loop(f_in_w_ref.shape[1] // ffn_block, mlp_slice, x + f_out_b_ref[...][None, :])
    if row_valid is not None:
        x = jnp.where(row_valid, x, 0.0)
    if last:
        final_w_ref, final_b_ref, y_ref = refs
        y = layer_norm_rows(x, final_w_ref[...], final_b_ref[...], d_model=d_model)
        y_ref[...] = (y if row_valid is None else jnp.where(row_valid, y, 0.0)).astype(y_ref.dtype)
        return
    n1_w_ref, n1_b_ref, qkv_w_ref, qkv_b_ref, x_out_ref, q_ref, k_ref, v_ref = refs
    x_out_ref[...] = x
    h = layer_norm_rows(x, n1_w_ref[...], n1_b_ref[...], d_model=d_model).astype(GEMM_DTYPE)
    _project_qkv(h, qkv_w_ref, qkv_b_ref, q_ref, k_ref, v_ref, d_model)


@jax.tree_util.register_pytree_node_class
class RowsWeights(LayerStackWeights):
    """The rows stack's weights: PreparedWeights' per-layer arrays stacked over the layers (`layers[name]`
    is [L, ...]), and the final LayerNorm's two vectors. Fourteen arrays whatever the depth, where
    PreparedWeights has twelve per layer: jax's dispatch costs about 1 us of host time per argument on the
    H200 host, so fewer arguments make a cheaper call. Each kernel reads its layer's slice in place (a
    BlockSpec on the stacked array), so stacking adds no copy to the call."""

    @property
    def num_layers(self) -> int:
        return next(iter(self.layers.values())).shape[0]


def stacked_weights(prepared: PreparedWeights) -> RowsWeights:
    """`prepared`'s layers stacked, as they are (no padding). Traceable."""
    return RowsWeights(stacked_layers(prepared), dict(prepared.final_norm), prepared.policy_name)


def rows_weights(prepared: PreparedWeights, num_heads: int) -> RowsWeights:
    """`prepared` stacked over the layers (RowsWeights), with each head's q/k/v columns (weights and
    biases) and out-projection rows zero-padded to `padded_head_dim(head_dim)` (module docstring) where
    the heads are narrower than that. Traceable: build it once under jit (model.kernel_weights does)
    and keep it."""
    return stacked_weights(padded_heads(prepared, num_heads))


def padded_heads(prepared: PreparedWeights, num_heads: int) -> PreparedWeights:
    """`prepared` with narrow heads zero-padded (see rows_weights), or `prepared` itself when the heads
    need no padding."""
    from ttj_jax.kernels.flash_attention import padded_head_dim
    d = prepared.layers[0]["qkv_weight"].shape[0]
    hd = d // num_heads
    pad = padded_head_dim(hd) - hd
    if not pad:
        return prepared

    def per_head_columns(a):   # [..., 3d] -> [..., 3 H hp]
        a = a.reshape(a.shape[:-1] + (3, num_heads, hd))
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])
        return a.reshape(a.shape[:-3] + (-1,))

    def per_head_rows(w):      # [d, d_out] (context features in) -> [H hp, d_out]
        w = jnp.pad(w.reshape(num_heads, hd, -1), ((0, 0), (0, pad), (0, 0)))
        return w.reshape(num_heads * (hd + pad), -1)

    layers = [{**layer, "qkv_weight": per_head_columns(layer["qkv_weight"]),
               "qkv_bias": per_head_columns(layer["qkv_bias"]), "out_weight": per_head_rows(layer["out_weight"])}
              for layer in prepared.layers]
    return PreparedWeights(layers, prepared.final_norm, prepared.policy_name)


def _compiler(blocks: RowBlocks):
    return pltriton.CompilerParams(num_warps=blocks.num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("num_heads", "causal", "block_rows", "ffn_block", "num_warps",
                                             "interpret"))
def rows_forward(weights: RowsWeights | PreparedWeights, x: jax.Array, row_valid: jax.Array | None = None,
                 key_valid: jax.Array | None = None, *, num_heads: int, causal: bool, block_rows: int = 64,
                 ffn_block: int = 64, num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """y = LN_final(layers(x)) per docs/spec.md: per layer our flash-attention kernel and one row-tile
    kernel for everything else (module docstring).

    weights: RowsWeights of the mixed_fp16 policy (`rows_weights`: heads padded, so no copies around
    attention; `stacked_weights`: as they are, and the flash kernel pads heads narrower than 16 itself),
    or PreparedWeights, stacked here as they are (copies inside the call: build RowsWeights once instead).
    x: [B, S, d] (any float dtype; computed with an fp32 residual, returned in x's dtype). row_valid: None or
    bool [B, S]: invalid rows are zeroed as docs/spec.md says. key_valid: None or bool [B, S]: keys attention
    may see (see layers.key_mask_for).
    B * S must be a multiple of block_rows (the caller pads; the planner only plans shapes that are).
    """
    from ttj_jax.kernels.flash_attention import flash_attention, padded_head_dim
    if weights.policy_name != MIXED_FP16.name:
        raise ValueError(f"weights.policy_name={weights.policy_name!r} must be {MIXED_FP16.name!r}")
    if isinstance(weights, PreparedWeights):
        weights = stacked_weights(weights)
    stack = weights.layers
    B, S, d = x.shape
    n = B * S
    ffn = stack["ffn_in_weight"].shape[-1]
    if not (_power_of_two(d) and d <= MAX_D_MODEL and _power_of_two(ffn) and ffn <= MAX_FFN_DIM):
        raise ValueError(f"d_model={d} and ffn_dim={ffn} must be powers of two >= 16, at most "
                         f"{MAX_D_MODEL} and {MAX_FFN_DIM}")
    if n % block_rows:
        raise ValueError(f"batch * seq_len = {n} must be a multiple of block_rows={block_rows}")
    head_dim = d // num_heads
    width = stack["qkv_weight"].shape[-1] // 3   # d, or num_heads * padded head width
    if width not in (d, num_heads * padded_head_dim(head_dim)):
        raise ValueError(f"q/k/v width {width}: expected {d} or, padded by rows_weights, "
                         f"{num_heads * padded_head_dim(head_dim)}")
    head_width = width // num_heads
    blocks = RowBlocks(block_rows, min(ffn_block, ffn), num_warps)
    grid = (n // block_rows,)
    rows = x.reshape(n, d).astype(jnp.float32)
    masked = row_valid is not None
    mask_inputs = [row_valid.reshape(n).astype(jnp.int8)] if masked else []
    mask_specs = [pl.BlockSpec((block_rows,), lambda i: (i,))] if masked else []
    qkv_shapes = [jax.ShapeDtypeStruct((n, width), GEMM_DTYPE)] * 3

    entry_names = ("norm1_weight", "norm1_bias", "qkv_weight", "qkv_bias")
    q, k, v = pl.pallas_call(
        functools.partial(_entry_kernel, d_model=d), grid=grid,
        in_specs=[_row_spec(block_rows, d)] + [_layer_block(stack[name], 0) for name in entry_names],
        out_specs=[_row_spec(block_rows, width)] * 3, out_shape=qkv_shapes,
        compiler_params=_compiler(blocks), interpret=interpret, name="ttj_rows_entry",
    )(rows, *[stack[name] for name in entry_names])

    num_layers = weights.num_layers
    for index in range(num_layers):
        heads = lambda a: a.reshape(B, S, num_heads, head_width)
        context = flash_attention(heads(q), heads(k), heads(v), causal=causal, key_mask=key_valid,
                                  sm_scale=head_dim ** -0.5, interpret=interpret).reshape(n, width)
        last = index == num_layers - 1
        layer_names = ("out_weight", "out_bias", "norm2_weight", "norm2_bias", "ffn_in_weight", "ffn_in_bias",
                       "ffn_out_weight", "ffn_out_bias")
        inputs = [stack[name] for name in layer_names]
        specs = [_layer_block(a, index) for a in inputs]
        if last:
            tail = [weights.final_norm["weight"], weights.final_norm["bias"]]
            inputs, specs = inputs + tail, specs + [_whole(a) for a in tail]
            out_specs, out_shape = _row_spec(block_rows, d), jax.ShapeDtypeStruct((n, d), x.dtype)
        else:   # the next layer's LayerNorm 1 and q/k/v projection
            tail = [stack[name] for name in entry_names]
            inputs, specs = inputs + tail, specs + [_layer_block(a, index + 1) for a in tail]
            out_specs = [_row_spec(block_rows, d)] + [_row_spec(block_rows, width)] * 3
            out_shape = [jax.ShapeDtypeStruct((n, d), jnp.float32)] + qkv_shapes
        result = pl.pallas_call(
            functools.partial(_between_kernel, d_model=d, ffn_block=blocks.ffn_block, masked=masked, last=last),
            grid=grid,
            in_specs=[_row_spec(block_rows, d), _row_spec(block_rows, width)] + mask_specs + specs,
            out_specs=out_specs, out_shape=out_shape, compiler_params=_compiler(blocks), interpret=interpret,
            name="ttj_rows_between",
        )(rows, context, *mask_inputs, *inputs)
        if last:
            return result.reshape(B, S, d)
        rows, q, k, v = result
