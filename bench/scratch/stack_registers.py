"""The Mosaic stack kernel's consumer register budget: (232, 40) (the default) against (240, 32), per shape:
ptxas's spill report for each build (MOSAIC_GPU_DUMP_PTXAS=1 in the environment: ptxas's lines go to the
process's output, in build order: 232-40 then 240-32 per shape), outputs compared bit for bit, then kernel
time by alternating rounds of back-to-back calls (bench.jax_timing). (MOSAIC_GPU_DUMP_TO is not used: it
turns on every dump, the MLIR passes and SASS included, ~30 s per build of this kernel.)

Result on the H200 (2026-12-01, bench/results/stack-registers-2026-12-01-nvidia-h200.log): at shape 2
ptxas spilled 868/1172 bytes (stores/loads) at 232 registers and 784/1060 at 240, and the 240-32 build
never finished its first call (the run hit its 250 s limit there): the kernel is launched with the 168
registers per thread ptxas reports for 384 threads (64512 per block), and 2 * 240 + 32 = 512 per lane
asks for more than that, so the consumers' setmaxnreg increase waits forever. 232-40 (504 = 3 * 168)
is the ceiling; fewer spills need fewer live values, not a bigger budget.

    PYTHONPATH=. python3 bench/scratch/stack_registers.py OUT_DIR [shapes, default 2,1,12,5]
"""
import datetime
import importlib
import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ttj_jax as T  # noqa: E402
from bench.jax_timing import stream_ms_per_call  # noqa: E402

fsm = importlib.import_module("ttj_jax.kernels.fused_stack_mgpu")
BUDGETS = {"232-40": (232, 40), "240-32": (240, 32)}
ROUNDS = 5


def build(shape_id, budget, out):
    c = T.OFFICIAL[shape_id].config
    fsm._REGISTERS = BUDGETS[budget]
    print(f"build {shape_id} {budget}", flush=True)
    kernel = fsm.kernel_function(c.batch_size, c.seq_len, c.num_heads, c.num_layers, True, d_model=c.d_model)
    fn = jax.jit(lambda x, m, v: kernel(x, m, v))
    weights = fsm.stack_weights_mgpu(T.init_params(jax.random.key(0), c), c.num_heads)
    x = jax.random.normal(jax.random.key(1), (c.batch_size, c.seq_len, c.d_model), jnp.float32)
    y = jax.block_until_ready(fn(x, weights.mats, weights.vecs))
    return fn, (x, weights.mats, weights.vecs), np.asarray(y)


def main(out_dir, shapes="2,1,12,5"):
    out = pathlib.Path(out_dir)
    result = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
              "command": "PYTHONPATH=. python3 bench/scratch/stack_registers.py OUT " + shapes, "shapes": {}}
    for shape_id in shapes.split(","):
        built = {name: build(shape_id, name, out) for name in BUDGETS}
        ref = built["232-40"][2]
        row = {"bitwise_equal": {name: bool(np.array_equal(b[2], ref)) for name, b in built.items()},
               "us": {name: [] for name in BUDGETS}}
        for r in range(ROUNDS):
            for name in (BUDGETS if r % 2 == 0 else reversed(list(BUDGETS))):
                fn, args = built[name][0], built[name][1]
                ms, _ = stream_ms_per_call(fn, args, min_seconds=0.05, repeats=3)
                row["us"][name].append(ms * 1e3)
        row["median_us"] = {name: statistics.median(v) for name, v in row["us"].items()}
        result["shapes"][shape_id] = row
        print(shape_id, json.dumps({k: row[k] for k in ("bitwise_equal", "median_us")}), flush=True)
        (out / f"stack-registers-{result['date']}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
