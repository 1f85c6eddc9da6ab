"""Where the bridge's jax-path host time goes, piece by piece, and why its input import cannot be cached (GPU).

Two questions, one run (session 11, issue 4's bridge-cost target):
1. Ordering. Does jax's stream for external ready events (the one `_Transfer.order_before_jax` makes wait
   on torch) order jax's *programs*, or only later imports? Test: (a) a long jax program dispatched, then
   an event recorded on that stream: still pending -> the stream follows jax's compute; (b) torch's stream
   busy, order_before_jax(), then a jax program on an input imported *earlier* (cached): if jax finishes
   while torch's work still runs, the ordering reached jax's program only through a fresh import's
   definition event (the session-5/8 cache bug: harness events 0.0013 ms); (c) the same with a fresh import.
2. Cost. Drained host time (the GPU synced before each sample, samples interleaved in shuffled turns, as
   bench.timing.interleaved_host_overhead_us) of each per-call piece of the bridge's jax path on shapes 11,
   13, 8, with cheaper alternatives: the ordering through the CUDA driver (cuEventRecord +
   cuStreamWaitEvent on raw handles) instead of torch's Event/ExternalStream wrappers; torch._C._to_dlpack;
   dispatch with the weights as a pytree vs as a flat list of arrays; and jax's dispatch cost per argument
   (trivial programs of 1, 10, 50 arguments).

    PYTHONPATH=. python3 bench/scratch/hotpath_parts.py [--shapes 11,13,8] [--calls 200]
Writes $OUT/hotpath-parts.json (or bench/results/ without $OUT).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import random
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench.host_overhead import warm_bridge  # noqa: E402
from bridge import runtime  # noqa: E402


def sample(variants: dict, calls: int, device, warmup: int = 10) -> dict:
    """variants: name -> (setup or None, fn); fn(setup's result) is timed, setup is not.
    Returns name -> {median_us, p10_us, p90_us}."""
    names = list(variants)
    for name in names:
        setup, fn = variants[name]
        for _ in range(warmup):
            fn(setup() if setup else None)
    torch.cuda.synchronize(device)
    out = {n: [] for n in names}
    shuffler = random.Random(0)
    for _ in range(calls):
        order = names[:]
        shuffler.shuffle(order)
        for name in order:
            setup, fn = variants[name]
            torch.cuda.synchronize(device)
            arg = setup() if setup else None
            start = time.perf_counter()
            result = fn(arg)
            out[name].append((time.perf_counter() - start) * 1e6)
            del result, arg
    torch.cuda.synchronize(device)
    return {n: {"median_us": statistics.median(s), "p10_us": float(np.percentile(s, 10)),
                "p90_us": float(np.percentile(s, 90))} for n, s in out.items()}


class RawOrder:
    """order_before_jax through the CUDA driver: one cuEventRecord on torch's current stream, one
    cuStreamWaitEvent on jax's stream for external ready events (raw handles, cached event)."""

    def __init__(self, device: torch.device, jax_stream: int):
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda.cuEventCreate.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        self.cuda.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.cuda.cuStreamWaitEvent.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self.event = ctypes.c_void_p()
        torch.cuda.current_stream(device)   # torch's context current on this thread
        assert self.cuda.cuEventCreate(ctypes.byref(self.event), 2) == 0   # CU_EVENT_DISABLE_TIMING
        self.index = device.index
        self.jax_stream = jax_stream
        self.raw_stream = torch._C._cuda_getCurrentRawStream
        self.record, self.wait = self.cuda.cuEventRecord, self.cuda.cuStreamWaitEvent

    def __call__(self):
        if self.record(self.event, self.raw_stream(self.index)):
            raise RuntimeError("cuEventRecord failed")
        if self.wait(self.jax_stream, self.event, 0):
            raise RuntimeError("cuStreamWaitEvent failed")


def ordering(device) -> dict:
    transfer = runtime._transfer(device)
    ext = transfer.jax_stream
    a = jnp.asarray(np.random.default_rng(0).standard_normal((8192, 8192), np.float32))

    @jax.jit
    def long_program(a):
        for _ in range(24):
            a = jnp.tanh(a @ a * 1e-3)
        return a
    jax.block_until_ready(long_program(a))
    result = {}
    # (a) is the external-ready-events stream behind jax's compute?
    torch.cuda.synchronize(device)
    y = long_program(a)
    time.sleep(0.002)
    probe = torch.cuda.Event()
    probe.record(ext)
    result["ext_stream_waits_for_jax_program"] = not probe.query()
    jax.block_until_ready(y)
    probe.synchronize()

    # (b), (c): torch busy, ordering event, jax program on a cached / fresh import
    x = torch.randn(4096, 4096, device=device)
    small = jax.jit(lambda v: v * 2.0 + 1.0)
    transfer.order_before_jax()
    cached = transfer.to_jax(x)
    jax.block_until_ready(small(cached))
    busy = torch.randn(8192, 8192, device=device)
    for case in ("cached", "fresh", "cached_raw_order"):
        torch.cuda.synchronize(device)
        for _ in range(12):
            busy = torch.tanh(busy @ busy * 1e-3)
        torch_done = torch.cuda.Event()
        torch_done.record(torch.cuda.current_stream(device))
        if case == "cached_raw_order":
            RawOrder(device, transfer.importer.stream)()
            arg = cached
        else:
            transfer.order_before_jax()
            arg = cached if case == "cached" else transfer.to_jax(x)
        jax.block_until_ready(small(arg))
        result[f"{case}: torch work done when jax's program was"] = torch_done.query()
        torch.cuda.synchronize(device)
    return result


def shape_parts(sid: str, calls: int, device) -> dict:
    _, ours, x, mask, state, call = warm_bridge(sid, device)
    with torch.inference_mode():
        assert call.direct is None, f"shape {sid} is a direct launch; this script times the jax path"
        transfer = call.transfer
        weights = state.call_weights(call)
        transfer.order_before_jax()
        jx = transfer.to_jax(x)
        out = jax.block_until_ready(call.run(weights, jx, None))
        raw = RawOrder(device, transfer.importer.stream)
        leaves, treedef = jax.tree_util.tree_flatten(weights)
        body = getattr(call.run, "__wrapped__", call.run)   # the function jit wraps: options go on the outer jit
        flat_run = jax.jit(lambda ls, v: body(jax.tree_util.tree_unflatten(treedef, ls), v, None),
                           compiler_options=dict(call.plan.xla_options) or None)
        jax.block_until_ready(flat_run(leaves, jx))
        to_dlpack = torch.utils.dlpack.to_dlpack
        to_dlpack_c = getattr(torch._C, "_to_dlpack", to_dlpack)
        importer = transfer.importer
        dev_index = device.index

        def fresh():
            transfer.order_before_jax()
            return transfer.to_jax(x)

        def dispatched():
            return call.run(weights, fresh(), None)

        variants = {
            "current_stream": (None, lambda _: torch.cuda.current_stream(device)),
            "raw_stream": (None, lambda _: torch._C._cuda_getCurrentRawStream(dev_index)),
            "order_torch": (None, lambda _: transfer.order_before_jax()),
            "order_raw": (None, lambda _: raw()),
            "to_dlpack": (None, lambda _: to_dlpack(x)),
            "to_dlpack_c": (None, lambda _: to_dlpack_c(x)),
            "import_native": (lambda: to_dlpack(x), lambda cap: importer.from_capsule(cap)),
            "import_now": (None, lambda _: fresh()),
            "import_raw_order": (None, lambda _: (raw(), importer.from_capsule(to_dlpack_c(x)))[1]),
            "dispatch_cached_x": (None, lambda _: call.run(weights, jx, None)),
            "dispatch_fresh_x": (fresh, lambda v: call.run(weights, v, None)),
            "dispatch_flat_leaves": (None, lambda _: flat_run(leaves, jx)),
            "export_idle": (lambda: jax.block_until_ready(call.run(weights, jx, None)),
                            lambda y: transfer.to_torch(y)),
            "export_after_dispatch": (dispatched, lambda y: transfer.to_torch(y)),
            "weights_check": (None, lambda _: state.call_weights(call)),
            "bridge": (None, lambda _: ours(x, mask)),
            "bridge_no_mask": (None, lambda _: ours(x, None)),
        }
        host = sample(variants, calls, device)
        # the raw ordering keeps torch's writes before jax's reads: x rewritten behind busy torch work
        busy = torch.randn(4096, 4096, device=device)
        worst = 0.0
        gen = torch.Generator(device=device).manual_seed(3)
        for _ in range(5):
            values = torch.randn(x.shape, generator=gen, device=device)
            torch.cuda.synchronize(device)
            for _ in range(4):
                busy = (busy @ busy).mul_(1e-2)
            x.copy_(values)
            raw()
            y = transfer.to_torch(call.run(weights, importer.from_capsule(to_dlpack_c(x)), None))
            expected = ours(values.clone(), None)
            worst = max(worst, float((y - expected).abs().max()))
    return {"plan": call.plan.stack, "args": len(leaves) + 1, "host_us": host,
            "raw_order_max_abs_diff": worst}


def arg_count_dispatch(calls: int, device) -> dict:
    variants = {}
    for n in (1, 10, 50):
        arrays = [jnp.full((128,), float(i)) for i in range(n)]
        f = jax.jit(lambda *a: sum(v[:1] for v in a))
        jax.block_until_ready(f(*arrays))
        variants[f"args{n}"] = (None, lambda _, f=f, arrays=arrays: f(*arrays))
    return sample(variants, calls, device)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="11,13,8")
    p.add_argument("--calls", type=int, default=200)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    result = {"gpu": torch.cuda.get_device_name(device), "jax": jax.__version__, "torch": torch.__version__,
              "date": datetime.date.today().isoformat(),
              "command": f"PYTHONPATH=. python3 bench/scratch/hotpath_parts.py --shapes {args.shapes} "
                         f"--calls {args.calls}"}
    result["ordering"] = ordering(device)
    print("ordering:", json.dumps(result["ordering"], indent=1), flush=True)
    result["arg_count_dispatch_us"] = arg_count_dispatch(args.calls, device)
    result["shapes"] = {}
    for sid in args.shapes.split(","):
        print(f"shape {sid} ...", flush=True)
        result["shapes"][sid] = shape_parts(sid, args.calls, device)
    out_dir = os.environ.get("OUT", "bench/results")
    path = os.path.join(out_dir, "hotpath-parts.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("dispatch by argument count (us):",
          {k: round(v["median_us"], 1) for k, v in result["arg_count_dispatch_us"].items()})
    names = list(next(iter(result["shapes"].values()))["host_us"])
    print(f"{'piece (drained median us)':<24}" + "".join(f"{'shape ' + s:>12}" for s in result["shapes"]))
    for n in names:
        print(f"{n:<24}" + "".join(f"{r['host_us'][n]['median_us']:12.1f}" for r in result["shapes"].values()))
    print("raw-order check max|diff|:", {s: r["raw_order_max_abs_diff"] for s, r in result["shapes"].items()})
    print("args:", {s: r["args"] for s, r in result["shapes"].items()}, "->", path)


if __name__ == "__main__":
    main()
