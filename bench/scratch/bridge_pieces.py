"""Session 22: the bridge's forward on the jax-path shapes, piece by piece, host us (drained, interleaved).

docs/host-cost.md ("Session 22") leaves ~22 us of shape 11's bridge call above the JAX call unexplained
by the pieces bench.host_overhead times (weights check, export, front). Here every step forward takes
for a kept-import call is timed alone, interleaved with the whole call and with the JAX program's
dispatch, so their sum can be set against the whole. Prediction: nn.Module's call ~2-3 us, the
ordering (stream getter, cuEventRecord, cuStreamWaitEvent) ~4-6, the kept import's lookup ~1,
the rest of forward's Python ~5.

    PYTHONPATH=. python3 bench/scratch/bridge_pieces.py OUT [shapes] [cuda] [loop]

With `loop` it also times, the harness's way (per-call CUDA events on torch's stream, rounds
alternating), the whole call, forward without nn.Module's call, the ordering + kept import + program
+ export alone, and the program + export alone (unordered: a timing, not a correct call), to see which
part makes a slow host's loop host-bound.
"""
import datetime
import json
import os
import sys

import torch

import jax
from bench.host_overhead import warm_bridge
from bench.timing import interleaved_host_overhead_us, time_contenders
from bridge import runtime


def pieces(sid: str, device: torch.device, loop: bool = False) -> dict:
    config, ours, x, mask, state, call = warm_bridge(sid, device)
    with torch.inference_mode():
        transfer = call.transfer
        weights = state.call_weights(call)
        ordered = transfer.order_programs()
        assert ordered or device.type != "cuda"
        jx = transfer.to_jax_kept(x) if ordered else transfer.to_jax(x)
        kept = jax.block_until_ready(call.run(weights, jx, None))
        cfg = ours.config
        key = (x.shape, x.dtype, x.device, state.classify(mask), None, None)
        variants = {
            "module_call": lambda: ours(x, mask),
            "runtime_forward": lambda: runtime.forward(ours, x, mask, config=cfg),
            "dispatch": lambda: call.run(weights, jx, None),
            "state_lookup": lambda: runtime._state(ours, cfg),
            "mask_checks": lambda: (isinstance(mask, torch.Tensor), mask.device != x.device),
            "signature": lambda: (x.shape, x.dtype, (mask.shape, mask.dtype)) in state.validated,
            "classify": lambda: state.classify(mask),
            "call_lookup": lambda: state.calls.get((x.shape, x.dtype, x.device, state.mask_kind, None, None)),
            "call_weights": lambda: state.call_weights(call),
            "current_key": state.current_key,
            "versions_only": lambda: list(map(runtime._version_of, state.params)),
            "jax_inputs": lambda: runtime._jax_inputs(call, x, mask),
            "order_programs": transfer.order_programs,
            "kept_lookup": lambda: transfer.to_jax_kept(x),
            "stream_getter": getattr(transfer, "current_raw_stream", lambda: None),
            "export_kept": lambda: transfer.to_torch(kept),
        }
        assert state.calls.get(key) is call
        host = interleaved_host_overhead_us(variants, 300, device=device)
        result = {name: round(v["median_us"], 2) for name, v in host.items()}
        if loop and device.type == "cuda":   # the harness's loop: per-call CUDA events, rounds alternating
            def kept_run_export():
                transfer.order_programs()
                return transfer.to_torch(call.run(weights, transfer.to_jax_kept(x), None))
            timed = time_contenders({
                "module_call": lambda: ours(x, mask),
                "runtime_forward": lambda: runtime.forward(ours, x, mask, config=cfg),
                "order_kept_run_export": kept_run_export,
                "run_export_unordered": lambda: transfer.to_torch(call.run(weights, jx, None)),
            }, warmup=20, rounds=4, calls=100, device=device)
            result["loop_ms"] = {name: {k: round(t[k], 5) for k in ("median_ms", "p10_ms", "p90_ms")}
                                 for name, t in timed.items()}
    return result


def main(out_dir, shapes="11,13,8", device="cuda", loop=""):
    device = torch.device(device)
    result = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "jax": jax.__version__, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(),
              "command": "PYTHONPATH=. python3 bench/scratch/bridge_pieces.py OUT " + " ".join(sys.argv[2:]),
              "shapes": {}}
    for sid in shapes.split(","):
        result["shapes"][sid] = pieces(sid, device, loop=bool(loop))
        print(sid, json.dumps(result["shapes"][sid]))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"bridge-pieces-2026-12-02-nvidia-h200{'-loop' if loop else ''}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
