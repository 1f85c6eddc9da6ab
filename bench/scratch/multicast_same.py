"""Is kv_multicast's output the plain kernel's, bit for bit, on every entry that reaches it? (session 19)

    PYTHONPATH=. python3 bench/scratch/multicast_same.py OUT_DIR

MgpuBlockSizes.kv_multicast changes only how K and V reach shared memory (one TMA load per cluster
multicast into both blocks, instead of one per block), not one operation of the arithmetic, so its
output must equal the same tiling's without it exactly. Per case: `flash_attention_mgpu` with and
without it, `flash_attention_mgpu_fused_qkv` (q, k, v read in place from [B, S, 3, H, hd], the model's
layout) with and without it, and, where it dispatches here (S >= MIN_SEQ_LEN), the public
`ttj_jax.kernels.flash_attention` (its default has kv_multicast from MULTICAST_MIN_SEQ_LEN on); every output compared with the plain unfused one
(array_equal), which is also checked against the fp32 reference on its first, middle and last 64 rows
(harness rule). Writes OUT_DIR/multicast-same-<date>-<gpu>.json and prints a line per case.
"""
from __future__ import annotations

import dataclasses
import datetime
import importlib
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.bench_attention_mgpu import _random_qkv, _reference_rows
from bench.report import slug, write_json
from ttj_jax.kernels import flash_attention
from ttj_jax.numerics import harness_check

fm = importlib.import_module("ttj_jax.kernels.flash_attention_mgpu")
CASES = [(2, 3, 1200, 64, True), (2, 3, 1200, 64, False), (2, 3, 113, 64, True), (1, 16, 100000, 64, True),
         (1, 16, 100000, 64, False), (1, 16, 16384, 128, True), (2, 3, 1000, 128, False), (2, 3, 777, 256, True)]


def main(argv):
    out_dir = pathlib.Path(argv[0])
    records = []
    for batch, heads, seq_len, head_dim, causal in CASES:
        q, k, v = jax.block_until_ready(_random_qkv(seq_len + head_dim, (batch, seq_len, heads, head_dim), jnp.float16))
        base = fm.default_block_sizes(head_dim, seq_len, kv_multicast=False)
        multicast = dataclasses.replace(base, kv_multicast=True)
        qkv = jnp.stack([q, k, v], axis=2)
        plain = fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=base)
        outs = {
            "multicast": fm.flash_attention_mgpu(q, k, v, causal=causal, block_sizes=multicast),
            "fused_plain": fm.flash_attention_mgpu_fused_qkv(qkv, causal=causal, block_sizes=base),
            "fused_multicast": fm.flash_attention_mgpu_fused_qkv(qkv, causal=causal, block_sizes=multicast),
        }
        if seq_len >= fm.MIN_SEQ_LEN:   # where the public function sends the call to this kernel
            outs["public_default"] = flash_attention(q, k, v, causal=causal)
        middle = seq_len // 2
        rows = np.unique(np.concatenate([np.arange(min(64, seq_len)), np.arange(middle, min(middle + 64, seq_len)),
                                         np.arange(max(0, seq_len - 64), seq_len)]))
        failed, worst, _ = harness_check(plain[:, rows].astype(jnp.float32), _reference_rows(q, k, v, rows, causal=causal))
        record = dict(B=batch, H=heads, S=seq_len, head_dim=head_dim, causal=causal,
                      default_has_multicast=fm.default_block_sizes(head_dim, seq_len).kv_multicast,
                      plain_failed_elements=int(failed), plain_worst_err_over_tol=float(worst),
                      equal_to_plain={name: bool(jnp.array_equal(out, plain)) for name, out in outs.items()})
        records.append(record)
        print(f"B={batch} H={heads} S={seq_len} hd={head_dim} causal={causal}: plain vs reference failed {int(failed)} "
              f"(worst err/tol {float(worst):.3f}); equal to plain: {record['equal_to_plain']}", flush=True)
    device = jax.devices()[0]
    result = dict(gpu=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  command="PYTHONPATH=. python3 bench/scratch/multicast_same.py OUT", cases=records,
                  all_equal=all(all(r["equal_to_plain"].values()) for r in records),
                  all_pass=all(r["plain_failed_elements"] == 0 for r in records))
    path = write_json(result, out_dir, f"multicast-same-{result['date']}-{slug(device.device_kind)}")
    print(f"all equal: {result['all_equal']}, all pass: {result['all_pass']}; wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
