"""ttj's two training programs alone, from JAX, for variants of the training program: the forward that
keeps its residuals (`bridge.autograd.forward_program`'s body) and the backward that applies them
(`apply_program`'s), each timed as a stream of calls (`bench.jax_timing.stream_ms_per_call`), on random
weights, an all-valid mask (the masked program, as the bridge's default training forward runs) and a
random cotangent of a loss's size (1/numel).

Each variant sets module switches for its compilation and restores them after. Its output, parameter
gradients and dL/dx are compared with the first variant's (relative L2), so a variant that changes the
arithmetic more than its rounding shows. The variants:

  default               as shipped
  before-f6ebade        q/k/v sliced out of the projection, rows zeroed after each attention, jax's
                        erfc GELU, the Hopper backward from S=2048 only (all four together)
  separate-qkv          q/k/v sliced out of the fused projection for the attention (training.FUSED_QKV_ATTENTION)
  zero-rows             invalid rows zeroed after each of our flash attentions (layers.layer)
  erfc-gelu             jax.nn.gelu's erfc form in the training GELU (numerics.gelu_erf)
  hopper-bwd-from-2048  the Hopper attention backward from S=2048 (MGPU_BACKWARD_MIN_SEQ_LEN)
  ln-recompute          LayerNorm's statistics recomputed in the backward (numerics.LAYER_NORM_KEEPS_STATISTICS)
  cublas-gemms          both programs compiled with XLA's Triton GEMMs off (xla_gpu_enable_triton_gemm)
  bias-gelu             the MLP's first bias added inside the GELU's rule (numerics.MLP_BIAS_IN_GELU; the
                        default since 42daa00, so now the same programs as default: bias-before-gelu is the other form)
  cudnn-masked          cuDNN's attention with the mask in extra lanes, not our flash kernels (training.MASKED_CUDNN)
  dx32                  an fp16 input's gradient written in fp32 by its GEMM, then converted
                        (numerics.DX_IN_INPUT_DTYPE off)
  weight-kn             each GEMM's fp16 weight kept as w ([in, out]), a transposed copy of torch's
                        (numerics.WEIGHT_RESIDUAL_TRANSPOSED off)
  dqkv-stacked          our backward kernels write dq, dk, dv as three arrays stacked after, not into their
                        slots of one fused-layout buffer (flash_attention_bwd.GRADIENT_IN_PLACE off)
  ln-one-pass           LayerNorm's row statistics from one pass of shifted sums (numerics.LAYER_NORM_ONE_PASS)
  ln-out32              LayerNorms that feed GEMMs return fp32, their cotangent fp32
                        (numerics.LAYER_NORM_OUT_IN_GEMM_DTYPE off)
  ln-two-sums           a LayerNorm's weight and bias gradients as two reductions over the rows
                        (numerics.LAYER_NORM_JOINT_PARAMETER_SUMS off)
  hopper-forward        the attention forward through flash_attention's dispatch, the Hopper kernel (its
                        log-sum-exp too) where it applies (flash_attention_bwd.VJP_FORWARD_IMPLEMENTATION "auto")
  generic-forward       the attention forward always our generic kernel (VJP_FORWARD_IMPLEMENTATION "generic")
  mosaic-forward        the attention forward always the Hopper kernel (VJP_FORWARD_IMPLEMENTATION "mosaic";
                        fails where that kernel does not apply)
  forward-with-hopper-backward  the attention forward the Hopper kernel wherever the Hopper backward runs,
                        not by the inference dispatch (flash_attention_bwd.VJP_FORWARD_WITH_HOPPER_BACKWARD)
  mgpu-stacked          the Hopper backward on q, k, v sliced out, dq/dk/dv stacked after (MGPU_BACKWARD_IN_PLACE off)
  bias-before-gelu      the MLP's first bias added before the GELU, the sum written in fp16 (MLP_BIAS_IN_GELU off)
  inputs-in-residuals   the forward returns its whole pullback, its own inputs among the residuals (copied
                        out), not training.Residuals
  mgpu-in-place         the Hopper attention backward reads q, k, v from the fused projection and writes its
                        gradient in that layout (flash_attention_bwd.MGPU_BACKWARD_IN_PLACE; the default since
                        42daa00, so now the same programs as default: mgpu-stacked is the other form)
  command-buffers-off   both programs compiled without XLA's command buffers (CUDA graphs of runs of kernels)
  command-buffers-all   both programs compiled with every kernel kind XLA can put in a command buffer in one,
                        from runs of one kernel on (xla_gpu_graph_min_graph_size=1)

Per variant also the host time of each program's dispatch, the device drained first (median of
DISPATCH_CALLS): what the bridge's training step pays on the host per program, beside its GPU time.

    PYTHONPATH=. python3 -m bench.train_programs [--configs bert-base,8] [--variants default,ln-recompute] [--out DIR]

Writes train-programs-<date>-<gpu>.json: {"configs": {id: {variant: {forward_ms, backward_ms, ...}}}}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.jax_timing import drained_dispatch_us, stream_ms_per_call  # noqa: E402
from bench.paths import find_configs, result_file, run_header  # noqa: E402
from bridge.autograd import flat_gradients  # noqa: E402
from ttj_jax import numerics, training  # noqa: E402
from ttj_jax.kernels import flash_attention_bwd  # noqa: E402
from ttj_jax.params import init_params  # noqa: E402

# variant -> [(object, attribute, value)], the XLA options given to both programs' compilation
_SEPARATE = (training, "FUSED_QKV_ATTENTION", False)
_ZERO_ROWS = (training._flash_attention, "finite_rows", False)
_ERFC = (numerics, "gelu_erf", numerics.gelu_exact)
_FROM_2048 = (flash_attention_bwd, "MGPU_BACKWARD_MIN_SEQ_LEN", 2048)
VARIANTS: dict[str, tuple[list, dict]] = {
    "default": ([], {}),
    "before-f6ebade": ([_SEPARATE, _ZERO_ROWS, _ERFC, _FROM_2048], {}),
    "separate-qkv": ([_SEPARATE], {}),
    "zero-rows": ([_ZERO_ROWS], {}),
    "erfc-gelu": ([_ERFC], {}),
    "hopper-bwd-from-2048": ([_FROM_2048], {}),
    "ln-recompute": ([(numerics, "LAYER_NORM_KEEPS_STATISTICS", False)], {}),
    "cublas-gemms": ([], {"xla_gpu_enable_triton_gemm": False}),
    "bias-gelu": ([(numerics, "MLP_BIAS_IN_GELU", True)], {}),
    "cudnn-masked": ([(training, "MASKED_CUDNN", True)], {}),
    "dx32": ([(numerics, "DX_IN_INPUT_DTYPE", False)], {}),
    "weight-kn": ([(numerics, "WEIGHT_RESIDUAL_TRANSPOSED", False)], {}),
    "dqkv-stacked": ([(flash_attention_bwd, "GRADIENT_IN_PLACE", False)], {}),
    "ln-one-pass": ([(numerics, "LAYER_NORM_ONE_PASS", True)], {}),
    "ln-out32": ([(numerics, "LAYER_NORM_OUT_IN_GEMM_DTYPE", False)], {}),
    "ln-two-sums": ([(numerics, "LAYER_NORM_JOINT_PARAMETER_SUMS", False)], {}),
    "hopper-forward": ([(flash_attention_bwd, "VJP_FORWARD_IMPLEMENTATION", "auto")], {}),
    "generic-forward": ([(flash_attention_bwd, "VJP_FORWARD_IMPLEMENTATION", "generic")], {}),
    "mgpu-in-place": ([(flash_attention_bwd, "MGPU_BACKWARD_IN_PLACE", True)], {}),
    "mosaic-forward": ([(flash_attention_bwd, "VJP_FORWARD_IMPLEMENTATION", "mosaic")], {}),
    "forward-with-hopper-backward": ([(flash_attention_bwd, "VJP_FORWARD_WITH_HOPPER_BACKWARD", True)], {}),
    "mgpu-stacked": ([(flash_attention_bwd, "MGPU_BACKWARD_IN_PLACE", False)], {}),
    "bias-before-gelu": ([(numerics, "MLP_BIAS_IN_GELU", False)], {}),
    "inputs-in-residuals": ([(sys.modules[__name__], "KEEP_INPUTS_IN_RESIDUALS", True)], {}),
    "command-buffers-off": ([], {"xla_gpu_enable_command_buffer": ""}),
    "command-buffers-all": ([], {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
                                 "xla_gpu_graph_min_graph_size": 1}),
}
DISPATCH_CALLS = 30


@contextlib.contextmanager
def switched(settings):
    """The variant's switches set for the block, the previous values restored after."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in settings]
    try:
        for obj, name, value in settings:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


# Variant "inputs-in-residuals": the forward returns its whole pullback, the residuals that are its own inputs
# included (copied on the way out), as the bridge's forward did before training.Residuals.
KEEP_INPUTS_IN_RESIDUALS = False


def programs(config, on_gpu: bool, xla_options: dict):
    """(forward, backward) jitted: the bridge's training forward (forward(params, x, mask) -> (y,
    residuals)) and the application of its residuals (backward(residuals, (params, x, mask), dL/dy))."""
    options = dict(compiler_options=xla_options or None)
    attention = training.backward_attention()
    if KEEP_INPUTS_IN_RESIDUALS:
        def forward(params, x, mask):
            y, pull = training.forward_with_pullback(params, x, mask, config=config, on_gpu=on_gpu, attention=attention)
            return y.astype(jnp.float32), pull

        def apply(pull, grad_out):
            d_params, d_x = training.apply_pullback(pull, grad_out)
            return flat_gradients(d_params, config), d_x
        apply = jax.jit(apply, **options)
        return jax.jit(forward, **options), lambda pull, inputs, grad_out: apply(pull, grad_out)

    def forward(params, x, mask):
        y, residuals = training.forward_with_residuals(params, x, mask, config=config, on_gpu=on_gpu,
                                                       attention=attention)
        return y.astype(jnp.float32), residuals

    def apply(residuals, forwarded, grad_out):
        d_params, d_x = training.apply_residuals(residuals, forwarded, grad_out)
        return flat_gradients(d_params, config), d_x
    apply = jax.jit(apply, **options)
    return jax.jit(forward, **options), lambda residuals, inputs, grad_out: apply(
        residuals, residuals.forwarded(inputs), grad_out)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_config(config, variants: list[str], *, min_seconds: float, repeats: int) -> dict:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = init_params(keys[0], config)
    x = jax.random.normal(keys[1], (config.batch_size, config.seq_len, config.d_model), jnp.float32)
    mask = jnp.ones(x.shape[:2], bool)
    grad_out = jax.random.normal(keys[2], x.shape, jnp.float32) / x.size
    on_gpu = jax.default_backend() == "gpu"
    records, first = {}, None
    for name in variants:
        settings, xla_options = VARIANTS[name]
        try:
            with switched(settings):
                forward, backward = programs(config, on_gpu, xla_options)
                start = time.perf_counter()
                y, pull = forward(params, x, mask)
                outputs = jax.block_until_ready((y, *backward(pull, (params, x, mask), grad_out)))
                compile_s = time.perf_counter() - start
                forward_ms, _ = stream_ms_per_call(forward, (params, x, mask), min_seconds=min_seconds,
                                                   repeats=repeats)
                backward_ms, _ = stream_ms_per_call(backward, (pull, (params, x, mask), grad_out), min_seconds=min_seconds,
                                                    repeats=repeats)
                forward_us = drained_dispatch_us(forward, (params, x, mask), calls=DISPATCH_CALLS)
                backward_us = drained_dispatch_us(backward, (pull, (params, x, mask), grad_out), calls=DISPATCH_CALLS)
        except Exception as e:  # one variant that does not build must not end the others' measurement
            message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            records[name] = {"error": message}
            print(f"  {name:22s} failed: {message}", flush=True)
            continue
        del pull
        first = first or outputs
        records[name] = {"forward_ms": forward_ms, "backward_ms": backward_ms, "total_ms": forward_ms + backward_ms,
                         "forward_dispatch_us": forward_us, "backward_dispatch_us": backward_us,
                         "compile_s": compile_s,
                         "rel_l2_vs_first": dict(zip(("y", "d_params", "d_x"), map(_rel, outputs, first)))}
        errs = records[name]["rel_l2_vs_first"]
        print(f"  {name:22s} forward {forward_ms:7.3f} ms  backward {backward_ms:7.3f}  total "
              f"{forward_ms + backward_ms:7.3f}  dispatch {forward_us:5.0f}+{backward_us:5.0f} us   vs {variants[0]}: "
              f"y {errs['y']:.1e}, params "
              f"{errs['d_params']:.1e}, x {errs['d_x']:.1e}", flush=True)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.train_programs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None, help="config ids (default on a GPU: bert-base,8; on the CPU: cpu-2)")
    p.add_argument("--variants", default="default,before-f6ebade", help=f"comma-separated, of: {', '.join(VARIANTS)}")
    p.add_argument("--min-seconds", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    on_gpu = jax.default_backend() == "gpu"
    ids = (args.configs or ("bert-base,8" if on_gpu else "cpu-2")).split(",")
    shapes = find_configs(ids)
    if shapes is None:
        return 2
    name = jax.devices()[0].device_kind if on_gpu else "cpu"
    path = result_file("train-programs", name, args.out)
    document = {"device": name, **run_header("python3 -m bench.train_programs " + " ".join(
        sys.argv[1:] if argv is None else argv)), "configs": {}}
    for config_id in ids:
        print(f"{config_id}: {shapes[config_id].describe()}", flush=True)
        document["configs"][config_id] = run_config(shapes[config_id].config, variants,
                                                    min_seconds=args.min_seconds, repeats=args.repeats)
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
