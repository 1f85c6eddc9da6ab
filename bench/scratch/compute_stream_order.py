"""Ordering jax's compute stream itself behind torch's, so the bridge could keep x's import (session 21).

    PYTHONPATH=. python3 bench/scratch/compute_stream_order.py OUT_DIR [SHAPES]      (default 11,13,8)

Why: the bridge re-imports x through DLPack on every call (22-102 us of host, docs/host-cost.md) because
the only torch -> jax edge it had was a wait put on jax's stream for external ready events, which orders
a program only through a fresh import's definition event (bridge/runtime.py, _Transfer). jax's
`buffer_callback` hands its callback XLA's computation stream (`ctx.stream`); with that handle the
ordering event can be waited on by the compute stream directly, and an import kept from an earlier call
would be as well ordered as a fresh one. This measures, per shape, without changing the bridge:
- the stream `buffer_callback` reports, over several calls (stable?), against jax's ready-events stream;
- ordering: x rewritten in place behind ~1 ms of queued torch matmuls, then the bridge's program on the
  import kept from before, with the ordering event waited on by the compute stream ("ordered") and, as
  the control that shows the check can fail, with no wait at all ("unordered"); max |diff| against the
  bridge on a fresh copy (0 expected for "ordered");
- host us per call (drained, interleaved): the bridge, the JAX call, and kept import + compute-stream wait
  + program + export ("kept_import"), and the same without the export ("kept_import_no_export").
Writes OUT_DIR/compute-stream-order-<date>-nvidia-h200.json.
"""
from __future__ import annotations

import ctypes
import datetime
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from bench.cli import _ttj_jax_contender  # noqa: E402
from bench.host_overhead import warm_bridge  # noqa: E402
from bench.timing import interleaved_host_overhead_us  # noqa: E402
from bridge.direct import _driver  # noqa: E402


def compute_streams(calls: int = 4) -> list[int]:
    from jax.experimental.buffer_callback import buffer_callback
    seen = []

    def note_stream(ctx, out):
        seen.append(int(ctx.stream))

    probe = jax.jit(lambda: buffer_callback(note_stream, jax.ShapeDtypeStruct((1,), jnp.float32),
                                            has_side_effect=True)())
    for _ in range(calls):
        jax.block_until_ready(probe())
    return seen


def shape_record(sid: str, compute_stream: int, device: torch.device) -> dict:
    config, ours, x, mask, state, call = warm_bridge(sid, device)
    record = {"shape": sid}
    if call.direct is not None:
        record["skipped"] = "launched by the bridge itself"
        return record
    driver = _driver()
    driver.cuEventCreate.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    driver.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    driver.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
    event = ctypes.c_void_p()
    assert driver.cuEventCreate(ctypes.byref(event), 0x2) == 0
    torch_stream = torch._C._cuda_getCurrentRawStream
    index = device.index or 0

    def order_compute_stream():
        assert driver.cuEventRecord(event, ctypes.c_void_p(torch_stream(index))) == 0
        assert driver.cuStreamWaitEvent(ctypes.c_void_p(compute_stream), event, 0) == 0

    with torch.inference_mode():
        transfer = call.transfer
        weights = state.call_weights(call)
        x_kept = x.clone()
        transfer.order_before_jax()
        jx_kept = transfer.to_jax(x_kept)   # imported once, reused below

        def kept(order=True, export=True):
            if order:
                order_compute_stream()
            out = call.run(weights, jx_kept, None)
            return transfer.to_torch(out) if export else out

        busy = torch.randn(4096, 4096, device=device)
        generator = torch.Generator(device=device).manual_seed(7)
        for name, order in (("ordered", True), ("unordered", False)):
            worst, rounds = 0.0, 10
            for _ in range(rounds):
                values = torch.randn(x.shape, generator=generator, device=device)
                torch.cuda.synchronize(device)
                for _ in range(6):
                    busy = (busy @ busy).mul_(1e-2)   # ~1 ms of torch work queued
                x_kept.copy_(values)                  # queued behind it
                got = kept(order=order)
                want = ours(values.clone(), mask)
                worst = max(worst, float((got - want).abs().max()))
            record[f"{name}_max_abs_diff"] = worst
            record[f"{name}_rounds"] = rounds
        jax_fn, _ = _ttj_jax_contender(ours, config, x)
        jax.block_until_ready(jax_fn())
        x_kept.copy_(x)
        host = interleaved_host_overhead_us({
            "bridge": lambda: ours(x, mask), "jax_direct": jax_fn, "kept_import": kept,
            "kept_import_no_export": lambda: kept(export=False), "order_alone": order_compute_stream,
        }, 150, device=device)
        record["host_us"] = {k: v["median_us"] for k, v in host.items()}
        record["kept_minus_jax_us"] = host["kept_import"]["median_us"] - host["jax_direct"]["median_us"]
        record["bridge_minus_jax_us"] = host["bridge"]["median_us"] - host["jax_direct"]["median_us"]
    return record


def main(argv):
    out_dir = pathlib.Path(argv[0])
    shapes = (argv[1] if len(argv) > 1 else "11,13,8").split(",")
    device = torch.device("cuda", 0)
    torch.cuda.init()
    jax.devices()
    streams = compute_streams()
    from ttj_jax.compat import dlpack_importer
    ready = dlpack_importer(*torch.empty(1, device=device).__dlpack_device__()).stream
    result = {"gpu": torch.cuda.get_device_name(0), "jax": jax.__version__, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(),
              "command": "PYTHONPATH=. python3 bench/scratch/compute_stream_order.py OUT " + ",".join(shapes),
              "buffer_callback_streams": streams, "ready_events_stream": ready, "shapes": {}}
    print("compute streams", streams, "ready-events stream", ready, flush=True)
    if len(set(streams)) != 1:
        print("the compute stream is not stable: stop", flush=True)
    else:
        for sid in shapes:
            try:
                rec = shape_record(sid, streams[0], device)
            except Exception as e:   # noqa: BLE001 - a result
                rec = {"shape": sid, "error": f"{type(e).__name__}: {e}"[:1500]}
            # after the bridge has run: is the compute stream still the one reported?
            rec["buffer_callback_streams_after"] = compute_streams(2)
            result["shapes"][sid] = rec
            print(json.dumps(rec), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"compute-stream-order-{result['date']}-nvidia-h200.json"
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
