import jax, jax.numpy as jnp, json, os
from ttj_jax.kernels.flash_attention_mgpu import flash_attention_mgpu
from ttj_jax.kernels import flash_attention
res = []
for S, causal, sem, H in ((4096, False, "lane", 16), (4096, False, "warpgroup", 16), (4096, True, "lane", 16),
                          (4160, False, "lane", 16), (8192, False, "lane", 4), (12000, False, "lane", 2)):
    ks = jax.random.split(jax.random.key(S), 3)
    q, k, v = (jax.random.normal(kk, (1, S, H, 64), jnp.float32).astype(jnp.float16) for kk in ks)
    out, lse = flash_attention_mgpu(q, k, v, causal=causal, lowering_semantics=sem, return_lse=True)
    gen = flash_attention(q, k, v, causal=causal, implementation="generic")
    errs = []
    for h in range(H):
        s = jnp.einsum("qd,kd->qk", q[0, :, h].astype(jnp.float32), k[0, :, h].astype(jnp.float32), precision="highest") / 8.0
        if causal: s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, -1)
        ref = p @ v[0, :, h].astype(jnp.float32)
        e = jnp.abs(out[0, :, h].astype(jnp.float32) - ref)
        bad_rows = jnp.nonzero(e.max(-1) > 2e-3, size=8, fill_value=-1)[0]
        errs.append((float(e.max()), float(jnp.abs(lse[0, h] - jax.nn.logsumexp(s, -1)).max()), [int(r) for r in bad_rows if r >= 0][:8]))
    r = {"S": S, "causal": causal, "lowering": sem, "H": H, "out_err_max": max(e[0] for e in errs),
         "lse_err_max": max(e[1] for e in errs), "bad_rows_example": [e[2] for e in errs if e[2]][:3],
         "generic_vs_mgpu_max": float(jnp.abs(gen.astype(jnp.float32) - out.astype(jnp.float32)).max())}
    print(r, flush=True); res.append(r)
import datetime
meta = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat()}
json.dump({**meta, "results": res}, open(os.path.join(os.environ["OUT"], "mgpu-diag.json"), "w"), indent=1)
