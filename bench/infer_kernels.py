"""Where the GPU time of one inference call goes, ttj through the bridge beside the torch peer, per config:
each contender's kernels by name (GPU us per call, launches per call), their total and the GPU span per call.

    PYTHONPATH=. python3 -m bench.infer_kernels [--configs gpt2-s4096,clip-text-s77] [--calls 10] [--no-peer] [--out DIR]

Per config (ids of the official, general or small suite): the harness's models and input (seed 0, the
config's padding), the peer built without its CUDA graph (so its kernels are seen one by one), five warm
calls each, then `--calls` calls under torch.profiler (bench/cuda_trace.py). A kernel that ttj runs and the
peer does not (a pad, a slice, a conversion) is where ttj's call loses time to the peer's. `--no-peer` times
ttj alone (no torch.compile per config): for comparing ttj's own variants, each run in its own process with
the bridge's settings (TTJ_POLICY, XLA_FLAGS, ...) in its environment. CUDA only.
Writes <out>/infer-kernels-<date>-<gpu>.json: {"configs": {id: {"ttj": table, "peer": table}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

import bridge  # noqa: E402
from bench.baseline import TransformerConfig, harness_models, make_inputs  # noqa: E402
from bench.cuda_trace import kernel_table, profile_cuda  # noqa: E402
from bench.paths import find_configs, result_file, run_header, settings_environment  # noqa: E402
from bench.torch_peer import build_peer  # noqa: E402
from ttj_jax.shapes import find  # noqa: E402

DEFAULT_CONFIGS = "gpt2-s4096,clip-text-s77,dec-l8-d256-hd128,enc-s128-pad70"


def tables(config_id: str, calls: int, top: int = 22, peer: bool = True) -> dict:
    shape = find(config_id)
    config = TransformerConfig(**vars(shape.config))
    baseline, ttj = harness_models(config, bridge.TTJTransformer, device="cuda")
    x, mask = make_inputs(config, 0, padding_ratio=shape.padding, device="cuda")
    record = {"config": vars(shape.config), "padding": shape.padding}
    contenders = [("ttj", lambda: ttj(x, mask))]
    if peer:
        peer_model = build_peer(baseline, config, device="cuda", cuda_graph=False)
        contenders.append(("peer", lambda: peer_model(x, mask)))
    for name, fn in contenders:
        with torch.no_grad():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            record[name] = kernel_table(profile_cuda(fn, calls), calls, top=top)
    record["ttj_plan"] = bridge.explain(ttj, x, mask)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.infer_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--no-peer", action="store_true", help="ttj alone (no peer compiled)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.infer_kernels: no CUDA device here (torch.profiler's kernel records need one)", file=sys.stderr)
        return 2
    ids = args.configs.split(",")
    if find_configs(ids) is None:
        return 2
    gpu = torch.cuda.get_device_name()
    path = result_file("infer-kernels", gpu, args.out)
    document = {"device": gpu, **run_header("python3 -m bench.infer_kernels " + " ".join(
        sys.argv[1:] if argv is None else argv)), "calls": args.calls,
        "environment": settings_environment("XLA_FLAGS"), "configs": {}}
    for config_id in ids:
        record = document["configs"][config_id] = tables(config_id, args.calls, peer=not args.no_peer)
        for name in [n for n in ("ttj", "peer") if n in record]:
            t = record[name]
            print(f"== {config_id} {name}: kernels {t['kernel_us_per_call']:.1f} us, span {t['span_us_per_call']:.1f} us")
            if name == "ttj":
                print(f"   plan: {record['ttj_plan'][:300]}")
            for row in t["kernels"]:
                print(f"   {row['us_per_call']:8.1f} x{row['launches_per_call']:4.1f}  {row['kernel'][:110]}")
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
