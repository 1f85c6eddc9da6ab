"""Sequence parallelism (ttj_jax.sequence_parallel_forward, a ring over the devices) checked and timed
against the one-device forward, from JAX, and the planner's own choice (the ring, for one long sequence on
several GPUs) beside them.

    PYTHONPATH=. python3 bench/ring_check.py [--config B,S,d,H,ffn,L] [--devices N] [--query-chunk 1024]
        [--key-chunk 1024] [--calls 3] [--out DIR] [--tag NAME]

The one-device call is `ttj_jax.forward` with the planner's plan on device 0; the ring splits each sequence
over N devices (all visible by default). Both run on the same input (seeded normal, all-True mask) with
the mixed_fp16 policy; the ring's output is compared with the one-device output element by element with
the harness rule (|diff| <= max(0.002, 0.02 |one device|)), and each is timed as the median of --calls warm
calls (block_until_ready; compile apart). Each --attention choice of the ring (its per-visit attention:
XLA chunks, or our flash kernel per zigzag-chunk pair) is checked and timed. Writes <out>/<tag or ring-<date>-<device>>.json; exit 1 if
an element fails. Runs on CPU devices too (XLA_FLAGS=--xla_force_host_platform_device_count=N), as the
test does with a tiny config.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from bench.paths import default_out_dir  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="1,16384,1024,16,1024,2", help="B,S,d,H,ffn,L (causal)")
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--query-chunk", type=int, default=1024)
    parser.add_argument("--key-chunk", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--attention", default="xla,pallas",
                        help="the ring's per-visit attention, comma separated: xla, pallas (our flash kernel)")
    parser.add_argument("--out", default=default_out_dir())
    parser.add_argument("--tag", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import ttj_jax as T
    from bench.jax_timing import synced_calls_ms
    from bench.report import write_json
    from ttj_jax.numerics import harness_check

    B, S, d, H, ffn, L = (int(v) for v in args.config.split(","))
    config = T.Config(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn, num_layers=L, causal=True)
    devices = args.devices or len(jax.devices())
    params = T.prepare_weights(T.init_params(jax.random.key(0), config), T.MIXED_FP16)
    x = jax.random.normal(jax.random.key(1), (B, S, d), jnp.float32)
    mask = jnp.ones((B, S), bool)

    def timed(fn):
        return synced_calls_ms(fn, args.calls)

    def against_one_device(y):   # (elements outside the harness rule, max |diff|) against the one-GPU output
        failed, _, diff = harness_check(jax.device_put(y, jax.devices()[0]), one)
        return int(failed), float(diff)

    # the planner picks the ring itself for long single sequences on several GPUs: the one-device
    # figure asks for one device, and the planner's own choice is timed beside the explicit rings
    one, one_first_s, one_ms = timed(lambda: T.forward(params, x, mask, config=config, sequence_parallel=1))
    one = jax.device_put(one, jax.devices()[0])
    rings, failed = {}, 0
    for attention in args.attention.split(","):
        ring, ring_first_s, ring_ms = timed(lambda a=attention: T.sequence_parallel_forward(
            params, x, mask, config=config, devices=devices, query_chunk=args.query_chunk,
            key_chunk=args.key_chunk, attention=a))
        ring_failed, max_diff = against_one_device(ring)
        failed += ring_failed
        rings[attention] = {"ring_ms": statistics.median(ring_ms), "ring_timing_ms": ring_ms,
                            "speedup": statistics.median(one_ms) / statistics.median(ring_ms),
                            "first_call_s": ring_first_s, "failed_vs_one_device": ring_failed,
                            "max_abs_diff": max_diff}
        del ring
    default_plan = T.model.plan_for(config, x, T.MaskKind.ALL_TRUE)
    planner = None
    if default_plan.sequence_parallel > 1:
        chosen, chosen_first_s, chosen_ms = timed(lambda: T.forward(params, x, mask, config=config))
        chosen_failed, max_diff = against_one_device(chosen)
        failed += chosen_failed
        planner = {"ms": statistics.median(chosen_ms), "timing_ms": chosen_ms, "first_call_s": chosen_first_s,
                   "speedup": statistics.median(one_ms) / statistics.median(chosen_ms),
                   "failed_vs_one_device": chosen_failed, "max_abs_diff": max_diff}
        del chosen
    device = jax.devices()[0]
    result = {
        "config": vars(config), "devices": devices, "query_chunk": args.query_chunk, "key_chunk": args.key_chunk,
        "one_device_ms": statistics.median(one_ms), "one_device_timing_ms": one_ms, "one_device_first_call_s": one_first_s,
        "rings": rings, "failed_vs_one_device": failed,
        "plan_one_device": T.model.plan_for(config, x, T.MaskKind.ALL_TRUE, sequence_parallel=1).explain(),
        "plan_default": default_plan.explain(), "planner_default": planner,
        "device": getattr(device, "device_kind", device.platform), "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python bench/ring_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    stem = args.tag or f"ring-{result['date']}-{str(result['device']).split()[-1].lower()}x{devices}"
    path = write_json(result, args.out, stem)
    print(f"{config}: one device {result['one_device_ms']:.1f} ms")
    for attention, r in rings.items():
        print(f"  ring over {devices} devices, {attention} attention: {r['ring_ms']:.1f} ms ({r['speedup']:.2f}x); "
              f"failed {r['failed_vs_one_device']}, max |diff| {r['max_abs_diff']:.2e}")
    if planner is not None:
        print(f"  the planner's own choice ({default_plan.name}): {planner['ms']:.1f} ms ({planner['speedup']:.2f}x); "
              f"failed {planner['failed_vs_one_device']}")
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
