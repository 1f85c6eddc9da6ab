"""Data parallelism through JAX's SPMD on two CPU devices (XLA's host platform split in two, in a
subprocess, since the device count is fixed when jax starts). The same code path runs over GPUs."""

import dataclasses
import re
import textwrap

import pytest
from conftest import last_json_line, run_on_host_devices

import ttj_jax as T
from ttj_jax.masks import MaskKind

SCRIPT = textwrap.dedent("""
    import json, numpy as np, jax, jax.numpy as jnp
    import ttj_jax as T
    assert len(jax.devices()) == 2, jax.devices()
    config = T.Config(4, 24, 32, 2, 48, 2, True)
    params = T.init_params(jax.random.key(0), config)
    x = jax.random.normal(jax.random.key(1), (4, 24, 32))
    mask = jnp.asarray(np.random.default_rng(0).random((4, 24)) > 0.3)
    out = {}
    for name, m in (("none", None), ("general", mask)):
        one = T.forward(params, x, m, config=config, data_parallel=1)
        two = T.forward(params, x, m, config=config, data_parallel=2)
        out[name] = {"max_abs_diff": float(jnp.abs(one - two).max()),
                     "devices": len(two.sharding.device_set), "shape": list(two.shape)}
    for name, m in (("fused_none", None), ("fused_general", mask)):   # the fused kernel on each device
        one = T.forward(params, x, m, config=config, data_parallel=1, stack="fused")
        two = T.forward(params, x, m, config=config, data_parallel=2, stack="fused")
        out[name] = {"max_abs_diff": float(jnp.abs(one - two).max()),
                     "devices": len(two.sharding.device_set), "shape": list(two.shape)}
    plan = T.model.plan_for(config, x, T.MaskKind.NONE, data_parallel=2)
    out["name"] = plan.name
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    chunked = T.Plan(policy="mixed_fp16", attention="xla", mask_mode="none", batch_chunk=1, data_parallel=2)
    y = T.executable(chunked, T.model_key(config))(prepared, x, None)
    out["chunked_max_abs_diff"] = float(jnp.abs(y - T.forward(prepared, x, config=config)).max())
    # The split replicates the weights once per weights object, not on every call (parallel.py)
    split = T.executable(T.Plan(policy="mixed_fp16", attention="xla", mask_mode="none", data_parallel=2),
                         T.model_key(config))
    placed, real_put = [], jax.device_put
    def counting_put(value, *a, **k):
        placed.append(value is prepared)
        return real_put(value, *a, **k)
    jax.device_put = counting_put
    first = split(prepared, x, None)
    again = split(prepared, x, None)
    other = split(jax.tree.map(lambda a: a, prepared), x, None)   # a new container: placed again
    jax.device_put = real_put
    out["weights_placed"] = [sum(placed), len(placed)]
    out["repeat_identical"] = bool((first == again).all()) and bool((first == other).all())

    import torch, bridge
    torch.manual_seed(0)   # fixed init and input: the tolerances below hold for them, not for any draw
    module = bridge.TTJTransformer(config).eval()
    tx = torch.randn(4, 24, 32)
    tm = torch.from_numpy(np.asarray(mask))
    tx = torch.cat([tx, torch.randn(2, 24, 32)])
    tx0 = tx.clone()   # 6 sequences: 4 split and 2 home rows, or 3 chunks
    tm = torch.cat([tm, tm[:2]])
    for name, m, stack, chunks, home in (("bridge_none", None, None, 1, 0), ("bridge_general", tm, None, 1, 0),
                                         ("bridge_fused", tm, "fused", 1, 0), ("bridge_chunks", tm, None, 3, 0),
                                         ("bridge_home", tm, None, 2, 2), ("bridge_home_fused", None, "fused", 1, 4),
                                         ("bridge_weighted", tm, None, (1, 2), 0), ("bridge_default", tm, None, None, 2)):
        one = bridge.forward(module, tx, m, data_parallel=1, stack=stack)
        two = bridge.forward(module, tx, m, data_parallel=2, stack=stack, split_chunks=chunks,
                             split_home_rows=home)
        from bench.baseline import check_close
        out[name] = {"max_abs_diff": float((one - two).abs().max()), "devices": 2,
                     "shape": list(two.shape), "device": str(two.device), "input_kept": bool((tx == tx0).all()),
                     "harness_failed": check_close(two, one)[0]}
    for name, kwargs in (("chunks_refused", dict(split_chunks=4)),
                         ("home_refused", dict(split_home_rows=1)),
                         ("home_all_refused", dict(split_home_rows=6))):
        try:
            bridge.forward(module, tx, tm, data_parallel=2, **kwargs)
            out[name] = False
        except ValueError as e:
            out[name] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.interpret   # the fused stack kernel on each device
def test_two_devices_match_one():
    out = last_json_line(run_on_host_devices(["-c", SCRIPT], 2))
    # Each device multiplies a smaller batch, so GEMM shapes and the fp32 accumulation order change:
    # differences up to ~3e-4 against outputs of order 1. The criterion is the harness rule; 1e-3 bounds the
    # rest.
    bridge_names = ("bridge_none", "bridge_general", "bridge_fused", "bridge_chunks", "bridge_home",
                    "bridge_home_fused", "bridge_weighted", "bridge_default")
    for name in ("none", "general", "fused_none", "fused_general") + bridge_names:
        assert out[name]["devices"] == 2 and out[name]["shape"] == ([6, 24, 32] if "bridge" in name else [4, 24, 32])
        assert out[name]["max_abs_diff"] <= 1e-3, out
    for name in bridge_names:
        assert out[name]["device"] == "cpu" and out[name]["harness_failed"] == 0 and out[name]["input_kept"], out
    # 6 sequences do not split into 4 chunks over 2 devices; 5 (after 1 home row) not over 2; 6 home
    # rows leave nothing to split
    assert "4 chunk(s)" in out["chunks_refused"], out
    # weights placed on the first call only (then x alone each call), and again for a new container
    assert out["weights_placed"] == [1, 5] and out["repeat_identical"], out
    assert "after 1 home rows" in out["home_refused"], out
    assert "leaves none" in out["home_all_refused"], out
    # Chunks of one sequence change the GEMM shapes and so the fp32 accumulation order: 1e-4 (against
    # outputs of order 1), still far under the harness's 2e-3.
    assert out["chunked_max_abs_diff"] <= 1e-4 and out["name"].endswith("/x2-devices")


def test_split_chunk_rows():
    from ttj_jax.parallel import split_chunk_rows
    assert split_chunk_rows(10000, 2, 4) == [2500] * 4
    assert split_chunk_rows(10000, 2, (1, 4, 4, 1)) == [1000, 4000, 4000, 1000]
    assert split_chunk_rows(10, 2, (1, 1, 1)) == [2, 2, 6]   # 5 rows per device: 1, 1, and the rest 3
    assert split_chunk_rows(6, 2, (1, 2)) == [2, 4]
    assert sum(split_chunk_rows(9998, 2, (1, 3, 3, 1))) == 9998
    from ttj_jax.parallel import default_split_chunks
    assert [default_split_chunks(rows, 2) for rows in (10000, 32, 12, 6, 7)] == [4, 4, 2, 1, 1]
    for rows, devices, chunks, message in ((10, 2, 3, "3 chunk(s)"), (9, 2, (1, 1), "over 2 devices"),
                                           (4, 2, (1, 5), "too small"), (8, 2, (1, 0), "positive"),
                                           (8, 2, 0, ">= 1"), (8, 2, True, "int")):
        with pytest.raises(ValueError, match=re.escape(message)):
            split_chunk_rows(rows, devices, chunks)


H200X2 = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30, device_count=2)


def test_planner_splits_only_large_batches_already_spread_over_devices():
    shape_6, shape_1 = T.OFFICIAL["6"].config, T.OFFICIAL["1"].config
    facts = lambda c, b=None, on=2: T.InputFacts(b or c.batch_size, c.seq_len, "float32", MaskKind.ALL_TRUE,
                                                 input_devices=on)
    split = T.plan(shape_6, facts(shape_6), H200X2)
    assert split.data_parallel == 2 and split.stack == "fused"    # the fused kernel on each device's half
    assert T.plan(T.OFFICIAL["14"].config, facts(T.OFFICIAL["14"].config), H200X2).data_parallel == 2
    assert T.plan(shape_1, facts(shape_1), H200X2).data_parallel == 1          # launch-bound: one device
    assert T.plan(shape_6, facts(shape_6, 9999), H200X2).data_parallel == 1   # odd batch: no even split
    # x on one device: a JAX caller's array stays there (jax moving half of it was measured slower) ...
    one = T.plan(T.OFFICIAL["14"].config, facts(T.OFFICIAL["14"].config, on=1), H200X2)
    assert one.data_parallel == 1 and "measured slower" in one.explain()
    # ... the bridge's tensor is split over two GPUs (its peer copies), also with more visible, if large
    from_torch = lambda c, b=None: dataclasses.replace(facts(c, b, on=1), caller="torch")   # noqa: E731
    H200X4 = dataclasses.replace(H200X2, device_count=4)
    for shape in ("6", "14"):
        for gpus in (H200X2, H200X4):
            plan = T.plan(T.OFFICIAL[shape].config, from_torch(T.OFFICIAL[shape].config), gpus)
            assert plan.data_parallel == 2 and "peer-to-peer" in plan.explain(), plan.explain()
    assert T.plan(shape_1, from_torch(shape_1), H200X2).data_parallel == 1
    assert T.plan(shape_6, from_torch(shape_6, 9999), H200X2).data_parallel == 1
    assert T.plan(shape_6, from_torch(shape_6), dataclasses.replace(H200X2, device_count=1)).data_parallel == 1
    with pytest.raises(ValueError, match="cannot be split evenly"):
        T.plan(shape_6, facts(shape_6, 9999), H200X2, data_parallel=2)

