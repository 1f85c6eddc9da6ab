"""Where a batch split's time goes on several GPUs: a CUDA activity timeline of one warm call (issue 5:
shape 6 on two H200s ran 1.32x, not 1.8x, and chunking made it slower).

    PYTHONPATH=. python3 bench/split_timeline.py [--shape 6] [--chunks 1,2,4,8] [--home-rows 0]
        [--rounds 3] [--no-profile] [--host-profile] [--tag NAME] [--out bench/results]

Per chunk count C and home-row count R: the split call (`bridge.forward(..., data_parallel=n,
split_chunks=C, split_home_rows=R)`, x on GPU 0; R rows computed on GPU 0 alone) timed with CUDA events,
all variants and the one-GPU call in one bench.timing.time_contenders run (alternating rounds of 5 warm
calls; the median), its output checked against the one-GPU call's with the harness rule, then one more
call under torch.profiler with CUDA activities. Chunk entries as in bench.scale's --split-chunks ("4", or
weights "1-4-4-1"). --host-profile: cProfile over 20 back-to-back calls of each split variant, the top
functions by own time printed and kept (where a split's host time goes). CUPTI sees the whole process,
so jax's kernels and copies are in the trace with torch's.
From it, per GPU: the span of its work, the time its kernels run (union of their intervals), the time copies
run, and how much of the copy time overlaps kernels on that GPU; plus the whole call's span. If the copies
overlap compute, the split costs about max(compute per GPU) + one chunk's copies; if not, compute plus all
copies. Writes <out>/split-timeline-<date>-<gpu>.json (summaries; the raw traces are not kept) and prints
a table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from bench.cuda_trace import profile_cuda, summarize_activity  # noqa: E402
from bench.report import write_json  # noqa: E402


def run(shape_id: str, chunk_specs: list[str], home_rows: list[int], rounds: int = 3,
        profile: bool = True, host_profile: bool = False) -> dict:
    import torch
    import bridge
    import jax
    import ttj_jax as T
    from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs
    from bench.scale import split_variants
    from bench.timing import time_contenders

    n = len(jax.devices())
    if n < 2:
        raise SystemExit(f"split_timeline needs several GPUs (jax sees {n})")
    config = T.OFFICIAL[shape_id].config
    _, model = harness_models(TransformerConfig(**vars(config)), bridge.TTJTransformer, device=torch.device("cuda"))
    x, mask = make_inputs(config, 4321, device="cuda")
    result = {"shape": T.OFFICIAL[shape_id].describe(), "devices": n, "chunks": {}}

    calls = {"one": lambda: bridge.forward(model, x, mask, data_parallel=1)}
    for (spec, home), fn in split_variants(model, x, mask, n, chunk_specs, home_rows).items():
        calls[f"{spec}/{home}"] = fn
    with torch.inference_mode():
        one = calls["one"]()
        # the harness's protocol (CUDA events per call), fewer calls: these take milliseconds
        times = time_contenders(calls, warmup=2, rounds=rounds, calls=5, device="cuda")
        result["one_device_ms"] = times["one"]["median_ms"]
        for name, call in calls.items():
            if name == "one":
                continue
            chunks, home = name.split("/")
            home = int(home)
            failed, worst = check_close(call(), one)
            record = {"ms": times[name]["median_ms"], "p10_ms": times[name]["p10_ms"],
                      "p90_ms": times[name]["p90_ms"], "speedup": result["one_device_ms"] / times[name]["median_ms"],
                      "home_rows": home, "home_share": (home + (x.shape[0] - home) / n) / x.shape[0],
                      "failed_vs_one": failed, "worst_err_over_tol_vs_one": worst}
            if profile:
                record.update(summarize_activity(profile_cuda(call)))
            if host_profile:
                record["host_profile"] = _host_profile(call, torch)
            result["chunks"][name if home else str(chunks)] = record
    return result


def _host_profile(call, torch, calls: int = 20, top: int = 25) -> dict:
    """cProfile over `calls` back-to-back calls (synced once at the end): host us per call, and the
    `top` functions by own time, in us per call."""
    import cProfile
    import pstats
    import time
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats   # {(file, line, name): (calls, primitive, own s, cumulative s, ...)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    functions = [{"function": f"{pathlib.Path(f).name}:{line}:{name}", "calls_per_call": v[0] / calls,
                  "own_us_per_call": v[2] / calls * 1e6, "cumulative_us_per_call": v[3] / calls * 1e6}
                 for (f, line, name), v in rows]
    print(f"host profile: {host_us:.0f} us per call (under cProfile)")
    for row in functions[:12]:
        print(f"  {row['own_us_per_call']:8.1f} us own {row['cumulative_us_per_call']:8.1f} cum "
              f"x{row['calls_per_call']:.0f}  {row['function']}")
    return {"host_us_per_call_profiled": host_us, "top_own_time": functions}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="6")
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--home-rows", default="0",
                        help="rows computed on x's GPU alone besides its share of the split; comma separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true", help="time and check only")
    parser.add_argument("--host-profile", action="store_true", help="cProfile each split variant's host work")
    parser.add_argument("--tag", default=None, help="file name stem (default: split-timeline-<date>-<gpu>x<n>)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import torch
    import jax
    result = run(args.shape, args.chunks.split(","), [int(r) for r in args.home_rows.split(",")],
                 rounds=args.rounds, profile=not args.no_profile, host_profile=args.host_profile)
    gpu = torch.cuda.get_device_name()
    result.update({"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__,
                   "date": datetime.date.today().isoformat(),
                   "command": "python bench/split_timeline.py " + " ".join(sys.argv[1:] if argv is None else argv)})
    stem = args.tag or f"split-timeline-{result['date']}-{gpu.split()[-1].lower()}x{result['devices']}"
    path = write_json(result, args.out, stem)
    print(f"{result['shape']}: one device {result['one_device_ms']:.2f} ms")
    print(f"{'chunks/home':>11} {'share':>6} {'ms':>7} {'speedup':>7} {'fail':>4} {'span':>7}  "
          "per GPU: span / kernels / copies / copies under kernels (ms)")
    for chunks, r in result["chunks"].items():
        per_gpu = "  ".join(f"gpu{d}: {v['span_ms']:.2f}/{v['kernel_ms']:.2f}/{v['copy_ms']:.2f}/"
                            f"{v['copy_overlapping_kernels_ms']:.2f}" for d, v in r.get("devices", {}).items())
        span = f"{r['span_ms']:7.2f}" if "span_ms" in r else f"{'':7}"
        print(f"{chunks:>11} {r['home_share']:6.3f} {r['ms']:7.2f} {r['speedup']:6.2f}x {r['failed_vs_one']:>4} "
              f"{span}  {per_gpu}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
