"""bench.hlo_table on a program compiled here: every kernel-launching entry instruction found, its bytes
from the shapes, and a kernel table's rows joined by name (the GPU's names are the instructions' with
'.' as '_')."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from bench.hlo_table import annotate, entry_kernels, shape_bytes


def test_shape_bytes_counts_every_array_of_a_tuple():
    assert shape_bytes("f32[64,128]{1,0}") == 64 * 128 * 4
    assert shape_bytes("(f16[8,4]{1,0}, pred[3]{0}, s32[]{})") == 8 * 4 * 2 + 3 + 4
    assert shape_bytes("token[]") == 0


def test_entry_kernels_and_annotate_on_a_compiled_program():
    def program(a, b):
        return jnp.tanh(a * 2.0 + b).sum(axis=1), (a - b).astype(jnp.float16)
    a = jnp.ones((256, 512), jnp.float32)
    text = jax.jit(program).lower(a, a).compile().as_text()
    kernels = entry_kernels(text)
    assert kernels, text
    for name, facts in kernels.items():
        assert "." not in name and facts["instruction"].replace(".", "_") == name
        assert facts["read_mb"] >= 0 and facts["written_mb"] >= 0
    # the program reads both inputs (2 x 512 KiB) somewhere and writes a 256 KiB fp16 array somewhere
    assert max(f["read_mb"] for f in kernels.values()) >= 256 * 512 * 4 / 1e6
    assert any(abs(f["written_mb"] - 256 * 512 * 2 / 1e6) < 1e-9 or f["written_mb"] > 256 * 512 * 2 / 1e6
               for f in kernels.values())
    name, facts = next(iter(kernels.items()))
    table = {"kernels": [{"kernel": name, "us_per_call": 20.0, "launches_per_call": 2.0},
                         {"kernel": "nvjet_gemm", "us_per_call": 5.0, "launches_per_call": 1.0}],
             "kernel_us_per_call": 25.0, "span_us_per_call": 30.0}
    joined = annotate(table, text)
    first, library = joined["kernels"]
    assert first["instruction"] == facts["instruction"]
    megabytes = facts["read_mb"] + facts["written_mb"]
    assert first["gb_per_s"] == pytest.approx(megabytes * 1e3 / 10.0)   # per launch: 10 us
    assert library == table["kernels"][1] and joined["span_us_per_call"] == 30.0
    assert "instruction" not in table["kernels"][0]   # the input table is not modified


def test_annotate_refuses_text_without_an_entry():
    with pytest.raises(ValueError, match="ENTRY"):
        entry_kernels("HloModule m\n")
