"""Host time of the pieces of ttj_jax.forward on a GPU (shape 2, prepared weights), medians in us."""
import json, os, statistics, time, datetime
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax, jax.numpy as jnp, ttj_jax as T
from ttj_jax import model
from ttj_jax.model import validate_inputs, _mask_kind, _forward_call, kernel_weights, model_key
config = T.OFFICIAL["2"].config
prepared = jax.block_until_ready(T.prepare_weights(T.init_params(jax.random.key(0), config), T.MIXED_FP16))
x = jax.random.normal(jax.random.key(1), (config.batch_size, config.seq_len, config.d_model), jnp.float32)
ov = (("policy", None), ("attention", None), ("data_parallel", None), ("stack", None), ("sequence_parallel", None))
plan, run, kc = _forward_call(config, x, T.MaskKind.NONE, True, ov)
w = kernel_weights(prepared, kc, plan.stack)
pieces = {
    "forward": lambda: T.forward(prepared, x, config=config),
    "executable": lambda: run(w, x, None),
    "config_from_object": lambda: T.Config.from_object(config),
    "validate_inputs": lambda: validate_inputs(x.shape, jnp.dtype(x.dtype).name, None, None, config),
    "isinstance_array": lambda: isinstance(x, jax.Array),
    "mask_kind_none": lambda: _mask_kind(None),
    "forward_call": lambda: _forward_call(config, x, T.MaskKind.NONE, True, ov),
    "key_hash": lambda: hash((config, x.shape, x.dtype, x.sharding, T.MaskKind.NONE, True, ov)),
    "sharding": lambda: x.sharding,
    "tracer_check": lambda: isinstance(x, jax.core.Tracer),
    "kernel_weights": lambda: kernel_weights(prepared, kc, plan.stack),
}
samples = {k: [] for k in pieces}
for i in range(3000):
    for k, f in pieces.items():
        a = time.perf_counter(); out = f(); samples[k].append((time.perf_counter() - a) * 1e6)
    if i % 50 == 49:
        jax.block_until_ready(run(w, x, None))
res = {k: round(statistics.median(v), 2) for k, v in samples.items()}
print(res)
json.dump({"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
           "command": "PYTHONPATH=. python3 bench/scratch/forward_pieces.py", "median_us": res},
          open(os.path.join(os.environ.get("OUT", "."), "forward-pieces.json"), "w"), indent=1)
