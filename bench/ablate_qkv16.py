"""The q/k/v projection written in fp16 (policy mixed_fp16_qkv16) against fp32 (mixed_fp16), from JAX.

    PYTHONPATH=. python3 bench/ablate_qkv16.py [--shapes 8,1,13] [--seeds 5] [--out bench/results]

Hypothesis (shape 8, GEMM-bound, 0.92x the torch peer): the q/k/v GEMM writes a [B*S, 3d] fp32 tensor
(~100 MB per layer there) that a second pass reads back and rounds to fp16 for attention; written in fp16
by the GEMM itself, ~250 MB less traffic per layer, ~0.2 ms of shape 8's ~1.26 ms. Per shape: accuracy of
each policy against the harness's baseline (TF32, as the harness runs it) on the harness seeds, harness
rule, worst err/tol; then each policy's JAX loop time (the XLA program, stack="layers"). Writes
<out>/ablate-qkv16-<date>-<gpu>.json and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import ttj_jax as T  # noqa: E402
from bench.baseline import BaselineTransformer, TransformerConfig, check_close, make_inputs  # noqa: E402
from bench.cli import HARNESS_SEEDS  # noqa: E402
from bench.jax_timing import stream_ms_per_call  # noqa: E402
from bench.report import describe_error, slug  # noqa: E402

POLICIES = ("mixed_fp16", "mixed_fp16_qkv16")


def run_shape(sid: str, seeds: int, device: str) -> dict:
    config = {**T.OFFICIAL, **T.CPU_SMALL}[sid].config   # official ids, or the CPU twins ("cpu-8")
    torch.manual_seed(0)
    baseline = BaselineTransformer(TransformerConfig(**vars(config))).to(device).eval()
    params = T.params_from_state_dict({k: v.detach().cpu().numpy() for k, v in baseline.state_dict().items()},
                                      config)
    result = {"config": vars(config), "accuracy": {}, "jax_ms": {}, "errors": {}}
    for policy in POLICIES:
        try:
            prepared = T.prepare_weights(params, T.get_policy(policy))
            # ttj_jax.forward plans once per input signature and runs its cached executable
            step = lambda w, a, p=policy: T.forward(w, a, config=config, policy=p, stack="layers")
            failed, worst = 0, 0.0
            for seed in HARNESS_SEEDS[:seeds]:
                with torch.inference_mode():
                    x, mask = make_inputs(config, seed, device=device)
                    ref = baseline(x, mask)
                y = np.asarray(step(prepared, jnp.asarray(x.cpu().numpy())))
                f, w = check_close(torch.from_numpy(y).to(device), ref)
                failed, worst = failed + f, max(worst, w)
            result["accuracy"][policy] = {"failed_elements": failed, "worst_err_over_tol": worst}
            x = jax.random.normal(jax.random.key(7), (config.batch_size, config.seq_len, config.d_model))
            jax.block_until_ready(step(prepared, x))
            result["jax_ms"][policy], _ = stream_ms_per_call(step, (prepared, x), min_seconds=0.2, repeats=5)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            result["errors"][policy] = describe_error(exc)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8,1,13")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    document = {"gpu": gpu, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
                "command": "python bench/ablate_qkv16.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "shapes": {}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ablate-qkv16-{document['date']}-{slug(gpu)}.json"
    for sid in args.shapes.split(","):
        document["shapes"][sid] = run_shape(sid, args.seeds, args.device)
        path.write_text(json.dumps(document, indent=1))
    print(f"{'shape':>5} {'policy':18s} {'jax ms':>9} {'failed':>7} {'worst':>6}")
    for sid, r in document["shapes"].items():
        for policy in POLICIES:
            acc = r["accuracy"].get(policy, {})
            ms = r["jax_ms"].get(policy)
            print(f"{sid:>5} {policy:18s} {ms if ms is None else round(ms, 4)!s:>9} "
                  f"{acc.get('failed_elements', '-')!s:>7} {acc.get('worst_err_over_tol', float('nan')):6.3f}"
                  + (f"  ERROR {r['errors'][policy][:80]}" if policy in r["errors"] else ""))
    print(f"wrote {path}")
    failed = sum(a["failed_elements"] for r in document["shapes"].values() for a in r["accuracy"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
