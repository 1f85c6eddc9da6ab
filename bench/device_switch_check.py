"""Whether the bridge works whatever CUDA device is current (two GPUs needed).

    PYTHONPATH=. python3 bench/device_switch_check.py [--shape 6] [--out DIR]

On two H200s a split call left cuda:1 current, and the next one-device call of shape 6, a Mosaic kernel
launched directly, then ran nowhere: the harness's events timed 0.05 ms and its output was whatever the
allocator's block held. The bridge restores
the current device after a split and launches a direct kernel with its own device current. This checks
both on the GPU: (1) the current device after a split call is the one before it; (2) with cuda:1 made
current by hand, the one-device call on cuda:0 data gives the same output as with cuda:0 current (its
output buffer poisoned with NaN first, so a launch that does not run cannot pass), and its CUDA-event time
is the same as with cuda:0 current. Writes <out>/device-switch-<date>-<gpu>.json; exit 1 on a failure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from bench.paths import default_out_dir  # noqa: E402


def event_ms(fn, torch, calls: int = 5) -> float:
    stream = torch.cuda.current_stream(torch.device("cuda", 0))
    samples = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="6")
    parser.add_argument("--out", default=default_out_dir())
    args = parser.parse_args(argv)
    import jax
    import torch

    import bridge
    import ttj_jax as T
    from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs
    if len(jax.devices()) < 2:
        raise SystemExit("device_switch_check needs two GPUs")
    torch.cuda.set_device(0)
    cuda0 = torch.device("cuda", 0)
    config = T.OFFICIAL[args.shape].config
    _, model = harness_models(TransformerConfig(**vars(config)), bridge.TTJTransformer, device=cuda0)
    x, mask = make_inputs(config, 4321, device=cuda0)
    result = {"shape": args.shape, "plan_one_device": bridge.explain(model, x, mask)}
    with torch.inference_mode():
        one = lambda: bridge.forward(model, x, mask, data_parallel=1)   # noqa: E731
        reference = one().clone()
        result["ms_with_cuda0_current"] = event_ms(one, torch)
        before = torch.cuda.current_device()
        bridge.forward(model, x, mask, data_parallel=2, split_chunks=4)
        result["device_before_split"], result["device_after_split"] = before, torch.cuda.current_device()
        torch.cuda.synchronize(cuda0)
        # Poison the allocator's free blocks of the output's size, so a launch that does not run leaves NaN.
        poison = [torch.full_like(reference, float("nan")) for _ in range(3)]
        del poison
        torch.cuda.set_device(1)
        out = one()
        torch.cuda.synchronize(cuda0)
        result["ms_with_cuda1_current"] = event_ms(one, torch)
        torch.cuda.set_device(0)
        failed, worst = check_close(out, reference)
        result["failed_with_cuda1_current"], result["worst_err_over_tol"] = failed, worst
    ok = (result["device_after_split"] == result["device_before_split"] and failed == 0
          and result["ms_with_cuda1_current"] > 0.5 * result["ms_with_cuda0_current"])
    result.update({"ok": ok, "gpu": torch.cuda.get_device_name(0), "jax": jax.__version__,
                   "torch": torch.__version__, "date": datetime.date.today().isoformat(),
                   "command": "python bench/device_switch_check.py " + " ".join(sys.argv[1:] if argv is None else argv)})
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"device-switch-{result['date']}-{result['gpu'].split()[-1].lower()}x2.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
