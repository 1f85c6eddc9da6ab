"""Shape 14 from JAX with each long-sequence attention (cuDNN, our kernel), same process, same input:

    python bench/shape14_attention.py [--out DIR]

Median of 3 timed calls after one warm-up each; writes <out>/shape14-attention-<date>-<gpu>.json."""

import argparse
import datetime
import os
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ttj_jax as T  # noqa: E402
from bench.jax_timing import synced_calls_ms  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=default_out_dir())
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    config = T.OFFICIAL["14"].config
    prepared = T.prepare_weights(T.init_params(jax.random.key(0), config), T.MIXED_FP16)
    x = jax.random.normal(jax.random.key(1), (config.batch_size, config.seq_len, config.d_model), jnp.float32)
    device = jax.devices()[0]
    result = {"gpu": device.device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
              "command": "python bench/shape14_attention.py", "runs": {}}
    outputs = {}
    for attention in ("cudnn", "pallas"):
        outputs[attention], first, times = synced_calls_ms(
            lambda: T.forward(prepared, x, config=config, attention=attention), args.calls)
        plan = T.model.plan_for(config, x, T.MaskKind.NONE, attention=attention)
        result["runs"][attention] = {"ms": statistics.median(times), "timing_ms": times, "first_call_s": first,
                                     "plan": plan.name}
        print(f"{attention:7s} {statistics.median(times):9.1f} ms  {plan.name}", flush=True)
    diff = float(jnp.max(jnp.abs(outputs["cudnn"] - outputs["pallas"])))
    result["max_abs_diff_between"] = diff
    print(f"max |cudnn - pallas| = {diff:.3g}")
    path = write_json(result, args.out, f"shape14-attention-{result['date']}-{slug(device.device_kind)}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
