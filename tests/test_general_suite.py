"""`ttj-bench --suite general`: the table of real-model-shaped configs, its padding and dtype reaching every
contender, --force-device's records merged into the run's file, and reports with named (non-numeric) ids."""

import json
import math
import os

import jax
import numpy as np
import pytest
import torch

import bridge
import ttj_jax as T
from bench import cli
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs
from bench.report import by_shape_id, markdown_table
from ttj_jax.shapes import GENERAL, Shape

# Fields every config of a general run records (the list).
RUN_FIELDS = ("config", "baseline_ms", "peer_ms", "ttj_bridge_ms", "ttj_jax_ms", "failed_elements",
              "worst_err_over_tol", "first_call_s")
FAST = ["--device", "cpu", "--no-plot", "--rounds", "1", "--calls", "1", "--warmup", "1", "--extra-seeds", "0"]


def _tiny(id, B, S, d, H, ffn, L, causal, padding=0.0, dtype="float32") -> Shape:
    return Shape(id, T.Config(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn, num_layers=L,
                              causal=causal), "CPU test", padding=padding, dtype=dtype)


# CPU-sized stand-ins for the general suite: a padded non-causal float16 config and a padded causal one.
TINY_GENERAL = {s.id: s for s in [
    _tiny("tiny-enc-pad-fp16", 2, 24, 64, 2, 128, 1, causal=False, padding=0.5, dtype="float16"),
    _tiny("tiny-dec-pad", 2, 24, 64, 4, 64, 2, causal=True, padding=0.7),
]}


def test_general_table_covers_real_model_ranges():
    shapes = list(GENERAL.values())
    assert len(shapes) >= 16 and T.SUITES["general"] is GENERAL
    configs = [s.config for s in shapes]
    span = lambda values: (min(values), max(values))
    assert span([c.batch_size for c in configs]) == (1, 64)
    assert span([c.seq_len for c in configs]) == (32, 8192)
    assert span([c.d_model for c in configs]) == (128, 2048)
    assert span([c.d_model // c.num_heads for c in configs]) == (32, 128)
    assert span([c.ffn_dim / c.d_model for c in configs]) == (1, 4)
    assert span([c.num_layers for c in configs]) == (1, 8)
    assert {c.causal for c in configs} == {True, False}
    assert {s.dtype for s in shapes} == {"float32", "float16"}
    assert {0.0, 0.3, 0.7} <= {s.padding for s in shapes}
    assert {(s.config.causal, s.padding > 0) for s in shapes} == {(True, True), (True, False), (False, True),
                                                                  (False, False)}
    assert any(c.seq_len & (c.seq_len - 1) for c in configs)   # an S that is not a power of two (ViT, CLIP)
    for s in shapes:
        c = s.config
        assert c.d_model % c.num_heads == 0 and s.id == s.id.lower()
        # the baseline's [B, H, S, S] fp32 scores: well under ~20 GB on one H200
        assert c.batch_size * c.num_heads * c.seq_len ** 2 * 4 <= 4e9, s.id
        # the baseline's work per call (GEMMs and its full S x S attention), a few ms in TF32 on an H200
        flops = c.num_layers * (2 * c.batch_size * c.seq_len * (4 * c.d_model ** 2 + 2 * c.d_model * c.ffn_dim)
                                + 4 * c.batch_size * c.seq_len ** 2 * c.d_model)
        assert flops <= 1.5e12, s.id
    # the four named configs
    wanted = {(32, 512, 768, 12, 3072, 2, False), (1, 4096, 768, 12, 3072, 2, True),
              (1, 8192, 1024, 8, 4096, 2, True), (2, 2048, 2048, 16, 8192, 1, True)}
    plain = {(c.batch_size, c.seq_len, c.d_model, c.num_heads, c.ffn_dim, c.num_layers, c.causal)
             for s, c in zip(shapes, configs) if s.padding == 0 and s.dtype == "float32"}
    assert wanted <= plain
    assert {"bert-base", "gpt2-s4096"} <= set(GENERAL)


def test_describe_shows_padding_and_dtype_only_when_set():
    assert "padding" not in T.OFFICIAL["1"].describe() and "dtype" not in T.OFFICIAL["1"].describe()
    text = GENERAL["dec-hd128-fp16-pad30"].describe()
    assert text.endswith("causal=True padding=0.3 dtype=float16")
    assert T.OFFICIAL["1"].padding == 0.0 and T.OFFICIAL["1"].dtype == "float32"


def test_ttj_jax_contender_honours_a_padded_mask():
    """From JAX, a padded mask is planned by its kind and passed: invalid rows zero, output within the rule."""
    config = TransformerConfig(2, 24, 64, 2, 128, 1, causal=False)
    baseline, ours = harness_models(config, bridge.TTJTransformer)
    x, mask = make_inputs(config, 1234, padding_ratio=0.7)
    assert not bool(mask.all())
    fn, plan = cli.ttj_jax_contender(ours, T.Config.from_object(config), x, mask)
    assert plan.mask_mode == "keys"
    out = torch.from_dlpack(jax.block_until_ready(fn()))
    with torch.inference_mode():
        assert check_close(out, baseline(x, mask))[0] == 0
    assert not out[~mask].any()
    _, plan = cli.ttj_jax_contender(ours, T.Config.from_object(config), x, torch.ones_like(mask))
    assert plan.mask_mode == "none"


def _only_file(folder):
    [path] = folder.glob("general-*.json")
    return path


def test_general_run_then_forced_device_merged_into_one_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(T.SUITES, "general", TINY_GENERAL)
    # recorded so that the test's end restores it (delenv of an absent name records nothing): "" is unset
    monkeypatch.setenv(cli.FORCE_DEVICE_ENV, "")
    monkeypatch.setenv("TTJ_GPU_MASK", "host")
    out = ["--out", str(tmp_path)]

    assert cli.main(["--suite", "general", "--peer", *FAST, *out]) == 0
    path = _only_file(tmp_path)
    document = json.loads(path.read_text())
    assert document["environment"]["TTJ_GPU_MASK"] == "host"   # switches the command line does not show
    assert cli.FORCE_DEVICE_ENV not in document["environment"]   # set but empty: not in effect
    assert list(document["shapes"]) == list(TINY_GENERAL) and "forced_device" not in document
    for sid, shape in TINY_GENERAL.items():
        record = document["shapes"][sid]
        for key in RUN_FIELDS:
            assert record[key] is not None, (sid, key)
        assert record["config"] == vars(shape.config)
        assert record["padding"] == shape.padding and record["dtype"] == shape.dtype
        assert isinstance(record["first_call_s"], float) and record["first_call_s"] > 0
        assert set(record["first_call_s_by_contender"]) == {"ttj_bridge", "peer"}
        assert record["failed_elements"] == 0 and record["ttj_jax_accuracy"]["failed_elements"] == 0
        assert record["accuracy"]["peer"]["failed_elements"] == 0
        assert record["baseline_ms"] > 0 and record["peer_ms"] > 0 and record["ttj_jax_ms"] > 0
    assert "mask-keys" in document["shapes"]["tiny-enc-pad-fp16"]["plan"]
    printed = capsys.readouterr().out
    assert "peer/ttj" in printed and "geomean peer/ttj bridge" in printed
    main_shapes = document["shapes"]

    # forced: the same file, its main table kept, the records under forced_device/sm_80
    forced_argv = ["--suite", "general", "--shapes", "tiny-dec-pad", "--force-device", "sm_80", "--peer", *FAST, *out]
    assert cli.main(forced_argv) == 0
    assert os.environ[cli.FORCE_DEVICE_ENV] == "sm_80"
    assert _only_file(tmp_path) == path
    document = json.loads(path.read_text())
    assert document["shapes"] == main_shapes
    assert document["command"] == "ttj-bench " + " ".join(forced_argv)
    assert len(document["commands"]) == 2 and "--force-device sm_80" in document["commands"][1]
    forced = document["forced_device"]["sm_80"]["tiny-dec-pad"]
    assert set(forced) == set(cli.FORCED_FIELDS)
    assert forced["ttj_bridge_ms"] > 0 and forced["peer_ms"] > 0 and forced["failed_elements"] == 0
    assert forced["worst_err_over_tol"] < 1 and forced["plan"]
    printed = capsys.readouterr().out
    assert "planned as sm_80" in printed and "tiny-dec-pad" in printed and "tiny-enc-pad-fp16" not in printed

    # a later main run with --merge keeps the forced section
    monkeypatch.delenv(cli.FORCE_DEVICE_ENV)
    assert cli.main(["--suite", "general", "--shapes", "tiny-enc-pad-fp16", "--merge", *FAST, *out]) == 0
    document = json.loads(path.read_text())
    assert set(document["forced_device"]["sm_80"]) == {"tiny-dec-pad"}
    assert list(document["shapes"]) == list(TINY_GENERAL)

    # --report shows the main table and the forced rows
    assert cli.main(["--report", str(path), "--no-plot"]) == 0
    printed = capsys.readouterr().out
    assert "planned as sm_80" in printed


def test_force_device_choices():
    assert cli.parse_args(["--force-device", "sm_89"]).force_device == "sm_89"
    assert cli.parse_args([]).force_device is None
    with pytest.raises(SystemExit):
        cli.parse_args(["--force-device", "sm_75"])


def _saved_general_run():
    ids = list(GENERAL)[:4]
    shapes = {sid: {"config": vars(GENERAL[sid].config), "baseline_ms": 4.0, "peer_ms": 0.5 * (i + 1),
                    "ttj_bridge_ms": 0.5, "ttj_jax_ms": 0.5, "failed_elements": 0, "worst_err_over_tol": 0.4,
                    "ttj_jax_accuracy": {"failed_elements": 0, "worst_err_over_tol": 0.3}, "first_call_s": 1.0,
                    "plan": "layers/mixed_fp16: why", "seeds": 5,
                    "speedup": {"peer": 4.0 / (0.5 * (i + 1)), "ttj_bridge": 8.0, "ttj_jax": 8.0}}
              for i, sid in enumerate(ids)}
    # written in an order other than the table's
    return ids, {"device": "Some GPU", "suite": "general", "shapes": dict(reversed(list(shapes.items())))}


def test_named_ids_keep_the_suite_order_in_tables(tmp_path, capsys):
    ids, document = _saved_general_run()
    assert list(by_shape_id(document["shapes"], list(GENERAL))) == ids
    assert list(by_shape_id({"cpu-12": 1, "cpu-2": 2, "10": 3, "9": 4})) == ["9", "10", "cpu-2", "cpu-12"]
    table = markdown_table(document, list(GENERAL))
    rows = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines() if line.startswith("| ")][2:]
    assert rows == ids
    assert f"Geometric mean of peer/bridge: {math.prod(range(1, 5)) ** 0.25:.2f}." in table
    path = tmp_path / "general.json"
    path.write_text(json.dumps(document))
    assert cli.main(["--report", str(path)]) == 0
    printed = capsys.readouterr().out
    assert printed.index(ids[0]) < printed.index(ids[3]) and "geomean peer/ttj bridge" in printed
    assert (tmp_path / "general.png").stat().st_size > 1000   # peer/ttj bridge per config


def test_general_shape_inputs_reach_the_harness_input():
    shape = GENERAL["dec-hd128-fp16-pad30"]
    config = TransformerConfig(**dict(vars(shape.config), batch_size=3, seq_len=40))
    x, mask = make_inputs(config, 1234, padding_ratio=shape.padding, dtype=getattr(torch, shape.dtype))
    lengths = mask.sum(1)
    assert x.dtype == torch.float16 and int(lengths.min()) >= round(40 * 0.7)
    assert not np.asarray(x[~mask]).any()


def test_find_looks_a_shape_up_in_every_suite():
    assert T.shapes.find("bert-base") is T.shapes.GENERAL["bert-base"]
    assert T.shapes.find("cpu-2") is T.CPU_SMALL["cpu-2"]
    half = T.shapes.find("2@float16")
    assert half.dtype == "float16" and half.config == T.OFFICIAL["2"].config
    with pytest.raises(KeyError, match="nope"):
        T.shapes.find("nope")
