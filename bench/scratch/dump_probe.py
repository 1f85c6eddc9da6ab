"""What does XLA's dump hold for the fused kernel's compilation? (file names and sizes)"""
import os, glob, tempfile
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp
import ttj_jax as T
from ttj_jax.kernels.fused_stack import stack_weights, fused_stack_forward
c = T.OFFICIAL["2"].config
p = jax.eval_shape(lambda: T.init_params(jax.random.key(0), c))
w = jax.eval_shape(lambda p: stack_weights(T.prepare_weights(p, T.MIXED_FP16), num_heads=4), p)
x = jax.ShapeDtypeStruct((1, 128, 128), jnp.float32)
for opts in ({"xla_dump_to": "D"}, {"xla_dump_to": "D", "xla_dump_hlo_as_text": True, "xla_gpu_dump_llvmir": True}):
    with tempfile.TemporaryDirectory() as d:
        o = {k: (d if v == "D" else v) for k, v in opts.items()}
        try:
            jax.jit(lambda w, x: fused_stack_forward(w, x, num_heads=4, causal=True)).lower(w, x).compile(compiler_options=o)
        except Exception as e:
            print("compile error", type(e).__name__, str(e)[:300])
        files = sorted(glob.glob(os.path.join(d, "**", "*"), recursive=True))
        print(opts, len(files), [(os.path.basename(f)[-60:], os.path.getsize(f)) for f in files][:40])
