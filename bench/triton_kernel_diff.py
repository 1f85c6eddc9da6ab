"""The bridge's Triton launch of the rows stack (bridge/triton_launch.py) against jax's, kernel by kernel (GPU).

    PYTHONPATH=. python3 bench/triton_kernel_diff.py [--shapes 11,2,7] [--out DIR]

Two compiles of the same Pallas kernels run here: torch's Triton (the bridge's launch) and XLA's (jax's
path). Per official shape, with the harness's weights:
- per kernel: each step of the program launched alone on a workspace filled with 0xFF bytes (and an
  output of NaN), its outputs compared with jax's pallas_call on the same inputs: bitwise equal or not,
  elements that differ, max |difference|, NaNs;
- determinism: the whole launch four times, the allocator's blocks filled with 0, NaN, 1e30 and -7 in
  between: outputs bitwise equal, no NaN;
- stream order: the launch on a side stream behind ~50 ms of queued matmuls, bitwise the same;
- accuracy of both paths against the eager baseline on the 5 harness seeds (harness rule);
- host us per call (drained) of the Python launch and the jax path.
Writes <out>/triton-kernel-diff-<date>-<gpu>.json; prints a line per shape and per kernel.
"""
import argparse
import datetime
import json
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# The module's own calls run through jax (the comparison's other side); this tool builds the launch itself.
os.environ["TTJ_TRITON_LAUNCH"] = "0"
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from jax._src.pallas.pallas_call import pallas_call_p  # noqa: E402

import bridge  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.cli import HARNESS_SEEDS  # noqa: E402
from bench.mosaic_launch_check import on_busy_side_stream  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402
from bench.timing import host_us  # noqa: E402
from bridge import runtime, triton_launch  # noqa: E402


def tview(tensors, ref, aval):
    base = tensors[ref.base]
    flat = base.reshape(-1).view(torch.uint8)
    dt = np.dtype(aval.dtype)
    dtype = torch.bool if dt == np.bool_ else getattr(torch, dt.name)
    size = triton_launch._nbytes(aval)
    return flat[ref.offset:ref.offset + size].view(dtype).view(tuple(aval.shape))


def run_shape(sid, out):
    dev = torch.device("cuda")
    cfg = T.OFFICIAL[sid].config
    hc = TransformerConfig(**vars(cfg))
    baseline, module = harness_models(hc, bridge.TTJTransformer, device=dev)
    x, mask = make_inputs(hc, HARNESS_SEEDS[0], device=dev)
    rec = {"shape": sid}
    with torch.inference_mode():
        y_jax = runtime.forward(module, x, None, stack="rows")   # builds the call (its direct check may refuse)
        state = runtime.module_state(module)
        call = [c for k, c in state.calls.items() if k[-1] == "rows"][0]
        rec["direct_note"] = call.direct_note
        rec["direct"] = call.direct is not None
        xs = jax.ShapeDtypeStruct(tuple(x.shape), "float32")
        launch = triton_launch.TritonProgramLaunch(call.run, state.kernel_jax_weights("rows"), xs, None, dev)
        kern = launch._kernels
        rec["kernels"] = [(b.name, b.grid, b.num_warps, b.shared_bytes, b.num_params) for b in kern.binaries]
        weights = state.kernel_tensors("rows")
        prog = launch.program
        # per-step: every step launched alone, compared with jax's pallas_call on the same inputs
        ws = torch.full((max(prog.workspace_bytes, 1),), 0xFF, dtype=torch.uint8, device=dev)
        yo = torch.full(prog.out_shape, float("nan"), device=dev)
        tensors = [*weights, x.contiguous(), ws, yo]
        ptrs = [t.data_ptr() for t in tensors]
        kern._values[:len(kern._refs)] = [ptrs[r.base] + r.offset for r in kern._refs]
        steps = []
        for i, (step, lp) in enumerate(zip(prog.steps, kern._launches)):
            ins = [tview(tensors, r, v.aval) for r, v in zip(step.inputs, step.eqn.invars)]
            jins = [jax.dlpack.from_dlpack(t.clone()) for t in ins]
            torch.cuda.synchronize()
            st = kern._launch(*lp[:8], 0, lp[8], None)
            torch.cuda.synchronize()
            jres = pallas_call_p.bind(*jins, **step.eqn.params)
            jres = [torch.from_dlpack(r) for r in jres]
            torch.cuda.synchronize()
            outs = [tview(tensors, r, v.aval) for r, v in zip(step.outputs, step.eqn.outvars)]
            d = []
            for o, j in zip(outs, jres):
                of, jf = o.float(), j.float()
                diff = (of - jf).abs()
                d.append({"equal": bool(torch.equal(o, j)), "max_abs": float(diff.nan_to_num(1e30).max()),
                          "n_diff": int((o != j).sum()), "n": o.numel(), "nan_ours": int(of.isnan().sum()),
                          "nan_jax": int(jf.isnan().sum()), "max_ref": float(jf.abs().max())})
            steps.append({"i": i, "name": kern.binaries[i].name, "status": st, "outs": d})
        rec["steps"] = steps
        # determinism with garbage in the allocator's blocks
        outs = []
        for fill in (0.0, float("nan"), 1e30, -7.0):
            junk = torch.full((64 << 20,), fill, device=dev)
            del junk
            outs.append(launch(x, None, weights).clone())
        rec["deterministic"] = [bool(torch.equal(outs[0], o)) for o in outs]
        rec["nan_in_out"] = [int(o.isnan().sum()) for o in outs]
        # side stream
        y_side = on_busy_side_stream(lambda x_side: launch(x_side, None, weights), x)
        rec["side_equal"] = bool(torch.equal(y_side, outs[0]))
        rec["vs_jax_equal"] = bool(torch.equal(outs[0], y_jax))
        rec["vs_jax_max_abs"] = float((outs[0] - y_jax).abs().max())
        # accuracy of both against the baseline, 5 seeds
        acc = {"triton": [0, 0.0], "jax": [0, 0.0]}
        for seed in HARNESS_SEEDS:
            xs_, ms_ = make_inputs(hc, seed, device=dev)
            ref = baseline(xs_, ms_)
            for name, y in (("triton", launch(xs_, None, weights)), ("jax", runtime.forward(module, xs_, None, stack="rows"))):
                f, w = check_close(y, ref)
                acc[name][0] += f
                acc[name][1] = max(acc[name][1], w)
        rec["accuracy"] = acc
        rec["host_us_triton_py"] = host_us(lambda: launch(x, None, weights), drained=True)["median_us"]
        rec["host_us_jax"] = host_us(lambda: runtime.forward(module, x, None, stack="rows"), drained=True)["median_us"]
    out[sid] = rec
    print(json.dumps({k: v for k, v in rec.items() if k != "steps"}), flush=True)
    for s in rec["steps"]:
        outs = [(o["equal"], o["n_diff"], f"{o['max_abs']:.3g}", o["nan_ours"]) for o in s["outs"]]
        print("  ", s["i"], s["name"], s["status"], outs, flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="11,2,7")
    parser.add_argument("--out", default=None, help="folder for the JSON (default: bench.paths.default_out_dir())")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/triton_kernel_diff.py: needs a CUDA device", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    out_dir, stem = args.out or default_out_dir(), f"triton-kernel-diff-{datetime.date.today()}-{slug(gpu)}"
    out: dict = {}
    record = {"gpu": gpu, "jax": jax.__version__, "torch": torch.__version__, "date": str(datetime.date.today()),
              "command": " ".join(["bench/triton_kernel_diff.py", *(argv if argv is not None else sys.argv[1:])]),
              "shapes": out}
    failed = False
    for sid in args.shapes.split(","):
        try:
            run_shape(sid, out)
        except Exception:   # noqa: BLE001 - one shape's failure is recorded, the others still run
            traceback.print_exc()
            out[sid] = {"error": traceback.format_exc()[-2000:]}
            failed = True
        path = write_json(record, out_dir, stem)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
