"""head_dim 32 on the Hopper kernel inside the model (session 15), on the H200.

    PYTHONPATH=. python3 bench/scratch/hd32_model_check.py OUT_DIR

1. The fused-layout entry (what the model calls) against the kernel on q, k, v sliced out: bit for bit,
   at B=2 S=8192 H=4 hd=32 (the dispatch sends it to the Hopper kernel from S=8192).
2. The model (d=128, 4 heads of 32, ffn 128, 2 layers, causal) at B=2 S=8192: the planner's plan (our
   Hopper kernel) against the same model with attention="cudnn" and against the chunked fp32 reference
   on the first 1024 rows (causal prefix: rows [:K] depend on inputs [:K] only), harness rule.
Writes OUT_DIR/hd32-model-check-<date>-<gpu>.json.
"""
import datetime
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

import ttj_jax as T
from bench.baseline import check_close
from bench.report import slug
from ttj_jax.kernels import flash_attention_fused_qkv
from ttj_jax.kernels.flash_attention_mgpu import flash_attention_mgpu
from ttj_jax.model import plan_for


def harness(out, ref):
    """(failed elements, worst err/tol) by the harness's rule (bench.baseline.check_close)."""
    return check_close(torch.from_numpy(np.array(out)), torch.from_numpy(np.array(ref)))   # writable copies


def main(out_dir: str) -> int:
    device = jax.devices()[0]
    result = {"gpu": device.device_kind, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
              "command": "PYTHONPATH=. python3 bench/scratch/hd32_model_check.py OUT"}
    qkv = jax.random.normal(jax.random.key(0), (2, 8192, 3, 4, 32), jnp.float32).astype(jnp.float16)
    fused = flash_attention_fused_qkv(qkv, causal=True)
    split = flash_attention_mgpu(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    result["fused_entry_bit_identical"] = bool(jnp.array_equal(fused, split))
    config = T.Config(batch_size=2, seq_len=8192, d_model=128, num_heads=4, ffn_dim=128, num_layers=2,
                      causal=True)
    params = T.init_params(jax.random.key(1), config)
    x = jax.random.normal(jax.random.key(2), (2, 8192, 128), jnp.float32)
    result["plan"] = plan_for(config, x, T.MaskKind.NONE).explain()
    ours = T.forward(params, x, config=config)
    cudnn = T.forward(params, x, config=config, attention="cudnn")
    result["vs_cudnn_failed"], result["vs_cudnn_worst_err_over_tol"] = harness(ours, cudnn)
    k = 1024
    prefix_config = T.Config(batch_size=2, seq_len=k, d_model=128, num_heads=4, ffn_dim=128, num_layers=2,
                             causal=True)
    ref = T.forward(params, x[:, :k], config=prefix_config, policy="exact_fp32")
    result["prefix_k"] = k
    result["prefix_failed"], result["prefix_worst_err_over_tol"] = harness(ours[:, :k], ref)
    print(json.dumps(result, indent=1))
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hd32-model-check-{result['date']}-{slug(device.device_kind)}.json").write_text(json.dumps(result, indent=1) + "\n")
    ok = result["fused_entry_bit_identical"] and result["vs_cudnn_failed"] == 0 and result["prefix_failed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
