"""Which part of the bridge's Mosaic GPU launch aborts with "cuTensorMapEncodeTiled failed: invalid argument"
(H200, 2026-11-30, session 4): the module scan or the launcher? Each variant (TTJ_MOSAIC_VARIANT=
<module>-<launcher>, bridge/mosaic_launch.py) in its own child process (an abort kills the process), on
GPU-resident weights and input, against the same kernel through jax. Prints the first variant that
works as `BEST <variant>` last.

    PYTHONPATH=. python3 bench/scratch/mosaic_launch_debug.py

Ran at commit ba7e4c9 (bench/results/mosaic-launch-debug-2026-11-30-h200.log): our module scan works with jax's
launcher (ours-jax: output equal to the jax path, side stream equal, 16 us host); our own launcher
aborted with either module. The variant switch and our launcher were removed after that run; the script now
checks the remaining combination only, and stays as the record of how it was found.
"""
import os
import subprocess
import sys

# The variants the run compared; since then only "ours-jax" exists (the bridge's launch), so the script
# now checks that one: in its own child, output against the jax path, a side stream, host time.
VARIANTS = ["ours-jax"]

CHILD = r"""
import os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch, bridge, jax, jax.numpy as jnp, numpy as np
import ttj_jax as T
from ttj_jax.kernels import fused_stack_mgpu as fsm
from bridge.mosaic_launch import MosaicStackLaunch
gpu = jax.devices("gpu")[0]
config = T.OFFICIAL["2"].config
params = jax.device_put(T.init_params(jax.random.key(0), config), gpu)
w = fsm.stack_weights_mgpu(T.prepare_weights(params, T.get_policy("mixed_fp16")), config.num_heads)
xj = jax.device_put(jax.random.normal(jax.random.key(1), (1, 128, 128)), gpu)
y_jax = np.asarray(fsm.fused_stack_mgpu_forward(w, xj, num_heads=config.num_heads))
x = torch.from_dlpack(xj).clone(); mats = torch.from_dlpack(w.mats).clone(); vecs = torch.from_dlpack(w.vecs).clone()
print("ptrs", x.device, mats.device, hex(x.data_ptr()), hex(mats.data_ptr()), hex(vecs.data_ptr()), flush=True)
launch = MosaicStackLaunch(config, 1, 128, torch.device("cuda", 0))
y = launch(x, mats, vecs); torch.cuda.synchronize()
print("RESULT max|launch-jax|", float(np.abs(y.cpu().numpy() - y_jax).max()), flush=True)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    y2 = launch(x, mats, vecs)
side.synchronize()
print("RESULT side stream equal", bool(torch.equal(y2, y)), flush=True)
import time, statistics
for _ in range(50): launch(x, mats, vecs)
torch.cuda.synchronize(); s = []
for _ in range(300):
    t = time.perf_counter(); launch(x, mats, vecs); s.append(time.perf_counter() - t)
torch.cuda.synchronize()
print("RESULT host us", statistics.median(s) * 1e6, flush=True)
print("OK", flush=True)
"""

best = None
for variant in VARIANTS:
    env = dict(os.environ)
    try:
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=90, env=env)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = str(e.stdout or "") + str(e.stderr or ""), "timeout"
    lines = [line for line in out.splitlines()
             if line.startswith(("RESULT", "ptrs", "cuTensor", "OK")) or "Error" in line]
    print(f"== {variant}: rc={rc}", *lines[-8:], sep="\n  ", flush=True)
    if best is None and rc == 0 and "OK" in out:
        best = variant
print(f"BEST {best}")
