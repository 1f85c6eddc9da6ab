"""A quick look at what the planner chooses and what it buys, config by config, on one GPU: the harness
baseline, the torch peer and ttj-jax through the bridge (measured planner on), one accuracy seed each and
the harness timing protocol. Shorter than `ttj-bench` (no 25 seeds, no JAX contender, no host sample):
for checking a planner change before a full run.

    PYTHONPATH=. python3 -m bench.planner_check --configs bert-base,gpt2-s4096,2,2@float16,13 [--out DIR]

A config is an id of any suite (ttj_jax.shapes.find), optionally `@float16` to run it with
the harness's --dtype float16. Writes planner-check-<date>-<gpu>.json (per config: times, peer/ttj,
failing elements, the first call's seconds and the plan's explanation) after every config.
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
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.paths import result_file, run_header  # noqa: E402
from bench.timing import time_contenders  # noqa: E402
from bench.torch_peer import build_peer  # noqa: E402


def check(shape: T.Shape, *, rounds: int, calls: int) -> dict:
    device = torch.device("cuda")
    harness_config = TransformerConfig(**vars(shape.config))
    dtype = getattr(torch, shape.dtype)
    baseline, ours = harness_models(harness_config, bridge.TTJTransformer, device=device, dtype=dtype)
    peer = build_peer(baseline, harness_config, device=device)
    x, mask = make_inputs(harness_config, 1234, device=device, dtype=dtype, padding_ratio=shape.padding)
    with torch.inference_mode():
        start = time.perf_counter()
        out = ours(x, mask)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        ref = baseline(x, mask)
        failed, worst = check_close(out, ref)
        peer_failed, _ = check_close(peer(x, mask), ref)
        del out, ref
        timed = time_contenders({"baseline": lambda: baseline(x, mask), "peer": lambda: peer(x, mask),
                                 "ttj_bridge": lambda: ours(x, mask)}, warmup=10, rounds=rounds, calls=calls,
                                device=device)
    record = {"config": vars(shape.config), "padding": shape.padding, "dtype": shape.dtype,
              "first_call_s": first, "failed_elements": failed, "worst_err_over_tol": worst,
              "peer_failed_elements": peer_failed, "plan": bridge.explain(ours, x, mask)}
    for name, result in timed.items():
        record[f"{name}_ms"] = result["median_ms"]
    record["peer_over_ttj"] = record["peer_ms"] / record["ttj_bridge_ms"]
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="bert-base,gpt2-s4096,2,2@float16,13")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("planner_check times on a CUDA GPU")
    torch.set_float32_matmul_precision("high")   # what the harness sets: TF32 baseline GEMMs
    gpu = torch.cuda.get_device_name()
    path = result_file("planner-check", gpu, args.out)
    document = {"gpu": gpu, **run_header("python -m bench.planner_check " + " ".join(
        sys.argv[1:] if argv is None else argv)), "configs": {}}
    for config_id in args.configs.split(","):
        record = check(T.shapes.find(config_id), rounds=args.rounds, calls=args.calls)
        document["configs"][config_id] = record
        print(f"{config_id:>18}: baseline {record['baseline_ms']:.4f} ms, peer {record['peer_ms']:.4f}, ttj "
              f"{record['ttj_bridge_ms']:.4f} (peer/ttj {record['peer_over_ttj']:.2f}), failing "
              f"{record['failed_elements']}, first call {record['first_call_s']:.1f} s", flush=True)
        print(f"{'':>20}{record['plan'][:400]}", flush=True)
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
        torch.cuda.empty_cache()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
