"""The training benchmark (`ttj-bench --suite train`, or `python -m bench.train`): one optimizer step
(forward, backward, SGD update; the fused SGD for every contender) per call, timed the harness's
way, for three contenders on the same weights and input:

  eager  the harness baseline module trained in eager PyTorch (TF32 GEMMs on CUDA, as the harness sets)
  peer   the torch peer's training step: the same module with its attention through
         `scaled_dot_product_attention` (no mask tensor when every token is valid, read on the host once
         per mask tensor and version), GEMMs under autocast,
         `torch.compile`d (CUDA only); in float16 (the default, --peer-autocast) with torch's recipe, a
         GradScaler (without one the gradients, ~1/numel of the loss's, underflow in fp16), whose factors
         the fused SGD takes without a host sync
  ttj    ttj-jax through the bridge (`bridge.TTJTransformer`, in training mode): the layers' XLA
         program under jax.vjp, its residuals kept for the backward (bridge/autograd.py)

Gradients: one backward of each contender on a fixed input, every tensor (x and each parameter)
against the fp32 baseline's autograd as relative L2 error; `max_rel_grad_err` is the worst tensor,
leaving out the key projection's bias, whose gradient is zero in exact arithmetic (reported apart).

    PYTHONPATH=. python3 -m bench.train [--configs 1,8,13,bert-base,gpt2-s4096] [--out DIR]

Writes train-<date>-<gpu>.json: {"configs": {id: {eager_ms, peer_ms, ttj_ms, max_rel_grad_err, ...}}}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Callable
from typing import NamedTuple
from unittest import mock

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bridge  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench import switches  # noqa: E402
from bench.baseline import Attention, TransformerConfig, harness_models, make_inputs  # noqa: E402
from bench.paths import find_configs, result_file, run_header  # noqa: E402
from bench.timing import time_contenders  # noqa: E402
from bench.torch_peer import VersionedRead, raise_call_time_recompile_limit  # noqa: E402
from bridge.autograd import TRAINING_MASK_ENV, TRAINING_MASK_READS, ZERO_GRADIENT_SUFFIX  # noqa: E402
from ttj_jax.training import BACKWARD_ATTENTION_ENV, BACKWARD_ATTENTIONS  # noqa: E402

DEFAULT_CONFIGS = "1,8,13,bert-base,gpt2-s4096"
LEARNING_RATE = 1e-4
PEER_AUTOCAST = {"float16": torch.float16, "bfloat16": torch.bfloat16}
PEER_LOSS_SCALE = 2.0 ** 16   # the float16 peer's (GradScaler's initial scale)


class SdpaAttention(Attention):
    """The baseline's attention, same parameters, through scaled_dot_product_attention."""

    def forward(self, x, valid_token_mask=None):
        B, S, d = x.shape
        split = lambda t: t.view(B, S, self.num_heads, self.head_dim).transpose(1, 2)   # noqa: E731
        q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        if valid_token_mask is None:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            allowed = valid_token_mask[:, None, None, :]
            if self.causal:
                allowed = allowed & torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            # a query with no allowed key would give NaN: let it see every key (its row is zeroed anyway)
            allowed = allowed | ~allowed.any(-1, keepdim=True)
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out = self.out_proj(context.transpose(1, 2).reshape(B, S, d))
        if valid_token_mask is not None:
            out = out.masked_fill(~valid_token_mask[:, :, None], 0.0)
        return out


class Peer(NamedTuple):
    module: torch.nn.Module
    forward: Callable
    loss_scale: float | None   # float16: the GradScaler's initial scale; bfloat16: None
    mask_reads: VersionedRead  # its all-valid test, read once per mask tensor and version


def peer_model(baseline: torch.nn.Module, device: torch.device, autocast: str = "float16") -> Peer:
    """The peer's trainable module: a copy of the baseline with SDPA attention, its forward under
    autocast to `autocast` (float16 or bfloat16), and on CUDA torch.compile."""
    model = copy.deepcopy(baseline)
    for layer in model.layers:
        layer.attention.__class__ = SdpaAttention
    if device.type == "cuda":
        # Every config's peer shares the baseline forward's compiled variants (one per config, mask kind
        # and allow_tf32 state): past Dynamo's default limit of 8 the later configs' peers ran eager.
        raise_call_time_recompile_limit()
    compiled = torch.compile(model) if device.type == "cuda" else model

    all_valid = VersionedRead(lambda mask: bool(mask.all()))

    def forward(x, mask):
        # At its strongest: SDPA's flash path, no mask tensor, where every token is valid; the mask read
        # on the host once per tensor and version, not a host sync every step.
        if mask is not None and all_valid(mask):
            mask = None
        with torch.autocast(device.type, dtype=PEER_AUTOCAST[autocast]):
            return compiled(x, mask).float()
    return Peer(model, forward, PEER_LOSS_SCALE if autocast == "float16" else None, all_valid)


def step_fn(module, forward, x, mask, weights, *, loss_scale: float | None = None):
    """One optimizer step per call, with the same optimizer for every contender: the fused SGD (one kernel
    for all parameters). With loss_scale, torch's mixed-precision recipe: a GradScaler from that scale,
    whose factors the fused SGD applies on the device (no host sync)."""
    cuda = next(module.parameters()).is_cuda
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE, fused=True)
    if loss_scale is None:
        def step():
            optimizer.zero_grad(set_to_none=True)
            (forward(x, mask) * weights).mean().backward()
            optimizer.step()
        return step
    scaler = torch.amp.GradScaler("cuda" if cuda else "cpu", init_scale=loss_scale)

    def scaled_step():
        optimizer.zero_grad(set_to_none=True)
        scaler.scale((forward(x, mask) * weights).mean()).backward()
        scaler.step(optimizer)
        scaler.update()
    return scaled_step


def gradients(model: torch.nn.Module, forward, x, mask, weights, *, reduce=torch.mean,
              loss_scale: float | None = None) -> dict:
    """{"x": dL/dx, parameter name: its gradient} for L = reduce(forward(x, mask) * weights); with
    loss_scale, backward from L * loss_scale and every gradient divided by it (a GradScaler's arithmetic)."""
    model.zero_grad(set_to_none=True)
    x_in = x.clone().requires_grad_(True)
    loss = reduce(forward(x_in, mask) * weights)
    (loss if loss_scale is None else loss * loss_scale).backward()
    grads = {"x": x_in.grad, **{name: p.grad for name, p in model.named_parameters()}}
    return grads if loss_scale is None else {name: g / loss_scale for name, g in grads.items()}


def compare_gradients(ours: dict, reference: dict) -> dict:
    """Relative L2 error of each of `ours` against `reference` (gradients(...) of both), the worst tensor,
    and, apart, the norms of the key projection's bias gradients (zero in exact arithmetic)."""
    errors, zero_bias = {}, {}
    for name, ref in reference.items():
        mine = ours[name]
        if name.endswith(ZERO_GRADIENT_SUFFIX):
            zero_bias[name] = {"ours_norm": float(mine.norm()), "baseline_norm": float(ref.norm())}
            continue
        errors[name] = float((mine.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    worst = max(errors, key=errors.get)
    return {"max_rel_grad_err": errors[worst], "worst_tensor": worst, "rel_l2": errors,
            "zero_gradient_bias": zero_bias}


def gradient_errors(reference: torch.nn.Module, contender: torch.nn.Module, forward, x, mask, weights, *,
                    loss_scale: float | None = None) -> dict:
    """compare_gradients of a contender against the fp32 reference's autograd."""
    return compare_gradients(gradients(contender, forward, x, mask, weights, loss_scale=loss_scale),
                             gradients(reference, reference, x, mask, weights))


def with_env(fn, name: str, value: str):
    """fn run with os.environ[name] = value, restored after."""
    def run():
        with mock.patch.dict(os.environ, {name: value}):
            return fn()
    return run


def run_config(shape: T.Shape, device: torch.device, *, warmup: int, rounds: int, calls: int,
               breakdown: bool = False, variants: tuple[tuple[str, str, str], ...] = (), kernels: bool = False,
               peer_autocast: str = "float16") -> dict:
    """One config's gradients and step times. variants: (contender name, environment variable, value):
    more ttj contenders, each with that variable set for its gradients and its steps."""
    harness_config = TransformerConfig(**vars(shape.config))
    baseline, ours = harness_models(harness_config, bridge.TTJTransformer, device=device)
    baseline.train(), ours.train()
    reference = copy.deepcopy(baseline)   # the fp32 autograd reference, never stepped
    x, mask = make_inputs(harness_config, 1234, padding_ratio=shape.padding, device=device)
    weights = torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(0), device=device)
    peer = peer_model(baseline, device, peer_autocast)
    record = {"config": vars(shape.config), "padding": shape.padding}
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")   # the reference's gradients in full fp32
    try:
        record["ttj"] = gradient_errors(reference, ours, ours, x, mask, weights)
        record["peer"] = gradient_errors(reference, peer.module, peer.forward, x, mask, weights,
                                         loss_scale=peer.loss_scale)
        for name, variable, value in variants:
            record[name] = with_env(lambda: gradient_errors(reference, ours, ours, x, mask, weights), variable, value)()
    finally:
        torch.set_float32_matmul_precision(precision)
    record["max_rel_grad_err"] = record["ttj"]["max_rel_grad_err"]
    steps = {"eager": step_fn(baseline, baseline, x, mask, weights),
             "peer": step_fn(peer.module, peer.forward, x, mask, weights, loss_scale=peer.loss_scale),
             "ttj": step_fn(ours, ours, x, mask, weights)}
    for name, variable, value in variants:
        steps[name] = with_env(step_fn(ours, ours, x, mask, weights), variable, value)
    start = time.perf_counter()
    timed = time_contenders(steps, warmup=warmup, rounds=rounds, calls=calls, device=device)
    record["timing_s"] = time.perf_counter() - start
    for name, result in timed.items():
        record[f"{name}_ms"] = result["median_ms"]
    record["peer_over_ttj"] = record["peer_ms"] / record["ttj_ms"]
    if breakdown:
        record["breakdown"] = step_breakdown(baseline, ours, peer, x, mask, weights, device,
                                             warmup=warmup, rounds=rounds, calls=calls, kernels=kernels)
    return record


# Rows of ttj's kernel tables with --kernels, each joined with its HLO instruction (bench/hlo_table.py).
KERNEL_ROWS = 40


def step_breakdown(baseline, ours, peer: Peer, x, mask, weights, device, *, warmup, rounds,
                   calls, kernels: bool = False) -> dict:
    """Where a training step's time goes: each contender's forward alone in grad mode (the residuals it
    keeps are freed with its output), the step's host time per call, ttj's two jax programs alone
    (the forward keeping residuals, and applying them) in a JAX loop, without the bridge, and the size
    of those residuals (ttj_residual_mb); with `kernels`,
    on CUDA, the kernel table (bench.cuda_trace) of those two programs, each row of theirs with its HLO
    instruction's bytes, bandwidth and op mix (bench.hlo_table), and of the peer's step."""
    import jax

    from bench.jax_timing import stream_ms_per_call
    from bench.timing import interleaved_host_overhead_us
    from bridge.autograd import apply_program, forward_program, jax_inputs, training_mask
    from ttj_jax.programs import model_key
    from ttj_jax.training import backward_attention
    forwards = {"ttj_forward": lambda: ours(x, mask), "peer_forward": lambda: peer.forward(x, mask),
                "eager_forward": lambda: baseline(x, mask)}
    timed = time_contenders(forwards, warmup=warmup, rounds=rounds, calls=calls, device=device)
    out = {f"{name}_ms": result["median_ms"] for name, result in timed.items()}
    steps = {"ttj": step_fn(ours, ours, x, mask, weights),
             "peer": step_fn(peer.module, peer.forward, x, mask, weights, loss_scale=peer.loss_scale)}
    host = interleaved_host_overhead_us(steps, 20, device=device)
    out.update({f"{name}_step_host_us": result["median_us"] for name, result in host.items()})
    config, params = bridge.runtime.harness_parameters(ours, None)
    _, to_jax, jparams, jmask = jax_inputs(x, training_mask(mask), list(params), config)
    on_gpu = device.type == "cuda"
    forward = forward_program(model_key(config), on_gpu, backward_attention())
    jx = to_jax(x)
    y, residuals = forward(jparams, jx, jmask)
    out["ttj_residual_mb"] = sum(leaf.nbytes for leaf in jax.tree.leaves(residuals) if hasattr(leaf, "nbytes")) / 1e6
    apply = apply_program(model_key(config))
    g = to_jax(weights / weights.numel())
    apply_args = (residuals, residuals.forwarded((jparams, jx, jmask)), g)
    out["jax_forward_ms"], _ = stream_ms_per_call(forward, (jparams, jx, jmask), min_seconds=0.2, repeats=3)
    out["jax_backward_ms"], _ = stream_ms_per_call(apply, apply_args, min_seconds=0.2, repeats=3)
    if kernels and device.type == "cuda":   # where the GPU time of each goes, per kernel
        from bench.cuda_trace import kernel_table, profile_cuda
        from bench.hlo_table import annotate
        forward_text = forward.lower(jparams, jx, jmask).compile().as_text()
        apply_text = apply.lower(*apply_args).compile().as_text()
        out["kernels"] = {
            "jax_forward": annotate(kernel_table(profile_cuda(lambda: forward(jparams, jx, jmask), calls=5), calls=5,
                                                 top=KERNEL_ROWS), forward_text),
            "jax_backward": annotate(kernel_table(profile_cuda(lambda: jax.block_until_ready(apply(*apply_args)), calls=5),
                                                  calls=5, top=KERNEL_ROWS), apply_text),
            "peer_step": kernel_table(profile_cuda(steps["peer"], calls=5), calls=5)}
    return out


def set_attention_kernels(choice: str) -> None:
    """--attention-kernels: the masked training path's flash attention kernels, set before anything is
    traced (they are read when a program is traced, so for the whole process)."""
    from ttj_jax.kernels import flash_attention_bwd as fab  # noqa: PLC0415
    if choice == "generic":
        fab.MGPU_BACKWARD_DISPATCH, fab.VJP_FORWARD_IMPLEMENTATION = False, "generic"
    elif choice == "hopper":
        fab.MGPU_BACKWARD_DISPATCH, fab.VJP_FORWARD_IMPLEMENTATION = True, "auto"


def attention_kernels() -> dict:
    from ttj_jax.kernels import flash_attention_bwd as fab  # noqa: PLC0415
    return {"mgpu_backward_dispatch": fab.MGPU_BACKWARD_DISPATCH,
            "vjp_forward_implementation": fab.VJP_FORWARD_IMPLEMENTATION}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ttj-bench --suite train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None, help=f"ids of the official, general or small suite "
                                                   f"(default on CUDA: {DEFAULT_CONFIGS}; on the CPU: cpu-2)")
    p.add_argument("--device", default="auto")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=None, help="calls per round (default 20 on CUDA, 2 on the CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--breakdown", action="store_true",
                   help="also time each forward alone, the steps' host time and ttj's jax programs alone")
    p.add_argument("--kernels", action="store_true",
                   help="with --breakdown on CUDA: the kernel table of ttj's two jax programs and the peer's step")
    p.add_argument("--mask-reads", default="",
                   help=f"also time ttj with {TRAINING_MASK_ENV} set to each of these "
                        f"({', '.join(TRAINING_MASK_READS)}), as contenders ttj_mask_<read>")
    p.add_argument("--attention-kernels", choices=("default", "generic", "hopper"), default="default",
                   help="the masked training path's flash attention (kernels/flash_attention_bwd.py), for the "
                        "whole process: 'generic' both ways, 'hopper' the Hopper kernels forward and backward "
                        "where they apply, 'default' as shipped")
    p.add_argument("--backward-attentions", default="",
                   help=f"also time ttj with {BACKWARD_ATTENTION_ENV} set to each of these "
                        f"({', '.join(BACKWARD_ATTENTIONS)}), as contenders ttj_attention_<kind>")
    p.add_argument("--peer-autocast", choices=tuple(PEER_AUTOCAST), default="float16",
                   help="the peer's autocast dtype: float16 with a GradScaler (torch's recipe), or bfloat16")
    p.add_argument("--switch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a module switch for the run (bench/switches.py); repeatable; recorded in the JSON")
    args = p.parse_args(argv)
    try:
        switched = switches.apply(args.switch)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    set_attention_kernels(args.attention_kernels)

    def listed(option: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:   # comma-separated
        values = tuple(v for v in text.split(",") if v)
        if any(v not in allowed for v in values):
            p.error(f"{option} takes {', '.join(allowed)}")
        return values
    variants = (tuple((f"ttj_mask_{read}", TRAINING_MASK_ENV, read)
                      for read in listed("--mask-reads", args.mask_reads, TRAINING_MASK_READS))
                + tuple((f"ttj_attention_{kind}", BACKWARD_ATTENTION_ENV, kind)
                        for kind in listed("--backward-attentions", args.backward_attentions, BACKWARD_ATTENTIONS)))
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    on_cuda = device.type == "cuda"
    if on_cuda:   # the harness's settings for the eager contender
        torch.set_float32_matmul_precision("high")
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    ids = (args.configs or (DEFAULT_CONFIGS if on_cuda else "cpu-2")).split(",")
    shapes = find_configs(ids)
    if shapes is None:
        return 2
    path = result_file("train", name, args.out)
    document = {"device": name, **run_header("ttj-bench --suite train " + " ".join(
        sys.argv[1:] if argv is None else argv)), "attention_kernels": attention_kernels(), "peer_autocast": args.peer_autocast,
        "switches": switched, "configs": {}}
    for config_id in ids:
        print(f"{config_id}: {shapes[config_id].describe()}", flush=True)
        record = run_config(shapes[config_id], device, warmup=args.warmup, rounds=args.rounds,
                            calls=args.calls or (20 if on_cuda else 2), breakdown=args.breakdown,
                            variants=variants, kernels=args.kernels, peer_autocast=args.peer_autocast)
        document["configs"][config_id] = record
        print(f"  eager {record['eager_ms']:.3f} ms, peer {record['peer_ms']:.3f}, ttj {record['ttj_ms']:.3f} "
              f"(peer/ttj {record['peer_over_ttj']:.2f}); worst gradient error {record['max_rel_grad_err']:.1e} "
              f"({record['ttj']['worst_tensor']}), the peer's {record['peer']['max_rel_grad_err']:.1e}", flush=True)
        for contender, variable, value in variants:   # `name` is the device's
            print(f"  ttj with {variable}={value}: {record[f'{contender}_ms']:.3f} ms, worst gradient "
                  f"error {record[contender]['max_rel_grad_err']:.1e}", flush=True)
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
