"""Where a batch split's time goes on several GPUs: a CUDA activity timeline of one warm call (issue 5:
shape 6 on two H200s ran 1.32x, not 1.8x, and chunking made it slower).

    PYTHONPATH=. python3 bench/split_timeline.py [--shape 6] [--chunks 1,2,4,8] [--out bench/results]

Per chunk count: the split call (`bridge.forward(..., data_parallel=n, split_chunks=C)`, x on GPU 0)
timed with CUDA events (bench.timing, median of 5 warm calls), then one more call under torch.profiler with CUDA
activities. CUPTI sees the whole process, so jax's kernels and copies are in the trace with torch's. From
it, per GPU: the span of its work, the time its kernels run (union of their intervals), the time copies
run, and how much of the copy time overlaps kernels on that GPU; plus the whole call's span. If the copies
overlap compute, the split costs about max(compute per GPU) + one chunk's copies; if not, compute plus all
copies. Writes <out>/split-timeline-<date>-<gpu>.json (summaries; the raw traces are not kept) and prints
a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from bench.cuda_trace import profile_cuda, summarize_activity  # noqa: E402


def run(shape_id: str, chunk_counts: list[int]) -> dict:
    import torch
    import bridge
    import jax
    import ttj_jax as T
    from bench.baseline import TransformerConfig, harness_models, make_inputs
    from bench.timing import time_contenders

    n = len(jax.devices())
    if n < 2:
        raise SystemExit(f"split_timeline needs several GPUs (jax sees {n})")
    config = T.OFFICIAL[shape_id].config
    _, model = harness_models(TransformerConfig(**vars(config)), bridge.TTJTransformer, device=torch.device("cuda"))
    x, mask = make_inputs(config, 4321, device="cuda")
    result = {"shape": T.OFFICIAL[shape_id].describe(), "devices": n, "chunks": {}}

    def timed(fn):   # the harness's protocol (CUDA events per call), fewer calls: these take milliseconds
        return time_contenders({"call": fn}, warmup=2, rounds=1, calls=5, device="cuda")["call"]["median_ms"]

    with torch.inference_mode():
        result["one_device_ms"] = timed(lambda: bridge.forward(model, x, mask, data_parallel=1))
        for chunks in chunk_counts:
            if x.shape[0] % (n * chunks):
                continue
            call = lambda c=chunks: bridge.forward(model, x, mask, data_parallel=n, split_chunks=c)   # noqa: E731
            record = {"ms": timed(call)}
            record.update(summarize_activity(profile_cuda(call)))
            result["chunks"][str(chunks)] = record
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="6")
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import torch
    import jax
    result = run(args.shape, [int(c) for c in args.chunks.split(",")])
    gpu = torch.cuda.get_device_name()
    result.update({"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__,
                   "date": datetime.date.today().isoformat(),
                   "command": "python bench/split_timeline.py " + " ".join(sys.argv[1:] if argv is None else argv)})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"split-timeline-{result['date']}-{gpu.split()[-1].lower()}x{result['devices']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{result['shape']}: one device {result['one_device_ms']:.2f} ms")
    print(f"{'chunks':>6} {'ms':>7} {'span':>7}  per GPU: span / kernels / copies / copies under kernels (ms)")
    for chunks, r in result["chunks"].items():
        per_gpu = "  ".join(f"gpu{d}: {v['span_ms']:.2f}/{v['kernel_ms']:.2f}/{v['copy_ms']:.2f}/"
                            f"{v['copy_overlapping_kernels_ms']:.2f}" for d, v in r["devices"].items())
        print(f"{chunks:>6} {r['ms']:7.2f} {r['span_ms']:7.2f}  {per_gpu}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
