"""bench/bench_attention.py's contenders: ttj's kernel as users call it comes first and is labelled with the
implementation the dispatcher picks (the script itself runs on the H200; `--smoke` covers it on a CPU)."""

import pytest

import bench.bench_attention as ba
from ttj_jax.kernels.flash_attention import resolve_block_sizes


def _ttj(contenders):
    return [c for c in contenders if c.name == "ttj"]


def test_hopper_cases_time_the_dispatched_kernel_then_the_other_lowering_then_generic(monkeypatch):
    monkeypatch.setattr(ba, "use_mosaic_kernel", lambda *args, **kwargs: True)   # as on an sm_90 GPU
    for head_dim, other in ((64, "warpgroup"), (128, "lane")):
        ttj = _ttj(ba._contenders(1, 16, 100_000, head_dim, quick=False, interpret=False))
        assert ttj[0].variant == "default (mosaic_gpu)" and ttj[0].block_sizes is None
        assert ttj[1].variant == f"mosaic_gpu {other}" and ttj[1].fn.keywords["lowering_semantics"] == other
        generic = ttj[2:]
        assert len(generic) == 4 and all(c.variant == "generic" and c.block_sizes is not None for c in generic)
        assert len({c.block_sizes for c in generic}) == 4


@pytest.mark.parametrize("quick", [False, True])
def test_other_cases_time_the_generic_default_once(quick):
    ttj = _ttj(ba._contenders(64, 4, 1024, 32, quick=quick, interpret=True))
    assert ttj[0].variant == "default (generic)"
    assert ttj[0].block_sizes == resolve_block_sizes(1024, 32, None, causal=True)
    assert all(c.variant == "generic" and c.block_sizes != ttj[0].block_sizes for c in ttj[1:])
    assert len(ttj) == (2 if quick else 4)
    others = ba._contenders(64, 4, 1024, 32, quick=quick, interpret=True)[len(ttj):]
    assert [c.name for c in others] == ["cudnn", "xla", "jax_triton", "jax_mosaic"]
    # jax's bundled kernels take whole blocks only: timed at the next multiple where S is not one
    assert [c.seq_multiple for c in others] == [1, 1, ba.BUNDLED_SEQ_MULTIPLE, ba.BUNDLED_SEQ_MULTIPLE]
    assert all(c.seq_multiple == 1 for c in ttj)


def test_mgpu_study_labels_name_every_option_that_changes_the_build():
    """bench_attention_mgpu's tables and logs label each timed build by its options: two builds that
    differ in any one MgpuBlockSizes option must not share a label."""
    import dataclasses

    import bench.bench_attention_mgpu as bam
    from ttj_jax.kernels.flash_attention_mgpu import MgpuBlockSizes

    base = MgpuBlockSizes(block_kv=128, num_stages=4, num_compute_wgs=2)
    labels = {"default": bam._kwargs_text({"block_sizes": base})}
    for field in dataclasses.fields(MgpuBlockSizes):
        value = getattr(base, field.name)
        changed = (not value) if isinstance(value, bool) else value * 2 if field.name != "num_compute_wgs" else 3
        labels[field.name] = bam._kwargs_text({"block_sizes": dataclasses.replace(base, **{field.name: changed})})
    assert len(set(labels.values())) == len(labels), labels
    assert set(labels) == {"default"} | {field.name for field in dataclasses.fields(MgpuBlockSizes)}


@pytest.mark.slow
@pytest.mark.interpret
def test_smoke_run_writes_every_case_with_its_gpu_state(tmp_path):
    """The whole script on the CPU (--smoke: tiny cases in interpret mode): checks pass, the JSON holds
    every contender's record, and each timed one says what clock it ran at (None without nvidia-smi)."""
    import json
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "bench/bench_attention.py", "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [path] = tmp_path.glob("attention-*-smoke.json")
    payload = json.loads(path.read_text())
    assert payload["checks"] and all(c["passed"] for c in payload["checks"])
    timed = [c for c in payload["cases"] if c["ms"] is not None]
    assert "ttj" in {c["contender"] for c in timed}
    assert all("gpu_state" in c for c in timed)
    assert all(c["tflops"] > 0 for c in timed)


def test_multicast_studies_compare_with_and_without_it_where_they_say():
    """--multicast times kv_multicast against the same tiling without it at its default lengths, and
    --multicast_lengths at the lengths that set its thresholds; both are registered studies (a CPU run
    refuses them: exit 2)."""
    import bench.bench_attention_mgpu as bam
    from ttj_jax.kernels import flash_attention_mgpu_config as fm
    from ttj_jax.kernels.flash_attention_mgpu_config import MULTICAST_MIN_SEQ_LEN

    for (_, _, seq_len, head_dim), _ in bam.MULTICAST_CASES:
        assert seq_len >= MULTICAST_MIN_SEQ_LEN[head_dim]
    # the thresholds are lengths --multicast_lengths measures, with a shorter one measured below 64's
    lengths = {}
    for (_, _, seq_len, head_dim), _ in bam.MULTICAST_LENGTH_CASES:
        lengths.setdefault(head_dim, set()).add(seq_len)
    assert all(MULTICAST_MIN_SEQ_LEN[head_dim] in measured for head_dim, measured in lengths.items())
    assert min(lengths[64]) < MULTICAST_MIN_SEQ_LEN[64]
    for seq_len, head_dim in ((100_000, 64), (16384, 128), (1000, 64)):
        on = bam._multicast_variant(seq_len, head_dim)["block_sizes"]
        off = bam._multicast_variant(seq_len, head_dim, on=False)["block_sizes"]
        assert on.kv_multicast and not off.kv_multicast
        assert on.block_kv == off.block_kv and on.num_compute_wgs == off.num_compute_wgs
        assert bam._kwargs_text({"block_sizes": on}) != bam._kwargs_text({"block_sizes": off})
        # "on" is multicast as the defaults take it (at head_dim 64 without the ping-pong ring), "off" the plain tiling
        assert off.pingpong and on.pingpong == (head_dim not in fm.MULTICAST_WITHOUT_PINGPONG)
        if seq_len >= MULTICAST_MIN_SEQ_LEN.get(head_dim, float("inf")):
            assert on == fm.default_block_sizes(head_dim, seq_len)
    assert {"multicast", "multicast_lengths"} <= set(bam.STUDIES)
    assert bam.main(["--multicast_lengths"]) == 2   # needs a GPU


def test_key_mask_clean_study_is_registered_and_labels_its_build():
    """--key_mask_clean checks the build with clean-block bounds under its own label (the table tells it
    from the build without), then times both; a CPU run refuses it (exit 2)."""
    import bench.bench_attention_mgpu as bam

    assert bam._kwargs_text({"clean_blocks": True}) != bam._kwargs_text({})
    assert {"key_mask", "key_mask_timing", "key_mask_clean"} <= set(bam.STUDIES)
    assert bam.main(["--key_mask_clean"]) == 2   # needs a GPU


def test_backward_bench_masks_and_variants():
    """bench/bench_attention_bwd.py (GPU-only timing): its padding masks are prefixes spread evenly over the
    harness's range of lengths (the first sequence whole, the last padded by the ratio) and every Hopper
    variant fits shared memory at head_dim 64 with a key mask."""
    import numpy as np

    import bench.bench_attention_bwd as bab
    from ttj_jax.kernels import flash_attention_mgpu_bwd as fb
    assert bab.padding_mask(4, 100, 0.0) is None
    mask = np.asarray(bab.padding_mask(4, 100, 0.3))
    assert mask.shape == (4, 100) and mask.dtype == bool
    assert list(mask.sum(axis=1)) == [100, 90, 80, 70]
    assert all(mask[b, :n].all() and not mask[b, n:].any() for b, n in enumerate(mask.sum(axis=1)))
    for name, config in bab.MGPU_VARIANTS.items():
        assert fb.smem_bytes(64, 2, config) <= fb.SMEM_BUDGET_BYTES, name


@pytest.mark.interpret
def test_ragged_smoke_compares_both_forms_and_writes_its_json(tmp_path):
    """--ragged --smoke: the unpadded and padded calls agree on every smoke case, and the JSON says so."""
    import json
    assert ba.main(["--ragged", "--smoke", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("attention-ragged-*-smoke.json")
    cases = json.loads(path.read_text())["cases"]
    assert len(cases) == len(ba.RAGGED_SMOKE_CASES)
    assert all(c["passed"] and c["finite"] and c["max_abs_diff"] == 0.0 for c in cases)
