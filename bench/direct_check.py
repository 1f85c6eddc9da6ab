"""The fused whole-stack kernel launched directly on torch tensors (bridge/direct.py), checked and timed on
the GPU against the bridge's XLA program, harness-style, per official shape and kernel tiling.

    python -m bench.direct_check [--shapes 2,1,6] [--seeds 5] [--quick] [--out bench/results]

Per shape (the ones the fused kernel supports): baseline and our module built the harness's way; then
1. accuracy: the bridge's fused plan (stack="fused", direct launch) and every tiling tried, against the
   baseline (TF32, as the harness runs it) on `--seeds` harness inputs, harness rule, worst err/tol;
2. timing, harness protocol (CUDA events on torch's stream around each call, alternating rounds):
   the bridge with the XLA program (stack="layers"), the bridge with the fused plan (what the planner's
   rule would give), and each tiling launched alone (its kernel, one output allocation);
3. kernel time: 200 back-to-back launches of each tiling over one pair of events (the GPU's time per
   launch once the host is ahead), and the host time of one bridge call on the fused plan.
Writes <out>/direct-<date>-<gpu>.json, prints a table last; exit 1 if any checked element fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TTJ_DIRECT_LAUNCH", "1")   # what this script checks (opt-in elsewhere until it passes)

import torch  # noqa: E402

import bridge  # noqa: E402
import jax  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import check_close, harness_models, make_inputs  # noqa: E402
from bench.bridge_profile import host_us  # noqa: E402
from bench.report import describe_error, run_shapes, slug  # noqa: E402
from bench.timing import time_contenders  # noqa: E402
from bridge import direct, runtime  # noqa: E402
from ttj_jax.kernels.fused_stack import FusedWeights, StackBlocks, direct_launch, supports  # noqa: E402

SHAPES = ("2", "3", "4", "1", "7", "9", "10", "11", "12", "5", "6")


def tilings(config, quick: bool) -> list[StackBlocks]:
    tried = [StackBlocks(), StackBlocks(num_warps=4)]
    tried += [StackBlocks(unroll=True), StackBlocks(num_stages=2)]
    if not quick:
        tried += [StackBlocks(num_warps=16), StackBlocks(ffn_block=128), StackBlocks(num_warps=4, ffn_block=128),
                  StackBlocks(num_warps=4, unroll=True)]
    if config.seq_len <= 64:
        tried += [StackBlocks(block_sequences=2, num_warps=4), StackBlocks(block_sequences=4)]
    return tried


def name_of(blocks: StackBlocks) -> str:
    return (f"bs{blocks.block_sequences}-w{blocks.num_warps}-s{blocks.num_stages}-f{blocks.ffn_block}"
            + ("-unrolled" if blocks.unroll else ""))


def kernel_ms(launch, calls: int = 200) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        launch()
    start.record()
    for _ in range(calls):
        launch()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def run_shape(sid: str, seeds: int, quick: bool) -> dict:
    config = T.OFFICIAL[sid].config
    if config.batch_size * config.seq_len > 100_000:   # shape 6: host-side checks of 164M elements are slow
        seeds, quick = min(seeds, 2), True
    base, ours = harness_models(config, bridge.TTJTransformer, device="cuda")
    record = {"config": dataclasses.asdict(config),
              "accuracy": {}, "timing_ms": {}, "kernel_ms": {}, "errors": {}}
    x, mask = make_inputs(config, 1234 + 100000, device="cuda")
    with torch.no_grad():
        ours(x, mask)
        record["plan"] = runtime.explain(ours, x, mask)
        fused_call = lambda: runtime.forward(ours, x, mask, stack="fused")
        layers_call = lambda: runtime.forward(ours, x, mask, stack="layers")
        fused_call()
        layers_call()
        state = runtime._STATES[ours]
        direct_calls = [c for k, c in state.calls.items() if k[-1] == "fused"]
        record["fused_direct"] = bool(direct_calls and direct_calls[0].direct is not None)
        record["fused_note"] = direct_calls[0].direct_note if direct_calls else "no fused call"

        tensors = state.kernel_tensors("fused")
        structs = FusedWeights({n: jax.ShapeDtypeStruct(tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                for n, t in zip(FusedWeights.FIELDS, tensors)},
                               d_model=config.d_model, num_heads=config.num_heads, ffn_dim=config.ffn_dim)
        kernels = {}
        for blocks in tilings(config, quick):
            name = name_of(blocks)
            try:
                spec = direct_launch(structs, tuple(x.shape), "float32", causal=config.causal, blocks=blocks)
                t0 = time.perf_counter()
                kernels[name] = direct.DirectKernel(spec, x.device)
                record.setdefault("compile_s", {})[name] = round(time.perf_counter() - t0, 2)
                record.setdefault("shared_bytes", {})[name] = kernels[name].shared_bytes
            except Exception as e:   # a tiling that does not compile or fit is recorded, not fatal
                record["errors"][name] = describe_error(e)

        def launch(kernel, xs):
            out = torch.empty_like(xs)
            kernel(xs, *tensors, out)
            return out

        runners = {"bridge_layers": lambda xs, ms: runtime.forward(ours, xs, ms, stack="layers"),
                   "bridge_fused": lambda xs, ms: runtime.forward(ours, xs, ms, stack="fused")}
        runners.update({f"direct_{n}": (lambda xs, ms, k=k: launch(k, xs)) for n, k in kernels.items()})

        worst, failed = {}, {}
        for seed in range(1234, 1234 + seeds):
            xs, ms = make_inputs(config, seed, device="cuda")
            ref = base(xs, ms)
            for name, run in runners.items():
                try:
                    f, w = check_close(run(xs, ms), ref)
                    failed[name] = failed.get(name, 0) + f
                    worst[name] = max(worst.get(name, 0.0), w)
                except Exception as e:
                    record["errors"][name] = describe_error(e)
            # The fused kernel's mask path (not planned unasked until it passes here): prefix masks with
            # padded rows, and a general mask made under inference_mode as the harness's trials make them.
            xp, mp = make_inputs(config, seed, padding_ratio=0.3, device="cuda")
            with torch.inference_mode():
                xg = xs.clone()
                mg = torch.rand(mp.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) < 0.8
            for name, (xi, mi) in {"bridge_fused_prefix_mask": (xp, mp), "bridge_fused_general_mask": (xg, mg)}.items():
                try:
                    f, w = check_close(runtime.forward(ours, xi, mi, stack="fused"), base(xi, mi))
                    failed[name] = failed.get(name, 0) + f
                    worst[name] = max(worst.get(name, 0.0), w)
                except Exception as e:
                    record["errors"][name] = describe_error(e)
        record["accuracy"] = {n: {"failed_elements": failed[n], "worst_err_over_tol": round(worst[n], 4)}
                              for n in failed}
        masked_calls = [c for k, c in state.calls.items() if k[-1] == "fused" and k[3] != runtime.MaskKind.ALL_TRUE]
        record["masked_fused_direct"] = [c.direct is not None for c in masked_calls]
        record["masked_fused_notes"] = [c.direct_note for c in masked_calls]
        ok = {n: (lambda run=run: run(x, mask)) for n, run in runners.items() if n not in record["errors"]}
        timed = time_contenders(ok, warmup=20, rounds=3, calls=100, device="cuda")
        record["timing_ms"] = {n: round(v["median_ms"], 4) for n, v in timed.items()}
        record["kernel_ms"] = {n: round(kernel_ms(lambda k=k: launch(k, x)), 4) for n, k in kernels.items()
                               if f"direct_{n}" in ok}
        record["host_us"] = {"bridge_fused": round(host_us(fused_call)["median_us"], 1),
                             "bridge_layers": round(host_us(layers_call)["median_us"], 1)}
    return record


def run_shape_in_child(sid: str, args) -> dict:
    """run_shape in a fresh process; its record, or what went wrong (exit status, last output)."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "record.json")
        command = [sys.executable, "-m", "bench.direct_check", "--shapes", sid, "--seeds", str(args.seeds),
                   "--child-json", path] + (["--quick"] if args.quick else [])
        done = subprocess.run(command, capture_output=True, text=True)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return {"error": f"child exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.direct_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="two tilings per shape")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="each shape in its own process (default): a bad launch that poisons the CUDA context "
                        "then loses one shape, not the rest")
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.direct_check needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.child_json:   # one shape, for a parent running with --isolate
        try:
            record = run_shape(args.shapes, args.seeds, args.quick)
        except Exception as e:
            record = {"error": describe_error(e)}
        with open(args.child_json, "w") as f:
            json.dump(record, f)
        return 0
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "command": "python -m bench.direct_check " +
              " ".join(argv if argv is not None else sys.argv[1:]), "shapes": {}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"direct-{result['date']}-{slug(gpu)}.json")
    def run_one(sid):
        config = T.OFFICIAL[sid].config
        if not supports(config, config.seq_len):
            return None
        return run_shape_in_child(sid, args) if args.isolate else run_shape(sid, args.seeds, args.quick)

    keys = ('timing_ms', 'kernel_ms', 'host_us', 'accuracy', 'errors', 'fused_note', 'error')
    bad = run_shapes(result, path, args.shapes.split(","), run_one,
                     lambda record: json.dumps({k: record.get(k) for k in keys}))
    print(f"\n{'shape':>5} {'layers ms':>10} {'fused ms':>9} {'best tiling':>20} {'kernel ms':>9} {'host us':>8} {'worst':>6}")
    for sid, r in result["shapes"].items():
        if "timing_ms" not in r:
            print(f"{sid:>5} error: {r.get('error', '')[:100]}")
            continue
        kern = r["kernel_ms"]
        best = min(kern, key=kern.get) if kern else "-"
        worst = max((a["worst_err_over_tol"] for a in r["accuracy"].values()), default=float("nan"))
        print(f"{sid:>5} {r['timing_ms'].get('bridge_layers', float('nan')):>10.4f} "
              f"{r['timing_ms'].get('bridge_fused', float('nan')):>9.4f} {best:>20} "
              f"{kern.get(best, float('nan')):>9.4f} {r['host_us']['bridge_fused']:>8.1f} {worst:>6.3f}")
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
