"""Can a torch CUDA graph capture the bridge's JAX program? (session 21, issue 4's host target.)

    PYTHONPATH=. python3 bench/scratch/jax_in_torch_graph.py OUT_DIR [SHAPES] [--no-cmdbuf]   (default 11,13,8)

docs/host-cost.md: on shapes 8, 11 and 13 the bridge's host time per call is 78-238 us above the JAX
call's, DLPack import and export alone over the 30 us target; the torch peer's CUDA-graph replay with
its copies costs 28-79 us of host. If torch's stream capture took in the JAX program too (torch's capture
stream -> the ordering event -> jax's stream for external ready events -> the import's definition event ->
jax's compute stream -> the export's wait -> torch's stream: every edge a cuStreamWaitEvent, which is how
other streams join a capture), a bridge call would be the peer's: copy x into the graph's input, one
replay, copy the output out. Whether PJRT's own event bookkeeping survives a capture is the question
(an event query or sync on an event recorded during capture is an error); each shape runs in a child
process so a crash is a result, not the end of the run.

Per shape, in the child: the bridge's module and its one warmed call (bench.host_overhead.warm_bridge);
capture under `torch.cuda.graph(capture_error_mode="relaxed")` of: ordering event, import of a static
input, the call's program, export, copy into a static output; then (if it captured) 5 replays on fresh
inputs against the bridge's own output (max |diff|: the same program, 0 expected), the host us per call
(drained, interleaved: graph = copy in + replay + clone out, against the bridge and the JAX call) and
CUDA-event ms per call of both loops. Writes OUT_DIR/jax-in-torch-graph-<date>-<gpu>.json.

Known hazard even if it works: XLA's temporary buffers of the captured execution go back to jax's
allocator after the capture, so a later jax program may be given the memory a replay still uses; a
product path would need the program's temporaries held (not possible through jax's public API).
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def child(sid: str) -> dict:
    import jax
    import torch

    from bench.cli import _time_jax_loop, _ttj_jax_contender
    from bench.host_overhead import warm_bridge
    from bench.timing import interleaved_host_overhead_us, time_contenders

    device = torch.device("cuda")
    config, ours, x, mask, state, call = warm_bridge(sid, device)
    record = {"shape": sid, "plan": call.plan.name if hasattr(call.plan, "name") else str(call.plan)[:120]}
    if call.direct is not None:
        record["skipped"] = "the bridge launches this shape itself (no jax program)"
        return record
    with torch.inference_mode():
        transfer = call.transfer
        weights = state.call_weights(call)
        static_x = x.clone()
        static_y = ours(static_x, mask).clone()
        torch.cuda.synchronize()

        def program():
            transfer.order_before_jax()
            jx = transfer.to_jax(static_x)
            out = call.run(weights, jx, None)
            return jx, out, transfer.to_torch(out)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):   # warm-up on a side stream, as torch asks before a capture
            for _ in range(3):
                static_y.copy_(program()[2])
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        import ctypes
        is_capturing = ctypes.CDLL("libcuda.so.1").cuStreamIsCapturing
        is_capturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
        steps = record["capture_status_after"] = {}   # cuStreamIsCapturing: 0 none, 1 active, 2 invalidated

        def status(step, raw_stream):
            value = ctypes.c_int(-1)
            rc = is_capturing(ctypes.c_void_p(raw_stream), ctypes.byref(value))
            steps[step] = {"rc": rc, "status": value.value}

        try:
            with torch.cuda.graph(graph, capture_error_mode="relaxed"):
                raw = torch.cuda.current_stream(device).cuda_stream
                status("begin", raw)
                transfer.order_before_jax()
                status("order_before_jax", raw)
                status("order_before_jax: jax's ready stream", transfer.importer.stream)
                jx = transfer.to_jax(static_x)
                status("to_jax", raw)
                status("to_jax: jax's ready stream", transfer.importer.stream)
                out = call.run(weights, jx, None)
                status("run", raw)
                y = transfer.to_torch(out)
                status("to_torch", raw)
                kept = (jx, out, y)   # the jax arrays stay alive: their memory is baked into the graph
                static_y.copy_(y)
                status("copy", raw)
            torch.cuda.synchronize()
        except Exception as e:   # noqa: BLE001 - the result of the experiment
            record["captured"] = False
            record["capture_error"] = f"{type(e).__name__}: {e}"[:300]
            return record
        record["captured"] = True
        record["capture_s"] = time.perf_counter() - t0

        diffs = []
        for seed in range(5):
            fresh = torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(seed),
                                device=device)
            static_x.copy_(fresh)
            graph.replay()
            got = static_y.clone()
            want = ours(fresh, mask)
            torch.cuda.synchronize()
            diffs.append(float((got - want).abs().max()))
        record["replay_max_abs_diff"] = max(diffs)
        record["replay_diffs"] = diffs

        def graph_call(inp=x):
            static_x.copy_(inp)
            graph.replay()
            return static_y.clone()

        jax_fn, _ = _ttj_jax_contender(ours, config, x)
        jax.block_until_ready(jax_fn())
        host = interleaved_host_overhead_us({"bridge": lambda: ours(x, mask), "graph": graph_call,
                                             "jax_direct": jax_fn}, 150, device=device)
        record["host_us"] = {k: v["median_us"] for k, v in host.items()}
        record["graph_minus_jax_us"] = host["graph"]["median_us"] - host["jax_direct"]["median_us"]
        timed = time_contenders({"bridge": lambda: ours(x, mask), "graph": graph_call}, warmup=20, rounds=3,
                                calls=100, device=device)
        record["events_ms"] = {k: t["median_ms"] for k, t in timed.items()}
        record["events_ms"]["jax_loop"] = _time_jax_loop(jax_fn, warmup=20, rounds=3, calls=100)["median_ms"]
        # after the timings: the graph still gives the bridge's output (nothing jax ran since took its memory?)
        fresh = torch.randn(x.shape, generator=torch.Generator(device=device).manual_seed(99), device=device)
        got = graph_call(fresh)
        record["after_timing_max_abs_diff"] = float((got - ours(fresh, mask)).abs().max())
    return record


def main(argv):
    if argv and argv[0] == "--child":
        try:
            print("RESULT " + json.dumps(child(argv[1])), flush=True)
        except Exception:   # noqa: BLE001
            print("RESULT " + json.dumps({"shape": argv[1], "error": traceback.format_exc()[-3000:]}), flush=True)
        return 0
    no_cmdbuf = "--no-cmdbuf" in argv   # run 3: XLA's own command buffers (CUDA graphs) off in the children
    argv = [a for a in argv if a != "--no-cmdbuf"]
    out_dir = pathlib.Path(argv[0])
    shapes = (argv[1] if len(argv) > 1 else "11,13,8").split(",")
    env = dict(os.environ)
    if no_cmdbuf:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    import jax
    import torch
    results = {"gpu": torch.cuda.get_device_name(0), "jax": jax.__version__, "torch": torch.__version__,
               "date": datetime.date.today().isoformat(),
               "command": "PYTHONPATH=. python3 bench/scratch/jax_in_torch_graph.py OUT " + ",".join(shapes)
               + (" --no-cmdbuf" if no_cmdbuf else ""), "children_xla_flags": env.get("XLA_FLAGS", ""),
               "shapes": {}}
    for sid in shapes:
        print(f"shape {sid} ...", flush=True)
        try:
            done = subprocess.run([sys.executable, __file__, "--child", sid], capture_output=True, text=True,
                                  timeout=150, env=env)
            lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
            rec = json.loads(lines[-1][7:]) if lines else {"shape": sid, "crash": done.returncode,
                                                             "stderr": done.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            rec = {"shape": sid, "timeout": True, "stderr": (e.stderr or b"")[-2000:].decode(errors="replace")
                   if isinstance(e.stderr, bytes) else str(e.stderr)[-2000:]}
        results["shapes"][sid] = rec
        print(json.dumps(rec)[:1500], flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = results["date"]
    path = out_dir / f"jax-in-torch-graph-{date}-nvidia-h200{'-no-cmdbuf' if no_cmdbuf else ''}.json"
    path.write_text(json.dumps(results, indent=1))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
