"""bench/torch_check.py end to end on the CPU (its smoke mode): official shape 2 (B=1, S=128: CPU-sized as
it is), every field written, the harness rule met by every contender."""

import json
import math

import pytest

from bench import torch_check

TIMES = ("host_us", "gpu_us", "host_over_gpu", "class_ms", "dropin_ms", "class_vs_dropin")
COMPILED = ("compiled_ms", "compiled_peer_ms")


def run(tmp_path, *extra) -> dict:
    argv = ["--device", "cpu", "--shapes", "2", "--out", str(tmp_path), *extra]
    assert torch_check.main(argv) == 0
    [path] = tmp_path.glob("torch-*-cpu.json")
    document = json.loads(path.read_text())
    assert {"date", "gpu", "torch", "jax"} <= set(document)
    assert document["command"] == "python -m bench.torch_check " + " ".join(argv)
    assert list(document["shapes"]) == ["2"]
    shape = document["shapes"]["2"]
    assert set(torch_check.FIELDS) <= set(shape) and shape["errors"] == {}
    for key in TIMES:
        assert isinstance(shape[key], float) and math.isfinite(shape[key]) and shape[key] > 0, key
    assert shape["class_vs_dropin"] >= 1
    assert shape["failed_elements"] == 0
    return shape


def test_torch_check_on_the_cpu(tmp_path, capsys):
    """Without --compile-on-cpu the torch.compile contenders are left out, and say so."""
    shape = run(tmp_path)
    assert set(shape["accuracy"]) == {"class", "dropin"}
    assert all(a["failed_elements"] == 0 and a["worst_err_over_tol"] < 1 for a in shape["accuracy"].values())
    assert all(shape[key] is None for key in COMPILED) and "--compile-on-cpu" in shape["skipped"]
    out = capsys.readouterr().out
    assert "shape 2 (" in out and "class_ms" in out and "wrote " in out


@pytest.mark.slow
def test_torch_check_compiled_contenders_on_the_cpu(tmp_path):
    """--compile-on-cpu: the wrappers around our module and the peer compiled with inductor (C++ on the
    CPU: ~15 s cold), checked against the eager wrapper around the baseline, and timed."""
    shape = run(tmp_path, "--compile-on-cpu")
    assert set(shape["accuracy"]) == {"class", "dropin", "compiled"}
    assert all(a["failed_elements"] == 0 and a["worst_err_over_tol"] < 1 for a in shape["accuracy"].values())
    assert shape["compiled_peer_accuracy"]["compiled_peer"]["failed_elements"] == 0
    for key in COMPILED:
        assert isinstance(shape[key], float) and shape[key] > 0, key
    assert shape["graph_breaks"]["compiled"] == 0   # our module: one opaque op inside the graph


def test_a_contender_that_raises_is_recorded_not_fatal(tmp_path, monkeypatch):
    def broken(self, x, valid_token_mask=None):
        raise RuntimeError("no drop-in today")

    monkeypatch.setattr(torch_check.DropIn, "forward", broken)
    assert torch_check.main(["--device", "cpu", "--shapes", "2", "--out", str(tmp_path)]) == 1
    [path] = tmp_path.glob("torch-*-cpu.json")
    shape = json.loads(path.read_text())["shapes"]["2"]
    assert list(shape["errors"]) == ["dropin"] and "no drop-in today" in shape["errors"]["dropin"]
    assert shape["dropin_ms"] is None and shape["class_vs_dropin"] is None
    assert shape["class_ms"] > 0 and shape["host_us"] > 0 and shape["failed_elements"] == 0


def test_merge_starts_from_an_earlier_files_shapes(tmp_path, capsys):
    """--merge FILE: a run split over several calls ends in one file, the earlier shapes and commands
    kept; a file of another GPU is refused."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"gpu": "cpu", "command": "python -m bench.torch_check --shapes 1",
                                   "shapes": {"1": {"class_ms": 1.0}}}))
    out = tmp_path / "out"
    assert torch_check.main(["--device", "cpu", "--shapes", "2", "--out", str(out), "--merge", str(earlier)]) == 0
    [path] = out.glob("torch-*-cpu.json")
    document = json.loads(path.read_text())
    assert list(document["shapes"]) == ["1", "2"] and document["shapes"]["1"] == {"class_ms": 1.0}
    assert document["commands"][0] == "python -m bench.torch_check --shapes 1" and len(document["commands"]) == 2
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"gpu": "NVIDIA H200", "shapes": {}}))
    assert torch_check.main(["--device", "cpu", "--shapes", "2", "--out", str(out), "--merge", str(other)]) == 2
    assert "measured on 'NVIDIA H200'" in capsys.readouterr().err
