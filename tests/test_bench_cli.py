"""The main job end to end on the CPU: one small shape, all contenders, JSON written, exit code 0."""

import json

from bench import cli


def test_ttj_bench_small_shape(tmp_path, capsys):
    rc = cli.main(["--suite", "small", "--shapes", "cpu-12", "--warmup", "1", "--rounds", "2", "--calls", "2",
                   "--extra-seeds", "1", "--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert rc == 0
    document = json.loads((tmp_path / "t.json").read_text())
    shape = document["shapes"]["cpu-12"]
    assert shape["failed_elements"] == 0 and shape["ttj_jax_accuracy"]["failed_elements"] == 0
    assert shape["seeds"] == 6 and 0 < shape["worst_err_over_tol"] < 1
    for key in ("baseline_ms", "ttj_bridge_ms", "ttj_jax_ms"):
        assert shape[key] > 0
    assert "xla-attention/mixed_fp16" in shape["plan"]
    assert "geomean speedup" in capsys.readouterr().out


def test_unknown_shape_is_refused(tmp_path, capsys):
    assert cli.main(["--suite", "small", "--shapes", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown shape id" in capsys.readouterr().err
