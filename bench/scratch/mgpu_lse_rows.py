import jax, jax.numpy as jnp, numpy as np, json, os
from ttj_jax.kernels.flash_attention_mgpu import flash_attention_mgpu, MgpuBlockSizes
res = {}
for S, causal, blocks in ((4096, False, None), (4096, True, None), (1000, False, None),
                          (4096, False, MgpuBlockSizes(block_kv=128, num_stages=2, num_compute_wgs=2))):
    H = 2
    ks = jax.random.split(jax.random.key(S), 3)
    q, k, v = (jax.random.normal(kk, (1, S, H, 64), jnp.float32).astype(jnp.float16) for kk in ks)
    out, lse = flash_attention_mgpu(q, k, v, causal=causal, return_lse=True, block_sizes=blocks)
    s = jnp.einsum("qhd,khd->hqk", q[0].astype(jnp.float32), k[0].astype(jnp.float32), precision="highest") / 8.0
    if causal: s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
    ref = np.asarray(jax.nn.logsumexp(s, -1)); got = np.asarray(lse[0])
    bad = np.abs(got - ref) > 1e-3
    rows = np.nonzero(bad.any(0))[0]
    key = f"S{S}_causal{causal}_{'default' if blocks is None else 'wg2'}"
    res[key] = {"bad_rows": int(len(rows)), "first": rows[:24].tolist(), "mod64": np.bincount(rows % 64, minlength=64).tolist() if len(rows) else [],
                "tile192": np.bincount(rows // 192).tolist() if len(rows) else [], "got_sample": got[0, rows[:6]].tolist(), "ref_sample": ref[0, rows[:6]].tolist()}
    print(key, {k: v for k, v in res[key].items() if k != "mod64"}, flush=True)
    print("  mod64", res[key]["mod64"], flush=True)
import datetime
meta = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat()}
json.dump({**meta, "results": res}, open(os.path.join(os.environ["OUT"], "mgpu-lse-rows.json"), "w"), indent=1)
