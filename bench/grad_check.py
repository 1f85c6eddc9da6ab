"""Gradients through the bridge against the harness baseline's own autograd, on the device: relative L2
error of dL/dx and of every parameter's gradient, for a few configs, masks included.

    PYTHONPATH=. python3 -m bench.grad_check [--configs 1,13,bert-base] [--padding 0.3] [--seeds 3] [--out DIR]

Configs are ids of the official or general suite. Seed i draws its own weights (torch seed i), input
(harness seed 1234 + i) and cotangent; a config's record keeps the worst seed's numbers and each seed's
worst error. Writes grad-check-<date>-<gpu>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import bridge  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import TransformerConfig, harness_models, make_inputs  # noqa: E402
from bench.paths import result_file, run_header  # noqa: E402
from bench.train import compare_gradients, gradients  # noqa: E402


def check(shape: T.Shape, padding: float, device: torch.device, seed: int = 0) -> dict:
    harness_config = TransformerConfig(**vars(shape.config))
    base, ours = harness_models(harness_config, bridge.TTJTransformer, device=device, seed=seed)
    x, mask = make_inputs(harness_config, 1234 + seed, padding_ratio=padding, device=device)
    weights = torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(seed), device=device)
    reference = gradients(base, base, x, mask, weights, reduce=torch.sum)
    start = time.perf_counter()
    mine = gradients(ours, ours, x, mask, weights, reduce=torch.sum)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    seconds = time.perf_counter() - start
    return {"config": vars(shape.config), "padding": padding, **compare_gradients(mine, reference),
            "first_forward_backward_s": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1,13,bert-base")
    p.add_argument("--padding", type=float, default=0.3)
    p.add_argument("--seeds", type=int, default=1, help="seeds per config (weights, input, cotangent)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest")   # the reference gradients in full fp32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    path = result_file("grad-check", name, args.out)
    document = {"device": name, **run_header("python -m bench.grad_check " + " ".join(
        sys.argv[1:] if argv is None else argv)), "configs": {}}
    for config_id in args.configs.split(","):
        records = [check(T.shapes.find(config_id), args.padding, device, seed) for seed in range(args.seeds)]
        record = dict(max(records, key=lambda r: r["max_rel_grad_err"]), seeds=args.seeds,
                      max_rel_grad_err_per_seed=[r["max_rel_grad_err"] for r in records])
        document["configs"][config_id] = record
        print(f"{config_id}: max relative L2 error {record['max_rel_grad_err']:.2e} ({record['worst_tensor']}), "
              f"forward+backward {record['first_forward_backward_s']:.1f} s", flush=True)
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
