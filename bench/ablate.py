"""Variants of the JAX program against each other, per shape: numerics policy, stack, attention.

    PYTHONPATH=. python3 bench/ablate.py [--shapes 8,11] [--variants mixed_fp16/layers,mixed_fp16/rows]
                                         [--seeds 5] [--out DIR]

A variant is `policy[/stack[/attention[/weights]]][@option=value+option=value]` (a missing or "-" part is
the planner's choice; weights: the XLA program's, `stacked` over the layers as the planner runs it or
`per-layer`), e.g. `mixed_fp16_qkv16/layers` (the q/k/v projection written in fp16),
`mixed_fp16/rows` (per layer our flash kernel and one row-tile kernel), `mixed_fp16/layers/cudnn`,
`mixed_fp16@xla_gpu_enable_triton_gemm=false` (XLA options for that program alone; values true/false,
integers or text; `qkv_gemms=3` among them sets the plan's q/k/v projection to three GEMMs instead,
`mixed_fp16_gemm16_tanh/layers/cudnn@qkv_gemms=3+xla_disable_hlo_passes=dot-merger`). Per shape and variant: accuracy
against the harness's baseline (TF32, as the harness runs it) on the harness seeds, harness rule, worst
err/tol; then the time per call of the variant's compiled program alone (many back-to-back calls:
its GPU time wherever the host keeps ahead). A variant the planner or a kernel refuses is
recorded with its error and the run goes on. With --kernels (CUDA only), each variant's program also runs
5 times under torch.profiler and its GPU time per call is listed by kernel name (bench/cuda_trace.py):
which kernels XLA emitted and where the microseconds go. Writes <out>/ablate-<date>-<gpu>.json (or --tag) and
prints a table last.

Example: on shape 8 (GEMM-bound) a q/k/v GEMM that writes fp16 itself, instead of an fp32 [B*S, 3d] tensor
that a second pass rounds, is faster with cuBLAS and slower with XLA's Triton GEMM (1.135 and 1.333 against
1.288 ms on the H200); planner.GEMM_BOUND_* holds that choice.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from bench.cuda_trace import kernel_table, profile_cuda  # noqa: E402
from bench.jax_timing import stream_ms_per_call  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import describe_error, slug  # noqa: E402
from ttj_jax.model import kernel_weights, plan_for  # noqa: E402
from ttj_jax.shapes import find  # noqa: E402

DEFAULT_VARIANTS = "mixed_fp16/layers,mixed_fp16_qkv16/layers"


def _option_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


WEIGHT_LAYOUTS = ("stacked", "per-layer")


def parse_variant(text: str) -> dict:
    """"policy[/stack[/attention[/weights]]][@name=value+...]" -> forward() keyword arguments ("-" or
    missing: the planner's choice), "weights" (the XLA program's weights: None, the stack's own layout,
    "stacked" or "per-layer"), "qkv_gemms" (the plan's, from an option of that name; None: the plan's
    own) and "compiler_options", a tuple of the other (name, value) pairs, XLA options."""
    spec, _, options = text.partition("@")
    parts = (spec.split("/") + ["-", "-", "-"])[:4]
    if len(spec.split("/")) > 4 or not parts[0] or parts[0] == "-":
        raise ValueError(f"variant {text!r}: expected policy[/stack[/attention[/weights]]][@option=value+...]")
    parsed = {k: (None if v in ("", "-") else v) for k, v in zip(("policy", "stack", "attention"), parts)}
    parsed["weights"] = None if parts[3] in ("", "-") else parts[3]
    if parsed["weights"] not in (None,) + WEIGHT_LAYOUTS:
        raise ValueError(f"variant {text!r}: weights {parts[3]!r} is not one of {WEIGHT_LAYOUTS}")
    pairs = []
    for item in filter(None, options.split("+")):
        name, equals, value = item.partition("=")
        if not equals or not name:
            raise ValueError(f"variant {text!r}: XLA option {item!r} is not name=value")
        pairs.append((name, _option_value(value)))
    qkv = [value for name, value in pairs if name == "qkv_gemms"]
    parsed["qkv_gemms"] = qkv[-1] if qkv else None
    parsed["compiler_options"] = tuple((name, value) for name, value in pairs if name != "qkv_gemms")
    return parsed


def run_shape(sid: str, variants: list[str], seeds: int, device: str, kernels: bool = False,
              hlo_path: pathlib.Path | None = None) -> dict:
    config = find(sid).config   # any suite's id: official, the CPU twins ("cpu-8"), the general suite's
    torch.manual_seed(0)
    baseline = BaselineTransformer(TransformerConfig(**vars(config))).to(device).eval()
    params = T.params_from_state_dict({k: v.detach().cpu().numpy() for k, v in baseline.state_dict().items()},
                                      config)
    result = {"config": vars(config), "accuracy": {}, "jax_ms": {}, "errors": {}}
    for variant in variants:
        try:
            kwargs = parse_variant(variant)
            options = kwargs.pop("compiler_options")
            layout = kwargs.pop("weights")
            qkv_gemms = kwargs.pop("qkv_gemms")
            prepared = T.prepare_weights(params, T.get_policy(kwargs["policy"]))
            timing_x = jax.random.normal(jax.random.key(7),
                                         (config.batch_size, config.seq_len, config.d_model))
            # the variant's compiled program alone (what the bridge calls): timed below, not forward()'s
            # planning and checks, whose host time would hide the GPU time of the small shapes
            chosen = plan_for(config, timing_x, T.MaskKind.NONE, **kwargs)
            if qkv_gemms is not None:   # forward() takes no such option: the program compiled with it
                chosen = dataclasses.replace(chosen, qkv_gemms=qkv_gemms)
            if layout is not None and chosen.stack != "layers":
                raise ValueError(f"weights {layout!r}: only the XLA program ('layers') takes either layout")
            program = T.executable(chosen, T.model_key(config), options)
            # per layer: twelve arguments a layer, each a buffer of its own; stacked (the stack's own layout):
            # fourteen, each layer's slices cut inside the program
            program_weights = (prepared if layout == "per-layer"
                               else kernel_weights(prepared, T.model_key(config), chosen))
            if options or layout is not None or qkv_gemms is not None:   # forward() takes none of them
                step = lambda w, a: program(program_weights, a, None)   # noqa: E731
            else:
                # ttj_jax.forward plans once per input signature and runs its cached executable
                step = lambda w, a, kw=kwargs: T.forward(w, a, config=config, **kw)   # noqa: E731
            failed, worst = 0, 0.0
            for seed in HARNESS_SEEDS[:seeds]:
                with torch.inference_mode():
                    x, mask = make_inputs(config, seed, device=device)
                    ref = baseline(x, mask)
                y = np.array(step(prepared, jnp.asarray(x.cpu().numpy())))   # a writable copy for torch
                f, w = check_close(torch.from_numpy(y).to(device), ref)
                failed, worst = failed + f, max(worst, w)
            result["accuracy"][variant] = {"failed_elements": failed, "worst_err_over_tol": worst}
            jax.block_until_ready(program(program_weights, timing_x, None))
            result["jax_ms"][variant], _ = stream_ms_per_call(program, (program_weights, timing_x, None),
                                                              min_seconds=0.2, repeats=5)
            result.setdefault("plans", {})[variant] = chosen.explain()
            if kernels:
                trace = profile_cuda(lambda: program(program_weights, timing_x, None), calls=5)
                result.setdefault("kernels", {})[variant] = kernel_table(trace, calls=5)
            if hlo_path is not None:   # the optimized program XLA ran: which ops it fused, which it did not
                with hlo_path.open("a") as f:
                    f.write(f"==== shape {sid} variant {variant}\n")
                    f.write(program.lower(program_weights, timing_x, None).compile().as_text() + "\n")
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            result["errors"][variant] = describe_error(exc)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8,1,13")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated policy[/stack[/attention]]")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--tag", default=None, help="file name stem (default: ablate-<date>-<gpu>)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernels", action="store_true", help="CUDA: GPU time per kernel name (torch.profiler)")
    p.add_argument("--hlo", action="store_true", help="write each program's optimized HLO to <tag>-hlo.txt")
    p.add_argument("--out", default=default_out_dir())
    p.add_argument("--variant-sep", default=",",
                   help="what separates the variants (another character when an XLA option's value holds "
                        "commas, e.g. xla_gpu_enable_command_buffer=FUSION,CUBLAS)")
    args = p.parse_args(argv)
    if args.kernels and args.device != "cuda":
        p.error("--kernels needs --device cuda")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    document = {"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__,
                "date": datetime.date.today().isoformat(),
                "command": "python bench/ablate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "shapes": {}}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = args.variants.split(args.variant_sep)
    for v in variants:   # a typo fails before any GPU work
        T.get_policy(parse_variant(v)["policy"])
    path = out / f"{args.tag or 'ablate-' + document['date'] + '-' + slug(gpu)}.json"
    hlo_path = path.with_name(path.stem + "-hlo.txt") if args.hlo else None
    if hlo_path is not None and hlo_path.exists():
        hlo_path.unlink()
    for sid in args.shapes.split(","):
        document["shapes"][sid] = run_shape(sid, variants, args.seeds, args.device, args.kernels, hlo_path)
        print(f"shape {sid}: {json.dumps(document['shapes'][sid]['jax_ms'])}", flush=True)
        path.write_text(json.dumps(document, indent=1))
    print(f"{'shape':>5} {'variant':32s} {'jax ms':>9} {'failed':>7} {'worst':>6}")
    for sid, r in document["shapes"].items():
        for variant in variants:
            acc = r["accuracy"].get(variant, {})
            ms = r["jax_ms"].get(variant)
            print(f"{sid:>5} {variant:32s} {ms if ms is None else round(ms, 4)!s:>9} "
                  f"{acc.get('failed_elements', '-')!s:>7} {acc.get('worst_err_over_tol', float('nan')):6.3f}"
                  + (f"  ERROR {r['errors'][variant][:80]}" if variant in r["errors"] else ""))
    for sid, r in document["shapes"].items():
        for variant, table in r.get("kernels", {}).items():
            print(f"shape {sid} {variant}: kernels {table['kernel_us_per_call']:.1f} us/call, "
                  f"span {table['span_us_per_call']:.1f} us/call")
            for row in table["kernels"][:8]:
                print(f"   {row['us_per_call']:8.1f} us x{row['launches_per_call']:g}  {row['kernel'][:90]}")
    print(f"wrote {path}")
    failed = sum(a["failed_elements"] for r in document["shapes"].values() for a in r["accuracy"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
