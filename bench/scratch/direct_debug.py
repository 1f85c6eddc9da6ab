"""Debug: where does the direct launch's illegal address come from? Each step in its own process."""
import os, subprocess, sys

STEP = r'''
import os, sys, json
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch, bridge, jax, jax.numpy as jnp, numpy as np
import ttj_jax as T
from bench.baseline import harness_models, make_inputs, check_close
from bridge import runtime, direct
from ttj_jax.kernels.fused_stack import FusedWeights, direct_launch, StackBlocks
step, sid = sys.argv[1], sys.argv[2]
config = T.OFFICIAL[sid].config
base, ours = harness_models(config, bridge.TTJTransformer, device="cuda")
x, mask = make_inputs(config, 1234, device="cuda")
with torch.no_grad():
    ref = base(x, mask); layers = runtime.forward(ours, x, mask, stack="layers"); torch.cuda.synchronize()
    print("layers vs base", check_close(layers, ref), flush=True)
    if step == "jax":
        gpu = jax.devices("gpu")[0]
        params = jax.device_put(T.params_from_state_dict({k: v.detach().cpu().numpy() for k, v in ours.state_dict().items()}, config), gpu)
        prepared = T.prepare_weights(params, T.MIXED_FP16)
        jx = jax.device_put(jnp.asarray(x.cpu().numpy()), gpu)
        y = T.forward(prepared, jx, config=config, stack="fused"); y = np.asarray(jax.block_until_ready(y))
        print("jax fused vs base", check_close(torch.from_numpy(y.copy()), ref.cpu()), flush=True)
    else:
        state = runtime._STATES[ours]
        tensors = state.fused_tensors(); torch.cuda.synchronize()
        structs = FusedWeights({n: jax.ShapeDtypeStruct(tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                for n, t in zip(FusedWeights.FIELDS, tensors)}, d_model=config.d_model,
                               num_heads=config.num_heads, ffn_dim=config.ffn_dim)
        blocks = StackBlocks(num_warps=int(os.environ.get("W", "8")))
        spec = direct_launch(structs, tuple(x.shape), "float32", causal=True, blocks=blocks)
        k = direct.DirectKernel(spec, x.device)
        print("grid", spec.grid, "image", k.kind, "entry", k.entry, "shared", k.shared_bytes, "params", k.parameter_count, flush=True)
        out = torch.zeros_like(x)
        k(x, *tensors, out); torch.cuda.synchronize()
        print("direct vs base", check_close(out, ref), "vs layers", check_close(out, layers), flush=True)
        y = runtime.forward(ours, x, mask, stack="fused"); torch.cuda.synchronize()
        print("bridge fused:", runtime.explain(ours, x, mask), check_close(y, ref), flush=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            k(x, *tensors, out)
        end.record(); torch.cuda.synchronize()
        print(f"KERNEL_MS {sid} {start.elapsed_time(end) / 200:.4f}", flush=True)
'''

def run(step, sid, env=None):
    e = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, "-c", STEP, step, sid], capture_output=True, text=True, env=e, timeout=120)
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "cuda_event.cc" not in l and "deallocation" not in l
             and "Source Location" not in l and "cuda_status" not in l and "cuda_executor" not in l and l.strip()]
    print(f"=== {step} shape {sid} {env or ''} rc={r.returncode}")
    print("\n".join(lines[-25:]), flush=True)
    return r.returncode == 0 and "direct vs base (0," in r.stdout

ok = True
for sid in sys.argv[1:] or ["2", "12"]:
    ok &= run("direct", sid)
sys.exit(0 if ok else 1)
