"""Where the bridge's training step spends host time, part by part, per config, beside its GPU time.

    PYTHONPATH=. python3 -m bench.train_host [--configs gpt2-s4096,1] [--calls 100] [--out DIR]
                                             [--device cpu]   (a smoke run)

Per config: the module built and put in training mode as bench.train builds it, the harness's mask, the
fused SGD of bench.train.step_fn, a few warm steps. Each part is sampled with the GPU drained before the
sample (a part's setup, where it has one, runs before the drain, untimed); the parts' samples are
interleaved in a fresh shuffled order per round (bench.timing.interleaved_host_overhead_us says why).
Median microseconds of host time:

    step         one training step: zero_grad, forward, loss, backward, optimizer step
    forward      the module's call in grad mode (y, its residuals kept until y is freed)
    inputs       bridge.autograd.jax_inputs: the ordering after torch's stream, the imports of x and the mask,
                 the kept parameter tree
    forward_jax  the training forward program's dispatch alone, on inputs imported once
    export_y     y's export to torch
    backward     loss.backward() after an untimed forward and loss
    apply_jax    the pullback program's dispatch alone, on a kept pullback
    to_torch     the export of its outputs and the parameters' gradient views (gradients_to_torch)
    optimizer    the fused SGD step alone

plus b2b_step_us (the mean host time of 50 steps back to back), gpu_step_us (CUDA events around
back-to-back steps, bench.timing.time_contenders), host_over_gpu = step / gpu_step_us, and the number of
arrays the two programs take and return (jax's dispatch costs per array). A part's drained time includes
any wait for the GPU inside it: a part well above its share points at a sync as much as at host work.
Writes <out>/train-host-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
from bench.baseline import TransformerConfig, harness_models, make_inputs  # noqa: E402
from bench.host_overhead import HOST_OVER_GPU_TARGET  # noqa: E402
from bench.paths import find_configs, result_file, run_header  # noqa: E402
from bench.timing import time_contenders  # noqa: E402
from bench.train import LEARNING_RATE, step_fn  # noqa: E402
from bridge import runtime  # noqa: E402
from bridge.autograd import apply_program, forward_program, gradients_to_torch, jax_inputs, training_mask  # noqa: E402
from ttj_jax.programs import model_key  # noqa: E402
from ttj_jax.shapes import find  # noqa: E402
from ttj_jax.training import backward_attention  # noqa: E402


def drained_samples_us(parts: dict, calls: int, sync) -> dict[str, float]:
    """parts: name -> (setup or None, fn taking setup's result). Median us of fn per part, the GPU drained
    (sync) after the setup and before each timed call; the parts interleaved, shuffled per round."""
    samples = {name: [] for name in parts}
    shuffler = random.Random(0)
    for _ in range(calls):
        order = list(parts)
        shuffler.shuffle(order)
        for name in order:
            setup, fn = parts[name]
            arg = setup() if setup is not None else None
            sync()
            start = time.perf_counter()
            fn(arg)
            samples[name].append((time.perf_counter() - start) * 1e6)
            del arg
    sync()
    return {name: statistics.median(s) for name, s in samples.items()}


def training_parts(module, x: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> tuple[dict, dict]:
    """The parts of the module docstring, and the programs' array counts."""
    step = step_fn(module, module, x, mask, weights)
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE, fused=x.is_cuda)
    config, params, tree = runtime.training_parameters(module)
    transfer, to_jax, jparams, jmask = jax_inputs(x, training_mask(mask), params, config, tree)
    jx = to_jax(x)
    key = model_key(config)
    forward = forward_program(key, x.is_cuda, backward_attention())
    apply = apply_program(key)
    y, residuals = forward(jparams, jx, jmask)
    forwarded = residuals.forwarded((jparams, jx, jmask))
    grad_out = to_jax(weights / weights.numel())
    jax.block_until_ready(residuals)

    def loss():
        return (module(x, mask) * weights).mean()

    def outputs():
        return jax.block_until_ready(apply(residuals, forwarded, grad_out))
    parts = {
        "step": (None, lambda _: step()),
        "forward": (None, lambda _: module(x, mask)),
        "inputs": (None, lambda _: jax_inputs(x, training_mask(mask), params, config,
                                               runtime.training_parameters(module)[2])),
        "forward_jax": (None, lambda _: forward(jparams, jx, jmask)),
        "export_y": (None, lambda _: transfer.to_torch(y)),
        "backward": (loss, lambda value: value.backward()),
        "apply_jax": (None, lambda _: apply(residuals, forwarded, grad_out)),
        "to_torch": (outputs, lambda out: gradients_to_torch(transfer, *out, x, params)),
        "optimizer": (None, lambda _: optimizer.step()),
    }
    kept = len(jax.tree.leaves(residuals))
    arrays = {"forward_inputs": len(jax.tree.leaves((jparams, jx, jmask))), "forward_outputs": 1 + kept,
              "forwarded": len(forwarded),
              "apply_inputs": kept + len(forwarded) + 1, "apply_outputs": 2}
    return parts, arrays


def run_config(config_id: str, device: torch.device, calls: int) -> dict:
    shape = find(config_id)
    config = TransformerConfig(**vars(shape.config))
    _, module = harness_models(config, bridge.TTJTransformer, device=device)
    module.train()
    x, mask = make_inputs(config, 1234, padding_ratio=shape.padding, device=device)
    weights = torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(0), device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    parts, arrays = training_parts(module, x, mask, weights)
    step = parts["step"][1]
    for _ in range(5):
        step(None)
    medians = drained_samples_us(parts, calls, sync)
    sync()
    start = time.perf_counter()
    for _ in range(50):
        step(None)
    b2b = (time.perf_counter() - start) / 50 * 1e6
    sync()
    gpu_ms = time_contenders({"step": lambda: step(None)}, warmup=3, rounds=3, calls=10,
                             device=device)["step"]["median_ms"]
    record = {"config": vars(shape.config), "padding": shape.padding,
              **{f"{name}_us": round(value, 1) for name, value in medians.items()},
              "b2b_step_us": round(b2b, 1), "gpu_step_us": round(gpu_ms * 1e3, 1),
              "host_over_gpu": round(medians["step"] / (gpu_ms * 1e3), 3), "arrays": arrays}
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.train_host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None, help="config ids (default on a GPU: gpt2-s4096,1; on the CPU: cpu-2)")
    p.add_argument("--calls", type=int, default=100, help="drained samples per part")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke run")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.train_host: no CUDA device here (--device cpu runs the CPU path)", file=sys.stderr)
        return 2
    ids = (args.configs or ("gpt2-s4096,1" if device.type == "cuda" else "cpu-2")).split(",")
    if find_configs(ids) is None:
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    path = result_file("train-host", name, args.out)
    document = {"device": name, **run_header("python3 -m bench.train_host " + " ".join(
        sys.argv[1:] if argv is None else argv)), "calls": args.calls, "configs": {}}
    for config_id in ids:
        record = document["configs"][config_id] = run_config(config_id, device, args.calls)
        shown = " ".join(f"{k.removesuffix('_us')}={v}" for k, v in record.items() if k.endswith("_us"))
        print(f"{config_id}: {shown} host/GPU {record['host_over_gpu']}", flush=True)
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
    over = [c for c, r in document["configs"].items() if r["host_over_gpu"] >= HOST_OVER_GPU_TARGET]
    print(f"host/GPU >= {HOST_OVER_GPU_TARGET}: {over or 'none'}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
