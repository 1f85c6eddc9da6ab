"""flash_attention(..., return_lse=True) on the GPU: each row's log-sum-exp against jax's logsumexp of the
fp32 scores (every row, or the last 8192 of S=100000: the rows that see the most keys), and the output
against the call without return_lse (bit for bit); also through flash_attention_fused_qkv with an all-True
key mask (the training forward's call). On sm_90 these cases run the Hopper kernel (ring_attention merges its
visits with that log-sum-exp).

    PYTHONPATH=. python3 bench/lse_check.py [--out DIR]

Writes <out>/lse-check-<date>-<gpu>.json; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import sys

_REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug, write_json  # noqa: E402
from ttj_jax.kernels import flash_attention, flash_attention_fused_qkv  # noqa: E402
from ttj_jax.kernels.flash_attention import use_mosaic_kernel  # noqa: E402

# (S, head_dim, causal). Every row of the shorter cases, the last ROWS of S=100000: a first version
# wrote rows past S into the next head's first rows, which only a check of all rows (and heads) saw.
CASES = ((4096, 64, True), (4096, 64, False), (1000, 64, False), (5000, 128, False), (8192, 256, True),
         (100_000, 64, True))
ROWS = 8192
TOLERANCE = 1e-3
# (S, head_dim, causal, implementation) through flash_attention_fused_qkv with an all-True key mask: the
# training forward's call (the fused entry of either kernel, the key-masked build). "mosaic": the Hopper
# kernel below the lengths the inference dispatch gives it, as the training forward takes it where the Hopper
# backward runs (flash_attention_bwd.VJP_FORWARD_WITH_HOPPER_BACKWARD).
FUSED_CASES = ((4096, 64, True, "auto"), (1024, 64, False, "auto"), (2048, 128, True, "auto"),
               (512, 64, False, "mosaic"), (512, 64, True, "mosaic"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=default_out_dir())
    args = parser.parse_args(argv)
    checks = []
    cases = [(*case, "auto", False) for case in CASES] + [(*case, True) for case in FUSED_CASES]
    for seq_len, head_dim, causal, implementation, fused in cases:
        keys = jax.random.split(jax.random.key(seq_len + head_dim), 3)
        q, k, v = (jax.random.normal(key, (1, seq_len, 4, head_dim), jnp.float32).astype(jnp.float16) for key in keys)
        if fused:
            qkv, mask = jnp.stack([q, k, v], axis=2), jnp.ones((1, seq_len), bool)
            out, lse = flash_attention_fused_qkv(qkv, causal=causal, key_mask=mask, return_lse=True,
                                                 implementation=implementation)
            plain = flash_attention_fused_qkv(qkv, causal=causal, key_mask=mask, implementation=implementation)
        else:
            out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
            plain = flash_attention(q, k, v, causal=causal)
        first = max(seq_len - ROWS, 0)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q[:, first:].astype(jnp.float32), k.astype(jnp.float32),
                            precision="highest") * head_dim ** -0.5
        if causal:
            scores = jnp.where(jnp.arange(seq_len)[None, :] <= jnp.arange(first, seq_len)[:, None], scores, -jnp.inf)
        err = float(jnp.max(jnp.abs(lse[:, :, first:] - jax.nn.logsumexp(scores, axis=-1))))
        identical = bool(jnp.array_equal(out, plain))
        kernel = "mosaic_gpu" if use_mosaic_kernel(q.dtype, seq_len, head_dim, masked=False, block_sizes=None,
                                                   interpret=False, implementation=implementation, fused=fused,
                                                   key_mask=fused) else "generic"
        checks.append({"S": seq_len, "head_dim": head_dim, "causal": causal, "fused_qkv_key_mask": fused,
                       "implementation": implementation,
                       "kernel": kernel,
                       "lse_max_abs_err_last_rows": err, "rows_checked": seq_len - first,
                       "out_bit_identical_without_lse": identical, "passed": err <= TOLERANCE and identical})
        print(checks[-1], flush=True)
    device = jax.devices()[0]
    gpu = getattr(device, "device_kind", device.platform)
    date = datetime.date.today().isoformat()
    command = "python bench/lse_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
    path = write_json({"gpu": gpu, "jax": jax.__version__, "date": date, "tolerance": TOLERANCE,
                       "command": command, "checks": checks}, args.out, f"lse-check-{date}-{slug(gpu)}")
    failed = [c for c in checks if not c["passed"]]
    print(f"{len(checks) - len(failed)}/{len(checks)} passed; wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
