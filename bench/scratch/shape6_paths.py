"""Session 22: why shape 6 runs slower through the bridge (7.087 ms) than from JAX (6.590) in the official
run (bench/results/official-2026-12-02-nvidia-h200-session22.json; session 14: 7.768 against 7.431).

The bridge launches the Mosaic whole-stack kernel itself on torch's stream (bridge/mosaic_launch.py); the
JAX contender runs the same kernel through XLA. The official run also times them differently: the bridge
with the harness's per-call CUDA events in rounds alternating with the baseline and the peer, JAX as the
wall-clock throughput of 100 calls run alone (bench/cli.py, _time_jax_loop). Here, in one process, one
input: the bridge's direct launch, the bridge through jax (a second module whose call was built with
TTJ_MOSAIC_LAUNCH=0), and the JAX call, each timed both ways, rounds alternating; and the two bridge
outputs compared. Prediction: if the methods explain it, all three agree within ~1% under one method;
if the direct launch is slower, it stays ~7% behind under both.

    PYTHONPATH=. python3 bench/scratch/shape6_paths.py OUT [shape]
"""
import json
import os
import statistics
import sys
import time

import torch

import bridge
import jax
import ttj_jax as T
from bench.baseline import TransformerConfig, harness_models, make_inputs
from bench.cli import _ttj_jax_contender
from bench.timing import time_contenders
from bridge import runtime


def throughput_ms(fn, sync, rounds=5, calls=30):
    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()   # the whole device: jax's streams too
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync(out)
        per_call.append((time.perf_counter() - start) * 1e3 / calls)
    return per_call


def main(out_dir, sid="6"):
    device = torch.device("cuda")
    config = T.OFFICIAL[sid].config
    hc = TransformerConfig(**vars(config))
    _, direct = harness_models(hc, bridge.TTJTransformer, device=device)
    _, via_jax = harness_models(hc, bridge.TTJTransformer, device=device)
    x, mask = make_inputs(hc, 1234, device=device)
    with torch.inference_mode():
        y_direct = direct(x, mask)
        os.environ["TTJ_MOSAIC_LAUNCH"] = "0"
        try:
            y_jax = via_jax(x, mask)
        finally:
            del os.environ["TTJ_MOSAIC_LAUNCH"]
        calls = {name: next(iter(runtime._STATES[m].calls.values())) for name, m in (("direct", direct), ("via_jax", via_jax))}
        result = {"shape": sid, "gpu": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
                  "direct_is_direct": calls["direct"].direct is not None,
                  "via_jax_is_direct": calls["via_jax"].direct is not None,
                  "via_jax_note": calls["via_jax"].direct_note,
                  "max_abs_diff_direct_vs_via_jax": float((y_direct - y_jax).abs().max())}
        jax_fn, _ = _ttj_jax_contender(direct, config, x)
        torch_sync = lambda out=None: torch.cuda.synchronize()   # noqa: E731
        jax_sync = lambda out=None: jax.block_until_ready(out) if out is not None else None   # noqa: E731
        contenders = {"direct": (lambda: direct(x, mask), torch_sync), "via_jax": (lambda: via_jax(x, mask), torch_sync),
                      "jax": (jax_fn, jax_sync)}
        for name, (fn, sync) in contenders.items():   # warm-up
            for _ in range(5):
                out = fn()
            sync(out)
        tput = {name: [] for name in contenders}
        for round_index in range(4):   # alternating order
            order = list(contenders) if round_index % 2 == 0 else list(contenders)[::-1]
            for name in order:
                fn, sync = contenders[name]
                tput[name] += throughput_ms(fn, sync, rounds=1, calls=30)
        events = time_contenders({"direct": contenders["direct"][0], "via_jax": contenders["via_jax"][0]},
                                 warmup=5, rounds=4, calls=30, device=device)
    result["throughput_ms"] = {n: {"median": statistics.median(v), "rounds": v} for n, v in tput.items()}
    result["events_ms"] = {n: t["median_ms"] for n, t in events.items()}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"shape{sid}-paths-2026-12-02-nvidia-h200.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "throughput_ms"}, indent=1))
    for n, v in result["throughput_ms"].items():
        print(f"throughput {n:8s} median {v['median']:.4f} ms  rounds {[round(r, 4) for r in v['rounds']]}")


if __name__ == "__main__":
    main(*sys.argv[1:])
