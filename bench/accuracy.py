"""The harness's accuracy check over its options, to find where ttj-jax fails the rule.

Per case (shape, input scale, padding ratio, causal, dtype, TF32 on/off) and seed, the harness's own
input, its baseline in the same dtype (TF32 as `--allow-tf32` sets it), and ttj-jax through the bridge
and from JAX; every element checked by the harness rule. Beside it, an fp64 reference (the baseline in
float64) judges both: how far ttj-jax and the harness's baseline each are from the exact result.
bfloat16 is judged against fp64 only (the harness's bf16 baseline fails against fp64 by itself).

    python -m bench.accuracy [--suite small|official] [--shapes cpu-2,cpu-7] [--scales 0.01,0.1,...]
        [--paddings 0,0.3,0.7] [--causal yes,no] [--dtypes float32,float16] [--tf32 on,off] [--seeds 5]
        [--jax-policy NAME] [--tag T] [--out DIR]

--jax-policy runs the JAX column with that numerics policy (ttj_jax.numerics.POLICIES) instead of the
planner's (the bridge column keeps the planner's): how a policy would fare before the planner uses it.

Writes `accuracy-<date>-<device>[-<tag>].json` (`cases`: one record per case) and prints the failing cases.
Exit status 1 when any case fails the harness rule through the bridge or from JAX.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import sys
import time

import bridge  # noqa: I001 - first: it sets jax's allocator default before jax starts

# isort: split
import jax
import torch

import ttj_jax as T
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs
from bench.paths import default_out_dir
from bench.report import slug
from ttj_jax.numerics import POLICIES

SCALES = (0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0)
PADDINGS = (0.0, 0.3, 0.7)
HARNESS_SEED = 1234


def _case_config(shape: T.Shape, causal: bool) -> TransformerConfig:
    return TransformerConfig(**dict(vars(shape.config), causal=causal))


def run_case(shape: T.Shape, *, scale: float, padding: float, causal: bool, dtype: str, tf32: bool,
             seeds: int, device: torch.device, models: dict, jax_policy: str | None = None) -> dict:
    config = _case_config(shape, causal)
    torch_dtype = getattr(torch, dtype)
    key = (shape.id, causal, dtype)
    if key not in models:   # models per (shape, causal, dtype): the harness builds them once per run
        models.clear()
        baseline, ours = harness_models(config, bridge.TTJTransformer, device=device, dtype=torch_dtype)
        exact = copy.deepcopy(baseline).double()   # the same (rounded) weights, computed in float64
        params = T.params_from_state_dict({k: jax.numpy.asarray(v.float().cpu().numpy())
                                           for k, v in ours.state_dict().items()}, T.Config.from_object(config))
        models[key] = (baseline, ours, exact, params)
    baseline, ours, exact, params = models[key]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    record = {"shape": shape.id, "input_scale": scale, "padding": padding, "causal": causal, "dtype": dtype,
              "allow_tf32": tf32, "seeds": seeds}
    tally = {name: [0, 0.0] for name in ("bridge", "jax", "bridge_vs_fp64", "baseline_vs_fp64")}
    with torch.inference_mode():
        for seed in range(HARNESS_SEED, HARNESS_SEED + seeds):
            x, mask = make_inputs(config, seed, padding_ratio=padding, input_scale=scale, device=device,
                                  dtype=torch_dtype)
            out = ours(x, mask)
            reference = exact(x.double(), mask)
            jax_x = x.float() if dtype == "bfloat16" else x   # numpy has no bfloat16
            jax_out = T.forward(params, jax.numpy.asarray(jax_x.cpu().numpy()),
                                jax.numpy.asarray(mask.cpu().numpy()), config=T.Config.from_object(config),
                                policy=jax_policy)
            jax_out = torch.from_numpy(jax.device_get(jax_out).copy()).to(device)
            checks = {"bridge_vs_fp64": (out, reference), "baseline_vs_fp64": None}
            ref = None
            if dtype != "bfloat16":   # the harness's own rule, against its baseline in the same dtype
                ref = baseline(x, mask)
                checks.update(bridge=(out, ref), jax=(jax_out.to(torch_dtype), ref))
                checks["baseline_vs_fp64"] = (ref, reference)
            for name, pair in checks.items():
                if pair is None:
                    continue
                failed, worst = check_close(pair[0].double(), pair[1].double())
                tally[name][0] += failed
                tally[name][1] = max(tally[name][1], worst)
    record["failed_elements"] = tally["bridge"][0] if dtype != "bfloat16" else None
    record["worst_err_over_tol"] = tally["bridge"][1] if dtype != "bfloat16" else None
    record["jax"] = {"failed_elements": tally["jax"][0], "worst_err_over_tol": tally["jax"][1]}
    record["fp64"] = {name.split("_vs_")[0]: {"failed_elements": f, "worst_err_over_tol": w}
                      for name, (f, w) in tally.items() if name.endswith("fp64")}
    record["plan"] = bridge.explain(ours, *make_inputs(config, HARNESS_SEED, padding_ratio=padding,
                                                       input_scale=scale, device=device, dtype=torch_dtype))
    return record


def _flags(text: str) -> list[bool]:
    return [{"yes": True, "on": True, "no": False, "off": False}[v] for v in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(T.SUITES), default=None,
                   help="default: official on a GPU, small on the CPU")
    p.add_argument("--shapes", default=None, help="comma-separated shape ids (default: the suite's, 1-13)")
    p.add_argument("--scales", default=",".join(map(str, SCALES)))
    p.add_argument("--paddings", default=",".join(map(str, PADDINGS)))
    p.add_argument("--causal", default="yes,no")
    p.add_argument("--dtypes", default="float32,float16")
    p.add_argument("--tf32", default="on,off")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--jax-policy", default=None, choices=sorted(POLICIES),
                   help="the JAX column's numerics policy (default: the planner's)")
    p.add_argument("--tag", default="", help="appended to the file name")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=default_out_dir())
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    suite = T.SUITES[args.suite or ("official" if device.type == "cuda" else "small")]
    ids = args.shapes.split(",") if args.shapes else [i for i in suite if suite is not T.OFFICIAL or i in T.shapes.HARNESS_IDS]
    unknown = [i for i in ids if i not in suite]
    if unknown:
        raise SystemExit(f"unknown shape id(s) {unknown}; this suite has {sorted(suite)}")
    tf32s = _flags(args.tf32) if device.type == "cuda" else [False]   # TF32 exists on CUDA only
    grid = list(itertools.product(ids, map(float, args.scales.split(",")), map(float, args.paddings.split(",")),
                                  _flags(args.causal), args.dtypes.split(","), tf32s))
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"date": datetime.date.today().isoformat(), "device": device_name, "jax": jax.__version__,
           "torch": torch.__version__, "command": "python -m bench.accuracy " + " ".join(sys.argv[1:] if argv is None else argv),
           "rule": "harness: both finite and |err| <= 0.002 or <= 2% of |ref|",
           "jax_policy": args.jax_policy or "the planner's", "cases": []}
    models: dict = {}
    started = time.perf_counter()
    grid.sort(key=lambda c: (c[0], c[3], c[4]))   # one model build per (shape, causal, dtype)
    for n, (sid, scale, padding, causal, dtype, tf32) in enumerate(grid, 1):
        record = run_case(suite[sid], scale=scale, padding=padding, causal=causal, dtype=dtype, tf32=tf32,
                          seeds=args.seeds, device=device, models=models, jax_policy=args.jax_policy)
        out["cases"].append(record)
        failed = record["failed_elements"] or record["jax"]["failed_elements"]
        print(f"[{n}/{len(grid)} {time.perf_counter() - started:6.0f} s] shape {sid} scale {scale} pad {padding} "
              f"causal {causal} {dtype} tf32 {tf32}: "
              + (f"FAIL {record['failed_elements']} (jax {record['jax']['failed_elements']}), worst "
                 f"{record['worst_err_over_tol']:.2f}" if failed else
                 f"ok, worst {record['worst_err_over_tol'] if record['worst_err_over_tol'] is not None else 0:.2f}"),
              flush=True)
    os.makedirs(args.out, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path = os.path.join(args.out, f"accuracy-{out['date']}-{slug(device_name)}{tag}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    failing = [c for c in out["cases"] if (c["failed_elements"] or c["jax"]["failed_elements"])]
    print(f"{len(failing)} of {len(out['cases'])} cases fail the harness rule; wrote {path}")
    return 1 if failing else 0


if __name__ == "__main__":
    raise SystemExit(main())

