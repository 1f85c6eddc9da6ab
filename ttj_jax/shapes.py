"""The one table of shapes, shared by tests, benchmarks and the CLI.

`OFFICIAL` holds the fourteen official harness shapes (docs/spec.md, all causal).
`CPU_SMALL` holds CPU-sized versions of them: the same head_dim, d_model/ffn ratio and regime, with
batch and sequence cut down so the whole suite runs in seconds without a GPU.
"""

from __future__ import annotations

import dataclasses

from ttj_jax.config import Config


@dataclasses.dataclass(frozen=True)
class Shape:
    id: str
    config: Config
    regime: str

    def describe(self) -> str:
        c = self.config
        return (f"B={c.batch_size} S={c.seq_len} d={c.d_model} H={c.num_heads} "
                f"ffn={c.ffn_dim} L={c.num_layers} causal={c.causal}")


def _shape(id, B, S, d, H, ffn, L, regime, causal=True) -> Shape:
    return Shape(id, Config(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn,
                            num_layers=L, causal=causal), regime)


OFFICIAL: dict[str, Shape] = {s.id: s for s in [
    _shape("1", 64, 128, 128, 4, 128, 4, "launch/latency"),
    _shape("2", 1, 128, 128, 4, 128, 4, "launch-bound"),
    _shape("3", 4, 128, 128, 4, 128, 4, "launch-bound"),
    _shape("4", 16, 128, 128, 4, 128, 4, "launch-bound"),
    _shape("5", 128, 128, 128, 4, 128, 4, "mixed"),
    _shape("6", 10000, 128, 128, 4, 128, 4, "memory-bound"),
    _shape("7", 64, 128, 32, 4, 32, 4, "launch-bound, head_dim 8"),
    _shape("8", 64, 128, 1024, 4, 1024, 4, "GEMM-bound, head_dim 256"),
    _shape("9", 64, 128, 128, 1, 128, 4, "head_dim 128"),
    _shape("10", 64, 128, 128, 2, 128, 4, "head_dim 64"),
    _shape("11", 64, 128, 128, 16, 128, 4, "head_dim 8"),
    _shape("12", 64, 32, 128, 4, 128, 4, "launch-bound, S=32"),
    _shape("13", 64, 1024, 128, 4, 128, 4, "attention-bound"),
    _shape("14", 32, 100000, 1024, 16, 1024, 2, "beyond one device"),
]}

# Shapes 1-13 are the ones the harness (and its baseline) can run; 14 needs the scale tooling.
HARNESS_IDS: tuple[str, ...] = tuple(str(i) for i in range(1, 14))

# CPU-sized twins: head_dim, the regime's character and the layer count kept, sizes cut.
CPU_SMALL: dict[str, Shape] = {s.id: s for s in [
    _shape("cpu-1", 4, 128, 128, 4, 128, 4, "official 1, batch cut"),
    _shape("cpu-2", 1, 128, 128, 4, 128, 4, "official 2 as is"),
    _shape("cpu-7", 4, 128, 32, 4, 32, 4, "official 7 (head_dim 8), batch cut"),
    _shape("cpu-8", 2, 64, 512, 2, 512, 2, "official 8 (head_dim 256), cut"),
    _shape("cpu-9", 4, 128, 128, 1, 128, 2, "official 9 (head_dim 128), cut"),
    _shape("cpu-11", 4, 128, 128, 16, 128, 2, "official 11 (head_dim 8), cut"),
    _shape("cpu-12", 8, 32, 128, 4, 128, 4, "official 12 (S=32), batch cut"),
    _shape("cpu-13", 2, 256, 128, 4, 128, 2, "official 13 (attention-bound), cut"),
]}

SUITES: dict[str, dict[str, Shape]] = {"small": CPU_SMALL, "official": OFFICIAL}
