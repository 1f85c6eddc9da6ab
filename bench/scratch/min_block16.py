"""Shape 7 with 16-wide head blocks in the Mosaic stack kernel: correct and faster? (session 24)

    PYTHONPATH=. python3 bench/scratch/min_block16.py OUT_DIR

Shape 7 (B=64, S=128, d_model 32, 4 heads of 8, 4 layers) runs the Mosaic whole-stack kernel with every
head's 8 columns zero-padded to fused_stack_mgpu.MIN_BLOCK = 32: four 32-column blocks, as much head
work as d_model 128. In session 24 a 16-wide build (MIN_BLOCK = 16) ran in GPU interpret mode on the CPU
(4 host devices, d_model 32, 4 heads, matching `emulate` and the harness rule) and lowered for CUDA,
but it had never run on a GPU. Prediction: half the padded q/k/v and context work; if that is about
half of the kernel's time, the kernel gets ~20-25% faster (0.049 -> ~0.038 ms). wgmma at N=16 is less
efficient, so less is possible.

Each width runs in its own child process (MIN_BLOCK is read when the kernel is built; a deadlock is a
timeout, not the end of the run). In each: 5 seeds against the fp32 reference (harness rule, worst
err/tol) and `emulate`; the output of seed 0 saved for the other width's comparison; the time per call of
back-to-back jax calls (bench.jax_timing.stream_ms_per_call, median of 5). Writes
OUT_DIR/min-block16-<date>-nvidia-h200.json.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import subprocess
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def child(width: int, out_dir: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import ttj_jax as T
    from bench.baseline import BaselineTransformer, TransformerConfig
    from bench.jax_timing import stream_ms_per_call
    from ttj_jax.kernels import fused_stack_mgpu as fsm

    fsm.MIN_BLOCK = width
    config = T.OFFICIAL["7"].config
    torch.manual_seed(0)
    base = BaselineTransformer(TransformerConfig(**vars(config))).eval()
    params = T.params_from_state_dict(base.state_dict(), config)
    weights = fsm.stack_weights_mgpu(params, config.num_heads)
    run = jax.jit(lambda w, x: fsm.fused_stack_mgpu_forward(w, x, num_heads=config.num_heads, causal=True))
    record = {"min_block": width, "mats_shape": list(weights.mats.shape)}
    worst, failed, emulate_diff = 0.0, 0, 0.0
    for seed in range(5):
        gen = torch.Generator().manual_seed(1000 + seed)
        x = jnp.asarray(torch.randn(config.batch_size, config.seq_len, config.d_model, generator=gen).numpy())
        y = np.asarray(run(weights, x))
        with jax.default_matmul_precision("highest"):
            ref = np.asarray(T.reference(params, x, config=config), np.float64)
        ratio = np.abs(y - ref) / np.maximum(0.002, 0.02 * np.abs(ref))
        worst = max(worst, float(np.nanmax(ratio)))
        failed += int((~(ratio <= 1)).sum())
        emulate_diff = max(emulate_diff, float(np.max(np.abs(y[:4] - fsm.emulate(weights, x[:4])))))
        if seed == 0:
            np.save(pathlib.Path(out_dir) / f"min-block-{width}-seed0.npy", y)
            x0 = x
    record.update(failed=failed, worst_err_over_tol=worst, emulate_diff_first4=emulate_diff)
    ms, calls = stream_ms_per_call(run, (weights, x0), min_seconds=0.3, repeats=5)
    record.update(ms_per_call=ms, calls_per_timing=calls)
    return record


def main(argv):
    if argv and argv[0] == "--child":
        try:
            print("RESULT " + json.dumps(child(int(argv[1]), argv[2])), flush=True)
        except Exception:   # noqa: BLE001
            print("RESULT " + json.dumps({"min_block": argv[1], "error": traceback.format_exc()[-3000:]}), flush=True)
        return 0
    out_dir = pathlib.Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    import jax
    import numpy as np
    import torch
    results = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
               "torch": torch.__version__, "date": datetime.date.today().isoformat(), "jax": jax.__version__,
               "command": "PYTHONPATH=. python3 bench/scratch/min_block16.py OUT", "widths": {}}
    for width in (32, 16):
        print(f"MIN_BLOCK {width} ...", flush=True)
        try:
            done = subprocess.run([sys.executable, __file__, "--child", str(width), str(out_dir)],
                                  capture_output=True, text=True, timeout=100)
            lines = [l for l in done.stdout.splitlines() if l.startswith("RESULT ")]
            rec = json.loads(lines[-1][7:]) if lines else {"crash": done.returncode, "stderr": done.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            rec = {"timeout": True}
        results["widths"][str(width)] = rec
        print(json.dumps(rec)[:1500], flush=True)
    files = [out_dir / f"min-block-{w}-seed0.npy" for w in (32, 16)]
    if all(f.exists() for f in files):
        a, b = (np.load(f) for f in files)
        results["max_abs_diff_16_vs_32"] = float(np.max(np.abs(a - b)))
        for f in files:
            f.unlink()
    path = out_dir / f"min-block16-{results['date']}-nvidia-h200.json"
    path.write_text(json.dumps(results, indent=1))
    print("wrote", path)
    for w, r in results["widths"].items():
        if "ms_per_call" in r:
            print(f"MIN_BLOCK {w}: {r['ms_per_call']:.4f} ms/call, failed {r['failed']}, worst {r['worst_err_over_tol']:.2f},"
                  f" emulate diff {r['emulate_diff_first4']:.2e}")
    print("16 vs 32 max abs diff:", results.get("max_abs_diff_16_vs_32"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
