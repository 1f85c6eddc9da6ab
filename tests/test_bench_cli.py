"""The main job end to end on the CPU: one small shape, all contenders, JSON written, exit code 0."""

import dataclasses
import importlib
import json
import pathlib

import jax
import pytest
import torch
from conftest import RecordingPower

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
    assert shape["gpu_state"] is None   # no GPU clock to sample on the CPU
    assert "geomean speedup" in capsys.readouterr().out


def test_run_shape_records_the_clock_and_power_of_its_timing_rounds():
    """On a GPU the sampler's window around the contenders' timing rounds lands in the shape's result
    (bench/gpu_power.py; a stand-in sampler here)."""
    import time

    import ttj_jax as T

    args = cli.parse_args(["--suite", "small", "--warmup", "1", "--rounds", "2", "--calls", "2"])
    args.peer, args.extra_seeds = False, 0   # what main() fills in on a CPU
    progress, power = cli.Progress(1), RecordingPower({"sm_clock_mhz": 1770.0, "power_w": 690.0, "power_capped": True})
    before = time.perf_counter()
    try:
        result = cli.run_shape(T.SUITES["small"]["cpu-12"], args, torch.device("cpu"), progress, power)
    finally:
        progress.close()
    assert result["gpu_state"] == {"sm_clock_mhz": 1770.0, "power_w": 690.0, "power_capped": True}
    [(start, end)] = power.asked
    assert before < start < end < time.perf_counter()


def test_unknown_shape_is_refused(tmp_path, capsys):
    assert cli.main(["--suite", "small", "--shapes", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown shape id" in capsys.readouterr().err
    assert cli.main(["--suite", "small", "--shapes", "cpu-12@pad1.5", "--out", str(tmp_path)]) == 2
    assert "padding ratio" in capsys.readouterr().err
    assert cli.main(["--suite", "small", "--shapes", "cpu-12@float8", "--out", str(tmp_path)]) == 2
    assert "not a harness option" in capsys.readouterr().err


def test_ttj_bench_runs_a_shape_under_harness_options(tmp_path):
    """"cpu-12@pad0.5" is shape cpu-12 at the harness's --padding-ratio 0.5: prefix masks for every
    contender, recorded under that id with its padding."""
    rc = cli.main(["--suite", "small", "--shapes", "cpu-12@pad0.5", "--warmup", "1", "--rounds", "1", "--calls", "1",
                   "--extra-seeds", "0", "--out", str(tmp_path), "--tag", "t", "--no-plot"])
    assert rc == 0
    shape = json.loads((tmp_path / "t.json").read_text())["shapes"]["cpu-12@pad0.5"]
    assert shape["padding"] == 0.5 and shape["failed_elements"] == 0
    assert "prefix mask" in shape["plan"]


def test_shape_ids_take_the_harness_options():
    import ttj_jax as T
    plain = T.shapes.find("2")
    assert T.shapes.find("2@float16") == dataclasses.replace(plain, id="2@float16", dtype="float16")
    padded = T.shapes.find("2@float16@pad0.3")
    assert (padded.id, padded.dtype, padded.padding) == ("2@float16@pad0.3", "float16", 0.3)
    scaled = T.shapes.find("8@scale0.1")
    assert (scaled.id, scaled.input_scale, scaled.padding) == ("8@scale0.1", 0.1, 0.0)
    assert "input_scale=0.1" in scaled.describe()
    assert T.shapes.find("2@pad0") is plain and T.shapes.find("2@scale1") is plain   # the options it already has
    for bad in ("2@pad-0.1", "2@pad1", "2@padx", "2@half", "2@scale0", "2@scale-1", "2@scalex", "2@scaleinf"):
        with pytest.raises(ValueError):
            T.shapes.find(bad)


def test_check_close_is_the_harness_rule_in_any_chunking(monkeypatch):
    from bench import baseline
    ref = torch.tensor([0.05, 0.05, 100.0, 100.0, 0.0, 5.0, 5.0, float("nan")])
    out = torch.tensor([0.0519, 0.0521, 101.9, 102.1, -0.0015, float("inf"), 5.0, float("nan")])
    # passes: |err| 1.9e-3 <= atol; 1.9 <= 2% of 100; 1.5e-3 <= atol; equal. fails: 2.1e-3 against
    # max(atol, 1e-3) (ratio 1.05), 2.1 against 2 (1.05), an inf, and NaN against NaN (both must be finite)
    expected_failed = 4
    failed, worst = baseline.check_close(out, ref)
    assert failed == expected_failed and worst == float("inf")
    assert baseline.check_close(out[:5], ref[:5]) == (2, pytest.approx(1.05, rel=1e-4))
    monkeypatch.setattr(baseline, "CHECK_CHUNK_ELEMENTS", 3)      # chunk edges anywhere: same answer
    assert baseline.check_close(out, ref)[0] == expected_failed
    assert baseline.check_close(out[:5], ref[:5]) == (2, pytest.approx(1.05, rel=1e-4))
    with pytest.raises(ValueError, match="shape"):
        baseline.check_close(out[:3], ref[:4])


def test_run_shapes_records_skips_errors_and_failures(tmp_path, capsys):
    from bench.report import run_shapes

    def run_one(sid):
        if sid == "skip":
            return None
        if sid == "boom":
            raise RuntimeError("no kernel")
        return {"accuracy": {"x": {"failed_elements": int(sid == "bad")}}}

    result, path = {"shapes": {}}, tmp_path / "r.json"
    assert run_shapes(result, str(path), ["ok"], run_one, str) is False
    assert run_shapes(result, str(path), ["skip", "boom", "bad"], run_one, str) is True
    written = json.loads(path.read_text())["shapes"]
    assert set(written) == {"ok", "boom", "bad"} and "no kernel" in written["boom"]["error"]
    assert all("wall_s" in r for r in written.values())
    assert "shape bad (" in capsys.readouterr().out


def test_report_renders_a_saved_run(tmp_path, capsys):
    # a GPU run saved with --no-plot gets its table and chart back on any machine
    shapes = {sid: {"baseline_ms": 2.0 * i, "peer_ms": 0.2, "ttj_bridge_ms": 0.1 * i, "ttj_jax_ms": 0.1,
                    "failed_elements": 0, "worst_err_over_tol": 0.4, "ttj_jax_accuracy": {"failed_elements": 0},
                    "speedup": {"peer": 10.0 * i, "ttj_bridge": 20.0, "ttj_jax": 20.0 * i}}
              for i, sid in enumerate(("2", "10", "1"), start=1)}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"device": "Some GPU", "shapes": shapes}))
    assert cli.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Some GPU" in out and "geomean speedup" in out
    assert out.index("│     1 │") < out.index("│     2 │") < out.index("│    10 │")   # numeric order
    assert (tmp_path / "run.png").stat().st_size > 1000


COMMITTED_OFFICIAL_RUN = "bench/results/official-2026-12-03-nvidia-h200.json"
REPOSITORY = pathlib.Path(__file__).resolve().parent.parent


def test_report_markdown_prints_the_table_only(tmp_path, capsys):
    shapes = {sid: {"baseline_ms": 2.0, "ttj_bridge_ms": 0.1 * i, "ttj_jax_ms": 0.1, "failed_elements": 0,
                    "worst_err_over_tol": 0.4, "ttj_jax_accuracy": {"failed_elements": 1, "worst_err_over_tol": 0.5},
                    "seeds": 25, "plan": "layers/mixed_fp16: why", "bridge_host_us": 50.0,
                    "speedup": {"ttj_bridge": 20.0 / i, "ttj_jax": 20.0}}
              for i, sid in enumerate(("2", "10", "1"), start=1)}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"device": "Some GPU", "jax": "0.1", "torch": "2.0", "date": "2026-01-01",
                                "shapes": shapes}))
    assert cli.main(["--report", str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Some GPU; jax 0.1; torch 2.0; 2026-01-01; 25 accuracy seeds per shape.\n")
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 2", "| 10"]     # numeric order
    # shape 1 (i=3): bridge 0.3 ms, speedup 6.7x, no peer, 0 + 1 failed, worst of the two, host/GPU 50/300
    assert rows[0] == "| 1 | `layers/mixed_fp16` | 2 | - | 0.3 | 0.1 | 6.7x | - | 1 | 0.50 | 50 | 0.17 |"
    assert "shapes 1, 2, 10: ttj via the bridge 11.01x, ttj from JAX 20.00x." in out   # (20 * 10 * 20/3) ** (1/3)
    assert not (tmp_path / "run.png").exists()
    with pytest.raises(SystemExit):
        cli.parse_args(["--markdown"])


def test_readme_results_table_is_the_markdown_of_the_committed_run():
    """The README's results table is `ttj-bench --report <committed run> --markdown`, verbatim, with that
    command stated above it: regenerate it from the JSON, never edit it by hand."""
    from bench.report import markdown_table
    table = markdown_table(json.loads((REPOSITORY / COMMITTED_OFFICIAL_RUN).read_text()))
    readme = (REPOSITORY / "README.md").read_text()
    assert f"ttj-bench --report {COMMITTED_OFFICIAL_RUN} --markdown" in readme
    assert table in readme


def test_results_go_to_the_ignored_results_folder_by_default():
    assert cli.parse_args([]).out is None
    assert pathlib.Path(cli.default_out_dir()) == REPOSITORY / "results"
    assert "/results/" in (REPOSITORY / ".gitignore").read_text().split()


def test_profile_trace_summary():
    """bench/fused_stack_mgpu_profile.py's reading of a Mosaic GPU profiler trace: per role and phase the
    inclusive time per tile, nested regions counted in full, a block's span over its warpgroups."""
    from bench.fused_stack_mgpu_profile import summarize_trace

    def region(tid, name, start, end):
        return [{"name": name, "ph": "B", "ts": start, "tid": tid}, {"name": name, "ph": "E", "ts": end, "tid": tid}]
    events = []
    for block, offset in ((0, 0.0), (1, 100.0)):
        c0, c1, producer = 1 + 3 * block, 2 + 3 * block, 3 + 3 * block
        events += [{"name": "mlp_in", "ph": "B", "ts": offset + 10, "tid": c0},
                   *region(c0, "wait_weights", offset + 11, offset + 13),
                   {"name": "mlp_in", "ph": "E", "ts": offset + 20, "tid": c0}]
        events += region(c1, "mlp_in", offset + 5, offset + 9 + block)
        events += region(producer, "producer_wait_consumed", offset + 0, offset + 30)
    summary = summarize_trace({"traceEvents": events})
    assert summary["tiles"] == 2
    assert summary["span_us"] == pytest.approx(30.0)
    assert summary["phases"]["consumer0"] == {"mlp_in": pytest.approx(10.0), "wait_weights": pytest.approx(2.0)}
    assert summary["phases"]["consumer1"]["mlp_in"] == pytest.approx(4.5)
    assert summary["calls"]["producer"]["producer_wait_consumed"] == 1
    with pytest.raises(ValueError, match="unbalanced"):
        summarize_trace({"traceEvents": events[:-1]})


@pytest.mark.slow
def test_ablate_variants_end_to_end(tmp_path):
    """bench/ablate.py: variant parsing (XLA options too), a refused variant recorded (the run goes on),
    real ones checked against the baseline and timed on a CPU twin, one compiled with an XLA option whose
    optimized HLO is written."""
    from bench import ablate
    assert ablate.parse_variant("mixed_fp16") == {"policy": "mixed_fp16", "stack": None, "attention": None,
                                                  "weights": None, "qkv_gemms": None, "compiler_options": ()}
    assert ablate.parse_variant("mixed_fp16/-/xla@a=false+b=3+c=x") == {
        "policy": "mixed_fp16", "stack": None, "attention": "xla", "weights": None, "qkv_gemms": None,
        "compiler_options": (("a", False), ("b", 3), ("c", "x"))}
    split = ablate.parse_variant("mixed_fp16/layers/cudnn@qkv_gemms=3+xla_disable_hlo_passes=dot-merger")
    assert split["qkv_gemms"] == 3 and split["compiler_options"] == (("xla_disable_hlo_passes", "dot-merger"),)
    assert ablate.parse_variant("mixed_fp16/layers/-/per-layer")["weights"] == "per-layer"
    with pytest.raises(ValueError, match="weights"):
        ablate.parse_variant("a/b/c/d")
    with pytest.raises(ValueError):
        ablate.parse_variant("a/b/c/stacked/e")
    with pytest.raises(ValueError, match="name=value"):
        ablate.parse_variant("mixed_fp16@novalue")
    with pytest.raises(ValueError, match="unknown numerics policy"):
        ablate.main(["--shapes", "cpu-1", "--variants", "nonsense", "--device", "cpu", "--out", str(tmp_path)])
    optioned = "mixed_fp16/layers/xla@xla_cpu_enable_fast_math=false"
    per_layer = "mixed_fp16/layers/xla/per-layer"   # the XLA program on unstacked weights
    status = ablate.main(["--shapes", "cpu-1", "--variants",
                          f"mixed_fp16/layers/xla,mixed_fp16/fused,{optioned},{per_layer},mixed_fp16/fused/-/stacked,"
                          "mixed_fp16/layers/xla@qkv_gemms=3",
                          "--seeds", "1", "--device", "cpu", "--out", str(tmp_path), "--tag", "t", "--hlo"])
    document = json.loads((tmp_path / "t.json").read_text())
    assert document["torch"] == torch.__version__ and document["jax"] == jax.__version__
    shape = document["shapes"]["cpu-1"]
    assert status == 0 and shape["accuracy"]["mixed_fp16/layers/xla"]["failed_elements"] == 0
    assert shape["accuracy"][optioned]["failed_elements"] == 0 and shape["jax_ms"][optioned] > 0
    hlo = (tmp_path / "t-hlo.txt").read_text()
    assert f"==== shape cpu-1 variant {optioned}" in hlo and "ENTRY" in hlo
    assert shape["jax_ms"]["mixed_fp16/layers/xla"] > 0 and "mixed_fp16/layers/xla" in shape["plans"]
    assert "mixed_fp16/fused" in shape["errors"] or "mixed_fp16/fused" in shape["jax_ms"]
    assert shape["accuracy"][per_layer] == shape["accuracy"]["mixed_fp16/layers/xla"]   # the same program's output
    assert "only the XLA program" in shape["errors"]["mixed_fp16/fused/-/stacked"]
    assert "qkv_gemms=3" in shape["errors"]["mixed_fp16/layers/xla@qkv_gemms=3"]   # the plan's own check


def test_split_timeline_summary():
    """bench/cuda_trace.py's reading of a torch.profiler trace (split_timeline's summary): per GPU the
    kernels' and copies' busy time (unions), the copy time that overlaps kernels, and spans; CPU events are ignored."""
    from bench.cuda_trace import summarize_activity

    def gpu(cat, device, stream, ts_us, dur_us):
        return {"ph": "X", "cat": cat, "name": cat, "pid": device, "tid": stream, "ts": ts_us, "dur": dur_us,
                "args": {"device": device, "stream": stream}}
    trace = {"traceEvents": [
        gpu("kernel", 0, 7, 0, 1000), gpu("kernel", 0, 7, 500, 1000),      # overlapping: union 1.5 ms
        gpu("gpu_memcpy", 0, 20, 1000, 1000),                               # 0.5 ms of it under kernels
        gpu("kernel", 1, 9, 2000, 500), gpu("gpu_memcpy", 1, 21, 1000, 500),
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 1, "ts": 0, "dur": 99999},
    ]}
    summary = summarize_activity(trace)
    assert summary["span_ms"] == pytest.approx(2.5)
    gpu0, gpu1 = summary["devices"]["0"], summary["devices"]["1"]
    assert gpu0["kernel_ms"] == pytest.approx(1.5) and gpu0["copy_ms"] == pytest.approx(1.0)
    assert gpu0["copy_overlapping_kernels_ms"] == pytest.approx(0.5) and gpu0["span_ms"] == pytest.approx(2.0)
    assert gpu0["streams"] == 2 and gpu1["copy_overlapping_kernels_ms"] == 0
    assert gpu1["span_ms"] == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no GPU"):
        summarize_activity({"traceEvents": trace["traceEvents"][-1:]})


def test_kernel_table():
    """bench/cuda_trace.kernel_table (ablate --kernels): GPU time per call by kernel name, largest first,
    the tail summed, per-call span over kernels and copies; a trace without GPU events is refused."""
    from bench.cuda_trace import kernel_table

    def event(cat, name, ts_us, dur_us):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts_us, "dur": dur_us}
    trace = {"traceEvents": [
        event("kernel", "gemm", 0, 40), event("kernel", "ln", 40, 10), event("kernel", "gemm", 100, 40),
        event("kernel", "gelu", 140, 4), event("kernel", "ln", 150, 10), event("gpu_memcpy", "copy", 160, 40),
        {"ph": "X", "cat": "cpu_op", "name": "gemm", "pid": 1, "tid": 1, "ts": 0, "dur": 9999},
    ]}
    table = kernel_table(trace, calls=2, top=2)
    assert [row["kernel"] for row in table["kernels"]] == ["gemm", "ln", "(other)"]
    assert table["kernels"][0]["us_per_call"] == pytest.approx(40) and table["kernels"][0]["launches_per_call"] == 1
    assert table["kernels"][2]["us_per_call"] == pytest.approx(2)
    assert table["kernel_us_per_call"] == pytest.approx(52) and table["span_us_per_call"] == pytest.approx(100)
    with pytest.raises(ValueError, match="no GPU"):
        kernel_table({"traceEvents": trace["traceEvents"][-1:]})


def test_host_overhead_script_on_the_cpu(tmp_path, capsys):
    import json

    from bench import host_overhead
    host_overhead.main(["--device", "cpu", "--shapes", "2", "--calls", "3", "--tag", "t", "--out", str(tmp_path),
                        "--graph"])
    [path] = tmp_path.glob("host-overhead-*-cpu-t.json")
    shape = json.loads(path.read_text())["shapes"]["2"]
    assert set(host_overhead.CUMULATIVE) <= set(shape["host_us"])
    # --graph: the same program compiled with the command-buffer options (ignored by XLA's CPU backend)
    assert "dispatch_graph" in shape["host_us"] and shape["graph_max_abs_diff"] == 0.0
    assert all(v["median_us"] > 0 for v in shape["host_us"].values())
    assert shape["bridge_minus_jax_us"] == shape["host_us"]["bridge"]["median_us"] - shape["host_us"]["jax_direct"]["median_us"]
    assert {"jax_array_idle", "exported_tensor_busy", "bridge_output_idle"} <= set(shape["free_us"])
    assert "bridge-jax" in capsys.readouterr().out


def test_forward_overhead_script_on_the_cpu(tmp_path, capsys):
    """bench/forward_overhead.py (its H200 numbers are in bench/results/forward-overhead-*.json) runs end
    to end on a CPU-sized shape and records the three contenders; the cache it times leaves forward's
    plan in place after the replanning contender has emptied it."""
    from bench import forward_overhead
    from ttj_jax import model
    forward_overhead.main(["--shapes", "cpu-2", "--calls", "6", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("forward-overhead-*.json")
    record = json.loads(path.read_text())["shapes"]["cpu-2"]
    assert set(record["median_us"]) == {"forward", "executable", "forward_replanning"}
    assert all(v > 0 for v in record["median_us"].values()) and record["plan"] == "layers"
    assert len(model.forward_cache_plans()) >= 1
    assert "replanning us" in capsys.readouterr().out


def test_run_shape_records_the_host_time_of_the_peer_beside_the_bridge_and_jax():
    """With the torch peer, its host time per call is sampled in the same interleaved turns as the
    bridge's and the JAX call's (on the GPU, where the peer replays a CUDA graph, it is
    the host cost a graph-replayed bridge call would have)."""
    import ttj_jax as T

    args = cli.parse_args(["--suite", "small", "--warmup", "1", "--rounds", "2", "--calls", "2"])
    args.peer, args.extra_seeds = True, 0   # the peer on the CPU: eager, no graph
    progress = cli.Progress(1)
    try:
        result = cli.run_shape(T.SUITES["small"]["cpu-12"], args, torch.device("cpu"), progress)
    finally:
        progress.close()
    for key in ("bridge_host_us", "jax_host_us", "peer_host_us"):
        assert result[key] > 0
    assert result["peer_ms"] > 0


@pytest.mark.slow
def test_accuracy_sweep_records_every_case_and_flags_failures(tmp_path):
    """bench/accuracy.py on a CPU twin: one record per case with the harness rule's and the fp64
    reference's verdicts; exit status 1 when a case fails (input scale 0.1 does today, for fp16 GEMMs)."""
    from bench import accuracy
    status = accuracy.main(["--shapes", "cpu-2", "--scales", "0.1,1", "--paddings", "0", "--causal", "yes",
                            "--dtypes", "float32", "--seeds", "1", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("accuracy-*.json")
    cases = json.loads(path.read_text())["cases"]
    assert [c["input_scale"] for c in cases] == [0.1, 1.0]
    for case in cases:
        assert {"shape", "input_scale", "padding", "causal", "dtype", "allow_tf32", "seeds", "failed_elements",
                "worst_err_over_tol", "jax", "fp64", "plan"} <= set(case)
        assert case["fp64"]["baseline"]["failed_elements"] == 0   # the fp32 baseline is near exact on the CPU
    assert cases[1]["failed_elements"] == 0 and cases[1]["worst_err_over_tol"] < 1
    assert status == (1 if any(c["failed_elements"] or c["jax"]["failed_elements"] for c in cases) else 0)


def test_accuracy_sweep_runs_the_jax_column_with_a_given_policy(tmp_path):
    """--jax-policy: the JAX column in that numerics policy (here the compensated one, which passes at
    input scale 0.1 where the planner's fails), recorded in the file, whose name carries the tag."""
    from bench import accuracy
    status = accuracy.main(["--shapes", "cpu-2", "--scales", "0.1", "--paddings", "0", "--causal", "yes",
                            "--dtypes", "float32", "--seeds", "1", "--jax-policy", "mixed_fp16x3", "--tag", "x3",
                            "--out", str(tmp_path)])
    (path,) = tmp_path.glob("accuracy-*-x3.json")
    document = json.loads(path.read_text())
    (case,) = document["cases"]
    assert document["jax_policy"] == "mixed_fp16x3"
    assert case["jax"]["failed_elements"] == 0 and case["failed_elements"] > 0 and status == 1


def test_result_files_record_date_versions_and_command():
    import datetime

    import jax
    import torch

    from bench.paths import run_header
    header = run_header("python -m bench.x --y")
    assert header["date"] == datetime.date.today().isoformat()
    assert header["jax"] == jax.__version__ and header["torch"] == torch.__version__ and "jaxlib" in header
    assert header["command"] == "python -m bench.x --y"


def test_device_branch_times_each_variant(tmp_path, capsys):
    from bench import device_branch
    assert device_branch.main(["--size", "64", "--layers", "1", "--calls", "3", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("device-branch-*.json")
    results = json.loads(path.read_text())["results"]
    assert set(results) == {"plain", "cond", "both", "host"}
    assert all(r["stream_ms"] > 0 and r["host_us"] > 0 for r in results.values())


def test_grad_check_keeps_the_worst_of_its_seeds(tmp_path, capsys):
    from bench import grad_check
    assert grad_check.main(["--configs", "cpu-2", "--seeds", "2", "--padding", "0.3", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("grad-check-*.json")
    record = json.loads(path.read_text())["configs"]["cpu-2"]
    per_seed = record["max_rel_grad_err_per_seed"]
    assert record["seeds"] == 2 and len(per_seed) == 2 and len(set(per_seed)) == 2   # seeds differ
    assert record["max_rel_grad_err"] == max(per_seed) < 1e-2


def test_train_times_ttj_under_each_mask_read(tmp_path, capsys):
    from bench import train
    assert train.main(["--configs", "cpu-2", "--mask-reads", "device,host", "--warmup", "1", "--rounds", "1",
                       "--calls", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("train-*.json")
    record = json.loads(path.read_text())["configs"]["cpu-2"]
    for read in ("device", "host"):
        assert record[f"ttj_mask_{read}_ms"] > 0 and record[f"ttj_mask_{read}"]["max_rel_grad_err"] < 1e-2
    with pytest.raises(SystemExit):
        train.main(["--configs", "cpu-2", "--mask-reads", "sometimes"])


def test_train_records_its_switches_and_refuses_a_bad_one(tmp_path, monkeypatch):
    from bench import train
    from ttj_jax import numerics
    monkeypatch.setattr(numerics, "MLP_BIAS_IN_GELU", numerics.MLP_BIAS_IN_GELU)
    assert train.main(["--configs", "cpu-2", "--warmup", "1", "--rounds", "1", "--calls", "1", "--out", str(tmp_path),
                       "--switch", "ttj_jax.numerics.MLP_BIAS_IN_GELU=false"]) == 0
    (path,) = tmp_path.glob("train-*.json")
    document = json.loads(path.read_text())
    assert document["switches"] == {"ttj_jax.numerics.MLP_BIAS_IN_GELU": False} and numerics.MLP_BIAS_IN_GELU is False
    assert document["configs"]["cpu-2"]["ttj"]["max_rel_grad_err"] < 1e-2
    assert train.main(["--configs", "cpu-2", "--switch", "ttj_jax.numerics.NOPE=1"]) == 2


def test_train_breakdown_times_the_parts_and_sizes_the_residuals(tmp_path, capsys):
    from bench import train
    assert train.main(["--configs", "cpu-2", "--breakdown", "--warmup", "1", "--rounds", "1", "--calls", "1",
                       "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("train-*.json")
    parts = json.loads(path.read_text())["configs"]["cpu-2"]["breakdown"]
    for name in ("ttj_forward_ms", "peer_forward_ms", "eager_forward_ms", "jax_forward_ms", "jax_backward_ms"):
        assert parts[name] > 0, name
    x_mb = 1 * 128 * 128 * 4 / 1e6   # cpu-2's input in fp32
    assert 4 * x_mb < parts["ttj_residual_mb"] < 200 * x_mb   # 4 layers of activations (here ~82x: XLA attention)


def test_train_times_ttj_under_each_backward_attention(tmp_path, capsys):
    from bench import train
    assert train.main(["--configs", "cpu-2", "--backward-attentions", "xla,flash", "--warmup", "1", "--rounds",
                       "1", "--calls", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("train-*.json")
    record = json.loads(path.read_text())["configs"]["cpu-2"]
    for kind in ("xla", "flash"):
        assert record[f"ttj_attention_{kind}_ms"] > 0 and record[f"ttj_attention_{kind}"]["max_rel_grad_err"] < 1e-2
    assert "TTJ_BACKWARD_ATTENTION=flash" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train.main(["--configs", "cpu-2", "--backward-attentions", "magic"])


def test_train_programs_times_each_variant_and_restores_the_switches(tmp_path, monkeypatch, capsys):
    """bench.train_programs on the flash path (interpreted on the CPU): every variant's output and
    gradients agree with the default's to rounding (the switches change passes, not the function), and
    the module switches are back as shipped after the run."""
    from bench import train_programs
    from ttj_jax import numerics, training
    from ttj_jax.kernels import flash_attention_bwd
    shipped = (training.FUSED_QKV_ATTENTION, numerics.gelu_erf, numerics.LAYER_NORM_KEEPS_STATISTICS,
               numerics.MLP_BIAS_IN_GELU, flash_attention_bwd.MGPU_BACKWARD_MIN_SEQ_LEN,
               training._flash_attention.finite_rows, numerics.DX_IN_INPUT_DTYPE,
               numerics.WEIGHT_RESIDUAL_TRANSPOSED, flash_attention_bwd.GRADIENT_IN_PLACE,
               numerics.LAYER_NORM_ONE_PASS, numerics.LAYER_NORM_OUT_IN_GEMM_DTYPE,
               numerics.LAYER_NORM_JOINT_PARAMETER_SUMS, flash_attention_bwd.VJP_FORWARD_IMPLEMENTATION,
               flash_attention_bwd.MGPU_BACKWARD_IN_PLACE, flash_attention_bwd.VJP_FORWARD_WITH_HOPPER_BACKWARD)
    monkeypatch.setenv("TTJ_BACKWARD_ATTENTION", "flash")
    variants = ("default,before-f6ebade,ln-recompute,bias-gelu,dx32,weight-kn,dqkv-stacked,ln-one-pass,ln-out32,"
                "ln-two-sums,hopper-forward,generic-forward,mgpu-in-place,inputs-in-residuals,"
                "forward-with-hopper-backward,mgpu-stacked,bias-before-gelu,command-buffers-off,command-buffers-all")
    assert train_programs.main(["--configs", "cpu-2", "--variants", variants,
                                "--min-seconds", "0.01", "--repeats", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("train-programs-*.json")
    records = json.loads(path.read_text())["configs"]["cpu-2"]
    assert set(records) == set(variants.split(","))
    assert not any("error" in record for record in records.values())
    for record in records.values():
        assert record["forward_ms"] > 0 and record["backward_ms"] > 0
        assert record["forward_dispatch_us"] > 0 and record["backward_dispatch_us"] > 0
        assert max(record["rel_l2_vs_first"].values()) < 1e-3
    assert shipped == (training.FUSED_QKV_ATTENTION, numerics.gelu_erf, numerics.LAYER_NORM_KEEPS_STATISTICS,
                       numerics.MLP_BIAS_IN_GELU, flash_attention_bwd.MGPU_BACKWARD_MIN_SEQ_LEN,
                       training._flash_attention.finite_rows, numerics.DX_IN_INPUT_DTYPE,
                       numerics.WEIGHT_RESIDUAL_TRANSPOSED, flash_attention_bwd.GRADIENT_IN_PLACE,
                       numerics.LAYER_NORM_ONE_PASS, numerics.LAYER_NORM_OUT_IN_GEMM_DTYPE,
                       numerics.LAYER_NORM_JOINT_PARAMETER_SUMS, flash_attention_bwd.VJP_FORWARD_IMPLEMENTATION,
                       flash_attention_bwd.MGPU_BACKWARD_IN_PLACE, flash_attention_bwd.VJP_FORWARD_WITH_HOPPER_BACKWARD)
    assert train_programs.KEEP_INPUTS_IN_RESIDUALS is False
    assert "ln-recompute" in capsys.readouterr().out
    assert train_programs.main(["--variants", "default,magic"]) == 2


def test_train_peer_float16_gradients_need_and_get_the_loss_scale():
    """The peer's float16 autocast gradients (~1/numel of the loss's) underflow without loss scaling; with
    the GradScaler's scale they are as close to the fp32 reference as bfloat16's or better."""
    import copy

    import ttj_jax as T
    from bench import train
    from bench.baseline import BaselineTransformer, TransformerConfig, make_inputs
    config = TransformerConfig(**vars(T.shapes.find("cpu-2").config))
    torch.manual_seed(0)
    baseline = BaselineTransformer(config).train()
    reference = copy.deepcopy(baseline)
    x, mask = make_inputs(config, 1234, device=torch.device("cpu"))
    # cpu-2 has 16384 output elements; scaled so the gradients are as small as a GPU config's (~2**-24)
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)) * 2.0 ** -10
    errors = {}
    for autocast in ("float16", "bfloat16"):
        peer = train.peer_model(baseline, torch.device("cpu"), autocast)
        errors[autocast] = train.gradient_errors(reference, peer.module, peer.forward, x, mask, weights,
                                                 loss_scale=peer.loss_scale)["max_rel_grad_err"]
    peer = train.peer_model(baseline, torch.device("cpu"), "float16")
    unscaled = train.gradient_errors(reference, peer.module, peer.forward, x, mask, weights)["max_rel_grad_err"]
    assert errors["float16"] < 2e-3 and errors["bfloat16"] < 3e-2, errors
    assert unscaled > 0.3, unscaled   # the underflow the scale prevents
    step = train.step_fn(peer.module, peer.forward, x, mask, weights, loss_scale=train.PEER_LOSS_SCALE)
    before = [p.detach().clone() for p in peer.module.parameters()]
    step()
    assert any(not torch.equal(a, b) for a, b in zip(before, peer.module.parameters()))   # a step was taken


def test_train_attention_kernels_switch_the_training_paths_flash_kernels(monkeypatch):
    from bench import train
    from ttj_jax.kernels import flash_attention_bwd as fab
    shipped = train.attention_kernels()
    for name in ("MGPU_BACKWARD_DISPATCH", "VJP_FORWARD_IMPLEMENTATION"):   # restored after the test
        monkeypatch.setattr(fab, name, getattr(fab, name))
    train.set_attention_kernels("default")
    assert train.attention_kernels() == shipped
    train.set_attention_kernels("generic")
    assert train.attention_kernels() == {"mgpu_backward_dispatch": False, "vjp_forward_implementation": "generic"}
    train.set_attention_kernels("hopper")
    assert train.attention_kernels() == {"mgpu_backward_dispatch": True, "vjp_forward_implementation": "auto"}


def test_dispatch_cost_times_arguments_kernels_and_stacked_slices(tmp_path, capsys):
    from bench import dispatch_cost
    assert dispatch_cost.main(["--size", "32", "--calls", "3", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("dispatch-cost-*.json")
    document = json.loads(path.read_text())
    assert set(document["args"]) == {str(n) for n in dispatch_cost.ARG_COUNTS}
    assert set(document["kernels"]) == {str(k) for k in dispatch_cost.KERNEL_COUNTS}
    slices = document["stacked_slices"]
    assert slices["same_output"] is True
    assert all(slices[name]["host_us"] > 0 and slices[name]["copy_kernels"] >= 0 for name in ("separate", "stacked"))


def test_host_overhead_takes_any_suites_shape_ids_with_their_padding():
    import argparse

    from bench import host_overhead
    assert host_overhead.parse_shapes("enc-s128-pad70,11,11") == ["enc-s128-pad70", "11"]
    assert host_overhead.shape_by_id("enc-s128-pad70").padding == 0.7 and host_overhead.shape_by_id("11").padding == 0
    with pytest.raises(argparse.ArgumentTypeError, match="unknown shape ids"):
        host_overhead.parse_shapes("nope")


def test_training_peer_on_cuda_raises_dynamos_recompile_limit(monkeypatch):
    """Every config's peer shares the baseline forward's compiled variants; with Dynamo's default limit
    (8) the later configs' peers of one run fell back to eager (seen on the H100, 2026-12-07). A CUDA
    peer raises the limit for the process before compiling (torch.compile stubbed: no GPU here)."""
    import torch._dynamo

    from bench import train
    from bench.baseline import BaselineTransformer, TransformerConfig
    from bench.torch_peer import PEER_RECOMPILE_LIMIT
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    compiled = []
    monkeypatch.setattr(train.torch, "compile", lambda module: compiled.append(module) or module)
    baseline = BaselineTransformer(TransformerConfig(batch_size=1, seq_len=8, d_model=16, num_heads=2,
                                                     ffn_dim=16, num_layers=1, causal=True))
    saved = config.save_config()   # the process-wide limits the CUDA peer raises, restored after
    try:
        setattr(config, name, 8)
        train.peer_model(baseline, torch.device("cpu"))
        assert getattr(config, name) == 8 and compiled == []
        train.peer_model(baseline, torch.device("cuda"))
        assert getattr(config, name) >= PEER_RECOMPILE_LIMIT and len(compiled) == 1
    finally:
        config.load_config(saved)


def test_gpu_only_kernel_tables_and_tilings_say_so_on_the_cpu(capsys):
    """bench.infer_kernels (torch.profiler's kernel records) and bench.attention_tilings (the Hopper
    kernel) refuse a machine without their GPU with exit status 2 and a line that says why."""
    from bench import attention_tilings, infer_kernels
    assert infer_kernels.main(["--configs", "gpt2-s4096"]) == 2
    assert attention_tilings.main([]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "sm_90" in err


def test_switch_sets_a_module_switch_for_the_run_and_records_it(tmp_path, monkeypatch):
    """--switch: a built-but-off switch set for one run (read as its own type) and named in the JSON; a bad
    one (no such switch, not a switch, a package outside the project, a value of the wrong type) sets
    nothing and exits 2."""
    from bench import switches
    from ttj_jax.kernels import flash_attention_bwd
    module = importlib.import_module("ttj_jax.kernels.flash_attention")
    monkeypatch.setattr(module, "UNPADDED_SEQUENCE", False)
    monkeypatch.setattr(flash_attention_bwd, "MGPU_BACKWARD_MIN_SEQ_LEN", flash_attention_bwd.MGPU_BACKWARD_MIN_SEQ_LEN)
    rc = cli.main(["--suite", "small", "--shapes", "cpu-12", "--warmup", "1", "--rounds", "1", "--calls", "1",
                   "--extra-seeds", "0", "--out", str(tmp_path), "--tag", "s", "--no-plot",
                   "--switch", "ttj_jax.kernels.flash_attention.UNPADDED_SEQUENCE=true",
                   "--switch", "ttj_jax.kernels.flash_attention_bwd.MGPU_BACKWARD_MIN_SEQ_LEN=1024"])
    assert rc == 0
    assert module.UNPADDED_SEQUENCE is True and flash_attention_bwd.MGPU_BACKWARD_MIN_SEQ_LEN == 1024
    document = json.loads((tmp_path / "s.json").read_text())
    assert document["switches"] == {"ttj_jax.kernels.flash_attention.UNPADDED_SEQUENCE": True,
                                    "ttj_jax.kernels.flash_attention_bwd.MGPU_BACKWARD_MIN_SEQ_LEN": 1024}
    assert document["shapes"]["cpu-12"]["failed_elements"] == 0
    monkeypatch.setattr(module, "UNPADDED_SEQUENCE", False)
    for bad in ("ttj_jax.kernels.flash_attention.NO_SUCH=1", "ttj_jax.kernels.flash_attention.flash_attention=1",
                "os.SEP=x", "UNPADDED_SEQUENCE=true", "ttj_jax.kernels.flash_attention._MASK_VALUE=0",
                "ttj_jax.kernels.flash_attention.UNPADDED_SEQUENCE=maybe",
                "ttj_jax.kernels.flash_attention_bwd.MGPU_BACKWARD_MIN_SEQ_LEN=long"):
        with pytest.raises(ValueError, match="--switch"):
            switches.parse(bad)
    assert cli.main(["--suite", "small", "--shapes", "cpu-12", "--out", str(tmp_path),
                     "--switch", "ttj_jax.kernels.flash_attention.UNPADDED_SEQUENCE=true",
                     "--switch", "ttj_jax.nope.X=1"]) == 2
    assert module.UNPADDED_SEQUENCE is False   # all parsed before any is set


def test_find_configs_takes_any_suites_ids_and_names_an_unknown_one(capsys):
    from bench.paths import find_configs
    found = find_configs(["1", "gpt2-s4096", "cpu-2"])
    assert list(found) == ["1", "gpt2-s4096", "cpu-2"] and found["gpt2-s4096"].config.seq_len == 4096
    assert find_configs(["1", "gpt3-xl"]) is None
    err = capsys.readouterr().err
    assert "unknown config id" in err and "gpt3-xl" in err
