"""ttj-jax under torch.compile on the GPU, as the harness's `--compile-user --compile-mode M` runs it:
accuracy (harness rule, every element), recompiles in steady state, and time per call (CUDA events)
against the eager bridge, the baseline and the torch peer; plus what a CUDA graph capture of the
module does (it must raise a clear error, never return stale output).

    PYTHONPATH=. python3 -m bench.compile_check [--shapes 2,7,11,8,13] [--modes default,reduce-overhead,max-autotune]
                                                [--out results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

import bridge  # noqa: F401 - sets jax's allocator default before jax starts
import ttj_jax as T
from bench.baseline import BaselineTransformer, TransformerConfig, check_close, harness_models, make_inputs
from bench.timing import time_contenders

SEEDS = (0, 1, 2)


def _recompiles() -> int:
    from torch._dynamo.utils import counters
    return int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0


def _capture_outcome(module, x, mask) -> str:
    """What capturing a call of `module` in a CUDA graph does: the error text, or 'captured' (then the
    replay's output is checked by the caller)."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            module(x, mask)
    except RuntimeError as e:
        return f"raised: {str(e).splitlines()[0][:200]}"
    finally:
        torch.cuda.current_stream().wait_stream(stream)
    return "captured"


class DropIn(BaselineTransformer):
    """The harness's one-line plug-in: `bridge.forward(self, ...)` inside its own class."""

    def forward(self, x, valid_token_mask=None):
        return bridge.forward(self, x, valid_token_mask)


def run_shape(shape: T.Shape, modes: list[str], device: torch.device, peer: bool) -> dict:
    config = TransformerConfig(**vars(shape.config))
    baseline, ours = harness_models(config, bridge.TTJTransformer, device=device)
    _, drop_in = harness_models(config, DropIn, device=device)
    contenders = {"baseline": baseline, "bridge_eager": ours, "drop_in_eager": drop_in}
    result = {"config": vars(shape.config), "modes": {}}
    if peer:
        from bench.torch_peer import build_peer
        contenders["peer"] = build_peer(baseline, config, device=device)
    x_timing, mask_timing = make_inputs(config, 7, device=device)
    for mode in modes:
        torch._dynamo.reset()   # one mode at a time, as the harness compiles once per process
        compiled = torch.compile(ours, mode=None if mode == "default" else mode)
        record = {}
        try:
            worst, failed = 0.0, 0
            with torch.inference_mode():
                t0 = time.perf_counter()
                for seed in SEEDS:
                    x, mask = make_inputs(config, seed, device=device)
                    f, w = check_close(compiled(x, mask), baseline(x, mask))
                    failed, worst = failed + f, max(worst, w)
                record["first_calls_s"] = time.perf_counter() - t0
                before = _recompiles()
                for seed in SEEDS:   # steady state: the same signatures again
                    x, mask = make_inputs(config, 100 + seed, device=device)
                    f, w = check_close(compiled(x, mask), baseline(x, mask))
                    failed, worst = failed + f, max(worst, w)
                record["steady_recompiles"] = _recompiles() - before
                # timed beside the eager module, right after its own compile
                timed = {"eager": lambda: ours(x_timing, mask_timing),
                         "compiled": lambda: compiled(x_timing, mask_timing)}
                timings = time_contenders(timed, warmup=20, rounds=3, calls=50, device=device)
                record["ms"] = timings["compiled"]["median_ms"]
                record["eager_ms"] = timings["eager"]["median_ms"]
            record.update(failed_elements=failed, worst_err_over_tol=worst, ok=True)
        except Exception as e:   # noqa: BLE001 - a mode that fails is a result, recorded with its error
            record.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        result["modes"][mode] = record
    torch._dynamo.reset()
    contenders["drop_in_compiled_default"] = torch.compile(drop_in)
    with torch.inference_mode():
        result["cuda_graph_capture"] = _capture_outcome(ours, x_timing, mask_timing)
        timed = {name: (lambda fn=fn: fn(x_timing, mask_timing)) for name, fn in contenders.items()}
        timings = time_contenders(timed, warmup=20, rounds=3, calls=50, device=device)
    result["ms"] = {name: t["median_ms"] for name, t in timings.items()}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="2,7,11,8,13")
    p.add_argument("--modes", default="default,reduce-overhead,max-autotune")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("compile_check needs a CUDA GPU")
    device = torch.device("cuda")
    modes = args.modes.split(",")
    out = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "jax": __import__("jax").__version__,
           "command": "python -m bench.compile_check " + " ".join(sys.argv[1:] if argv is None else argv),
           "shapes": {}}
    os.makedirs(args.out, exist_ok=True)
    slug = out["gpu"].lower().replace(" ", "-")
    path = os.path.join(args.out, f"compile-{out['date']}-{slug}.json")
    for sid in args.shapes.split(","):
        print(f"shape {sid} ...", flush=True)
        out["shapes"][sid] = run_shape(T.OFFICIAL[sid], modes, device, peer=not args.no_peer)
        with open(path, "w") as f:   # after every shape, so a run cut short keeps what it measured
            json.dump(out, f, indent=1)
    for sid, r in out["shapes"].items():
        print(f"shape {sid}: " + ", ".join(f"{name} {ms:.4f}" for name, ms in r["ms"].items()))
    print(f"\n{'shape':>5} {'mode':>16} {'ok':>3} {'fail':>5} {'worst':>6} {'recomp':>6} {'ms':>8} {'eager':>8} "
          f"{'peer':>8} {'base':>8}")
    for sid, r in out["shapes"].items():
        for mode, m in r["modes"].items():
            ms = m.get("ms", float("nan"))
            print(f"{sid:>5} {mode:>16} {'y' if m['ok'] else 'n':>3} {m.get('failed_elements', '-')!s:>5} "
                  f"{m.get('worst_err_over_tol', float('nan')):6.3f} {m.get('steady_recompiles', '-')!s:>6} "
                  f"{ms:8.4f} {r['ms']['bridge_eager']:8.4f} {r['ms'].get('peer', float('nan')):8.4f} "
                  f"{r['ms']['baseline']:8.4f}" + ("" if m["ok"] else f"  {m['error'][:80]}"))
        print(f"{sid:>5} cuda graph capture: {r['cuda_graph_capture']}")
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
