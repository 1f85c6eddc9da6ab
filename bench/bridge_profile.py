"""Where a bridge call's time goes, step by step (GPU): the ablation behind issue 4's bridge-cost target.

For each shape: host time (perf_counter, no sync inside the span) of each step of the bridge's hot path
taken alone, median and p90 over many calls, then the whole call timed as the harness does (CUDA events
on torch's stream), then JAX-direct dispatch for the same program, and a jitted no-op with 1 and with
50 array arguments (the cost of argument count in jax's dispatch).

    python -m bench.bridge_profile [--shapes 2,7,1] [--out bench/results]

Run it in several processes with different XLA_FLAGS to compare runtime settings (see --label).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import BaselineTransformer, TransformerConfig, copy_model_weights, make_inputs  # noqa: E402
from bench.timing import time_contenders  # noqa: E402
from bridge import runtime  # noqa: E402


def host_us(fn, calls=300, warmup=30, drained=False):
    """Host microseconds per call of fn (perf_counter, no sync inside the span). Back to back (default),
    a GPU-bound call's host time shows the GPU's pace once jax's queue is full; drained=True syncs the
    GPU before each sample, so each call is timed from an idle GPU (the official run's bridge_host_us)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        if drained:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return {"median_us": statistics.median(samples), "p90_us": float(np.percentile(samples, 90)),
            "p10_us": float(np.percentile(samples, 10))}


def profile_shape(sid: str) -> dict:
    config = T.OFFICIAL[sid].config
    hc = TransformerConfig(**vars(config))
    torch.manual_seed(0)
    base = BaselineTransformer(hc)
    ours = bridge.TTJTransformer(hc)
    copy_model_weights(base, ours)
    ours = ours.cuda().eval()
    x, mask = make_inputs(hc, 1234, device="cuda")
    out = {}
    with torch.inference_mode():
        ours(x, mask)
        state = runtime._STATES[ours]
        call = next(iter(state.calls.values()))
        # the weights the plan's program takes: the fused kernel's own layout for a fused plan
        weights_of = (lambda: state.kernel_jax_weights(call.plan.stack)) if call.plan.stack in (
            "fused", "fused_mgpu", "rows") else (lambda: state.weights(call.plan.policy))
        weights = weights_of()
        transfer = call.transfer
        jx = transfer.to_jax(x)
        y = call.run(weights, jx, None)
        keep = []
        out["step_weights_check"] = host_us(weights_of)
        out["step_classify_mask"] = host_us(lambda: state.classify(mask))
        out["step_import_x"] = host_us(lambda: (transfer.order_before_jax(), transfer.to_jax(x)))
        out["step_dispatch"] = host_us(lambda: call.run(weights, jx, None))
        out["step_export"] = host_us(lambda: transfer.to_torch(y))
        out["step_export_and_free"] = host_us(lambda: keep.append(transfer.to_torch(call.run(weights, jx, None)))
                                              or keep.clear())
        # Variants that isolate costs (next experiments): freeing the previous output, the public export,
        # the protocol import, and whether jax can write straight into a torch-owned (donated) buffer.
        ring = []
        out["step_export_keep_4"] = host_us(lambda: ring.append(transfer.to_torch(call.run(weights, jx, None)))
                                            or (len(ring) > 4 and ring.pop(0)))
        out["step_export_public_and_free"] = host_us(lambda: torch.from_dlpack(call.run(weights, jx, None)))
        out["step_import_protocol"] = host_us(lambda: transfer.importer(x))
        out["donation_into_torch_buffer"] = donation_probe(x, transfer)
        # The same steps from an idle GPU: where the bridge's extra host time goes on GPU-bound shapes
        # (8, 13: +151 us over the JAX call in official-2026-11-30-h200-session5.json), which the
        # back-to-back numbers above cannot show.
        drained = {"import_x": lambda: (transfer.order_before_jax(), transfer.to_jax(x)),
                   "dispatch": lambda: call.run(weights, jx, None),
                   "dispatch_export_free": lambda: transfer.to_torch(call.run(weights, jx, None)),
                   "bridge_call": lambda: ours(x, mask)}
        for name, fn in drained.items():
            out[f"drained_{name}"] = host_us(fn, calls=100, warmup=10, drained=True)
        out["bridge_call_host"] = host_us(lambda: ours(x, mask))
        out["bridge_call_no_mask_host"] = host_us(lambda: ours(x, None))
        out["torch_add_host"] = host_us(lambda: x + 1)
        timed = time_contenders({"bridge": lambda: ours(x, mask), "bridge_no_mask": lambda: ours(x, None),
                                 "jax_dispatch_plus_export": lambda: transfer.to_torch(call.run(weights, jx, None)),
                                 "torch_add": lambda: x + 1}, warmup=20, rounds=3, calls=100, device="cuda")
        out["events_ms"] = {k: v["median_ms"] for k, v in timed.items()}
        out["events_p10_ms"] = {k: v["p10_ms"] for k, v in timed.items()}
        out["num_weight_leaves"] = len(jax.tree_util.tree_leaves(weights))
        out["plan"] = call.plan.explain()
        # GPU time of the program alone: many back-to-back calls, one sync.
        jax.block_until_ready(call.run(weights, jx, None))
        t0 = time.perf_counter()
        for _ in range(200):
            r = call.run(weights, jx, None)
        jax.block_until_ready(r)
        out["jax_loop_per_call_us"] = (time.perf_counter() - t0) / 200 * 1e6
    return out


def donation_probe(x, transfer) -> dict:
    """Can a jitted call write its result into a torch-allocated buffer passed as a donated argument?
    If so, the bridge could skip exporting (and later freeing) a jax-owned output."""
    twice = jax.jit(lambda out, v: v * 2.0, donate_argnums=0)
    target = torch.empty_like(x)
    transfer.order_before_jax()
    y = twice(transfer.to_jax(target), transfer.to_jax(x))
    jax.block_until_ready(y)
    aliased = y.unsafe_buffer_pointer() == target.data_ptr()
    return {"aliased": bool(aliased), "values_landed": bool(torch.allclose(target, x * 2.0)) if aliased else False,
            "host": host_us(lambda: twice(transfer.to_jax(torch.empty_like(x)), transfer.to_jax(x)))}


def argument_count_probe() -> dict:
    few = jax.jit(lambda a: a + 1)
    many = jax.jit(lambda *a: a[0] + 1)
    arrays = [jnp.ones((128,), jnp.float32) + i for i in range(50)]
    return {"jit_1_arg_host": host_us(lambda: few(arrays[0])),
            "jit_50_args_host": host_us(lambda: many(*arrays))}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="2,7,1")
    p.add_argument("--label", default=os.environ.get("XLA_FLAGS", "default") or "default")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "label": args.label, "probe": argument_count_probe(), "shapes": {}}
    for sid in args.shapes.split(","):
        result["shapes"][sid] = profile_shape(sid)
    os.makedirs(args.out, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in args.label)[:40].strip("-")
    path = os.path.join(args.out, f"bridge-profile-{result['date']}-h200-{slug}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"== {args.label}")
    print("probe", {k: round(v["median_us"], 1) for k, v in result["probe"].items()})
    for sid, r in result["shapes"].items():
        steps = {k.removeprefix("step_"): round(v["median_us"], 1) for k, v in r.items()
                 if isinstance(v, dict) and "median_us" in v}
        print(f"shape {sid}: host us {steps}")
        print(f"   events ms {({k: round(v, 4) for k, v in r['events_ms'].items()})} "
              f"p10 {({k: round(v, 4) for k, v in r['events_p10_ms'].items()})} "
              f"jax loop {r['jax_loop_per_call_us']:.1f} us, leaves {r['num_weight_leaves']}")


if __name__ == "__main__":
    main()
