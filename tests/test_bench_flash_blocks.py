"""bench/flash_blocks.py, the block-size sweep of our generic flash kernel, on the CPU (--smoke: interpret
mode); the sweep itself runs on the GPU."""

import argparse
import json

import pytest

from bench import flash_blocks


def test_smoke_sweep_checks_and_times_every_variant_and_the_default(tmp_path, capsys):
    assert flash_blocks.main(["--smoke", "--out", str(tmp_path)]) == 0
    [path] = tmp_path.glob("flash-blocks-*-smoke.json")
    document = json.loads(path.read_text())
    assert len(document["cases"]) == len(flash_blocks.SMOKE_CASES)
    for record in document["cases"]:
        labels = [row["label"] for row in record["rows"]]
        assert sum(row["default"] for row in record["rows"]) == 1
        assert len(labels) == len(set(labels)) >= len(flash_blocks.SMOKE_VARIANTS)
        for row in record["rows"]:
            assert row["max_abs_err"] <= 2e-2 and row["ms"] > 0, row
        assert record["best"] in labels and record["default_over_best"] >= 1.0
        assert record["calls_per_dispatch"] == 2 and all(row["calls"] % 2 == 0 for row in record["rows"])
    assert "wrote" in capsys.readouterr().out


def test_calls_per_dispatch_must_be_positive(tmp_path):
    with pytest.raises(SystemExit):
        flash_blocks.main(["--smoke", "--per-dispatch", "0", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.json"))


def test_case_and_variant_parsing():
    assert flash_blocks.parse_case("8,16,1024,32,causal,mask") == (8, 16, 1024, 32, True, True)
    assert flash_blocks.parse_case("1,2,3,64,full,none") == (1, 2, 3, 64, False, False)
    for bad in ("8,16,1024,32,causal", "8,16,1024,32,yes,mask", "8,16,x,32,full,none"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            flash_blocks.parse_case(bad)
    assert flash_blocks.parse_variant("128,64,8,3") == (128, 64, 8, 3)
    with pytest.raises(argparse.ArgumentTypeError, match="power of two"):
        flash_blocks.parse_variant("96,64,4,2")


def test_variants_that_clamp_to_one_tiling_run_once():
    """At S=20 every block clamps to 32: three variants and the default are one tiling, timed once."""
    record = flash_blocks.run_case((1, 1, 20, 16, True, False), [(32, 32, 4, 2), (64, 64, 4, 2), (128, 32, 4, 2)],
                                   interpret=True, min_seconds=0.0)
    assert [row["label"] for row in record["rows"]] == ["32x32 w4 s2"] and record["rows"][0]["default"]


def test_each_timing_records_the_gpu_state_it_ran_at():
    """With a power sampler (here a stand-in for nvidia-smi's), every timed row carries the window of samples
    taken while it ran, as the other bench scripts' timings do."""
    class Sampler:
        def __init__(self):
            self.windows = []

        def window(self, start, end):
            self.windows.append((start, end))
            return {"sm_clock_mhz": 1980.0, "power_w": 400.0}
    sampler = Sampler()
    record = flash_blocks.run_case((1, 1, 20, 16, False, True), [(16, 16, 4, 2)], interpret=True,
                                   min_seconds=0.0, power=sampler)
    assert len(sampler.windows) == len(record["rows"]) == 2
    assert all(start < end for start, end in sampler.windows)
    assert all(row["gpu_state"]["sm_clock_mhz"] == 1980.0 for row in record["rows"])


def test_masked_case_keeps_a_prefix_of_keys_per_sequence():
    qkv, mask = flash_blocks.case_inputs((4, 1, 10, 16, False, True))
    assert qkv.shape == (4, 10, 3, 1, 16) and mask.shape == (4, 10)
    kept = mask.sum(axis=1).tolist()
    assert kept[0] == 10 and kept[-1] == 7 and kept == sorted(kept, reverse=True)
    assert flash_blocks.case_inputs((4, 1, 10, 16, False, False))[1] is None
