"""Short-sequence attention on the H200: our generic (Triton) kernel, as shape 8's program calls it (the
fused [B, S, 3, H, hd] projection layout), against our Hopper (Mosaic GPU) kernel and cuDNN, by GPU kernel
time from a CUPTI trace (bench.cuda_trace), every output checked against the fp32 reference.

    PYTHONPATH=. python3 bench/scratch/small_attention.py      (writes $OUT/small-attention.json)
"""
import datetime, json, os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch  # noqa: F401  (the profiler)
import jax, jax.numpy as jnp, numpy as np
from bench.cuda_trace import kernel_table, profile_cuda
from ttj_jax.kernels.flash_attention import attention_reference, flash_attention, flash_attention_fused_qkv
from ttj_jax.kernels.flash_attention_mgpu import MgpuBlockSizes, flash_attention_mgpu
try:   # session 11's in-place fused entry (absent from the first run's build)
    from ttj_jax.kernels.flash_attention_mgpu import flash_attention_mgpu_fused_qkv
except ImportError:
    flash_attention_mgpu_fused_qkv = None

CASES = [(64, 128, 4, 256), (64, 128, 4, 128), (64, 128, 2, 64), (64, 1024, 4, 64)]
results = []
for B, S, H, hd in CASES:
    qkv = jax.random.normal(jax.random.key(hd), (B, S, 3, H, hd), jnp.float32).astype(jnp.float16)
    q, k, v = (jnp.asarray(qkv[:, :, i]) for i in range(3))
    ref = np.asarray(attention_reference(q, k, v, causal=True), np.float32)
    variants = {
        "generic_fused_qkv": jax.jit(lambda a: flash_attention_fused_qkv(a, causal=True)),
        "mosaic_fused_qkv_sliced": jax.jit(lambda a: flash_attention_fused_qkv(a, causal=True, implementation="mosaic")),
        "generic_qkv": jax.jit(lambda a: flash_attention(a[:, :, 0], a[:, :, 1], a[:, :, 2], causal=True, implementation="generic")),
        "cudnn_qkv": jax.jit(lambda a: jax.nn.dot_product_attention(a[:, :, 0], a[:, :, 1], a[:, :, 2], is_causal=True, implementation="cudnn")),
    }
    if flash_attention_mgpu_fused_qkv is not None:
        variants["mosaic_fused_qkv_in_place"] = jax.jit(lambda a: flash_attention_mgpu_fused_qkv(a, causal=True))
        variants["generic_fused_qkv_forced"] = jax.jit(
            lambda a: flash_attention_fused_qkv(a, causal=True, implementation="generic"))
    for lowering in ("warpgroup", "lane"):
        variants[f"mosaic_qkv_{lowering}"] = jax.jit(lambda a, l=lowering: flash_attention_mgpu(
            a[:, :, 0], a[:, :, 1], a[:, :, 2], causal=True, lowering_semantics=l))
    if hd <= 128:
        variants["mosaic_qkv_kv64"] = jax.jit(lambda a: flash_attention_mgpu(
            a[:, :, 0], a[:, :, 1], a[:, :, 2], causal=True, block_sizes=MgpuBlockSizes(block_kv=64, num_stages=2, num_compute_wgs=2)))
    for name, fn in variants.items():
        record = {"B": B, "S": S, "H": H, "head_dim": hd, "variant": name}
        try:
            out = np.asarray(jax.block_until_ready(fn(qkv)), np.float32)
            record["max_abs_err"] = float(np.abs(out - ref).max())
            record["passed"] = bool(np.abs(out - ref).max() <= 2e-3 + 2e-2 * 0)  # fp16 output: ~1e-3 expected
            for _ in range(5):
                fn(qkv)
            table = kernel_table(profile_cuda(lambda: fn(qkv), calls=50), calls=50)
            record["kernel_us_per_call"] = table["kernel_us_per_call"]
            record["kernels"] = [(r["kernel"][:60], round(r["us_per_call"], 2)) for r in table["kernels"][:4]]
            flops = 2 * B * H * S * S * hd
            record["tflops_kernels"] = flops / (table["kernel_us_per_call"] * 1e-6) / 1e12
        except Exception as e:  # noqa: BLE001
            record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(record)
        print(json.dumps(record), flush=True)
print(f"{'case':>22} {'variant':>26} {'kernel us':>10} {'TFLOP/s':>8} {'err':>8}")
for r in results:
    case = f"{r['B']}x{r['S']}x{r['H']}x{r['head_dim']}"
    print(f"{case:>22} {r['variant']:>26} {r.get('kernel_us_per_call', float('nan')):10.2f} "
          f"{r.get('tflops_kernels', float('nan')):8.1f} {r.get('max_abs_err', float('nan')):8.1e} {r.get('error', '')[:60]}")
json.dump({"gpu": jax.devices()[0].device_kind, "note": "generic_fused_qkv is flash_attention_fused_qkv's "
           "automatic choice (since session 11 the Hopper kernel in place from FUSED_MIN_SEQ_LEN; the first "
           "-fused run had head_dim 256 only)", "jax": jax.__version__, "date": datetime.date.today().isoformat(),
           "command": "PYTHONPATH=. python3 bench/scratch/small_attention.py", "results": results},
          open(os.path.join(os.environ.get("OUT", "."), "small-attention.json"), "w"), indent=1)
