"""Sequence parallelism (ttj_jax/ring_attention.py): one sequence split over 2 and 4 CPU devices (XLA's
host platform split, in a subprocess, since the device count is fixed when jax starts), against the
one-device forward and the fp32 reference. bench/ring_check.py runs the same code over GPUs."""

import json
import textwrap

import numpy as np
import pytest
from conftest import last_json_line, run_on_host_devices

from ttj_jax.ring_attention import zigzag_order

SCRIPT = textwrap.dedent("""
    import json, numpy as np, jax, jax.numpy as jnp
    import ttj_jax as T
    from ttj_jax.ring_attention import sequence_parallel_forward
    from ttj_jax.numerics import harness_check
    failing = lambda out, ref: int(harness_check(out, ref)[0])   # the harness rule, elements outside it
    assert len(jax.devices()) == 4, jax.devices()
    out = {}
    for causal in (True, False):
        config = T.Config(2, 48, 32, 2, 48, 2, causal)
        params = T.init_params(jax.random.key(0), config)
        x = jax.random.normal(jax.random.key(1), (2, 48, 32))
        mask = jnp.asarray(np.random.default_rng(0).random((2, 48)) > 0.3).at[1].set(False)  # one all-False
        for mask_name, m in (("none", None), ("general", mask)):
            exact_one = T.forward(params, x, m, config=config, policy="exact_fp32")
            reference = T.reference(params, x, m, config=config)
            for n in (2, 4):
                # chunks that do not divide the zigzag halves: key chunks straddle them
                kwargs = dict(config=config, devices=n, query_chunk=4, key_chunk=5)
                exact = sequence_parallel_forward(params, x, m, policy="exact_fp32", **kwargs)
                mixed = sequence_parallel_forward(params, x, m, **kwargs)
                case = {"exact_vs_one_device": float(jnp.abs(exact - exact_one).max()),
                        "mixed_failed_vs_reference": failing(mixed, reference),
                        "finite": bool(jnp.isfinite(mixed).all()), "shape": list(mixed.shape)}
                # our flash kernel per zigzag-chunk pair (interpreted here, ~6 s a program), merged by
                # log-sum-exp: on one device count per (causal, mask), 2 and 4 each twice
                if (n == 4) == (causal == (mask_name == "general")):
                    flash = sequence_parallel_forward(params, x, m, attention="pallas", **kwargs)
                    case.update(flash_failed_vs_reference=failing(flash, reference),
                                flash_vs_mixed=float(jnp.abs(flash - mixed).max()),
                                finite=case["finite"] and bool(jnp.isfinite(flash).all()))
                out[f"{causal}/{mask_name}/{n}"] = case
    # through ttj_jax.forward: the plan's sequence_parallel (the planner picks it on GPUs; asked for here)
    config = T.Config(1, 48, 32, 2, 48, 2, True)
    params = T.init_params(jax.random.key(2), config)
    x = jax.random.normal(jax.random.key(3), (1, 48, 32))
    via_forward = T.forward(params, x, config=config, sequence_parallel=2)
    direct = sequence_parallel_forward(params, x, config=config, devices=2, attention="pallas")
    all_true = sequence_parallel_forward(params, x, jnp.ones((1, 48), bool), config=config, devices=2,
                                         attention="pallas")
    reference = T.reference(params, x, None, config=config)
    out["forward"] = {"vs_direct": float(jnp.abs(via_forward - direct).max()),
                      "all_true_mask_vs_none": float(jnp.abs(all_true - direct).max()),
                      "failed_vs_reference": failing(via_forward, reference),
                      "plan": T.model.plan_for(config, x, T.MaskKind.NONE, sequence_parallel=2).name}
    two = jnp.concatenate([x, x])
    for name, call in (("with_batch_split", lambda: T.forward(params, two, config=config, sequence_parallel=2, data_parallel=2)),
                       ("odd_for_ring", lambda: T.forward(params, x[:, :46], config=config, sequence_parallel=4))):
        try:
            call()
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # it is a ring: the program's collectives are permutes, and no device gathers the whole sequence
    config = T.Config(2, 48, 32, 2, 48, 1, True)
    params = T.prepare_weights(T.init_params(jax.random.key(0), config), T.MIXED_FP16)
    from ttj_jax.ring_attention import _compiled
    hlo = _compiled(config.with_input(1, 1), 4, "mixed_fp16", 4, 5, False, "cpu").lower(
        params, jnp.zeros((2, 48, 32)), None).as_text()
    out["hlo"] = {name: hlo.count(name) for name in ("collective_permute", "all_gather", "all_to_all")}
    for name, call in (("odd_length", lambda: sequence_parallel_forward(params, jnp.zeros((2, 46, 32)), config=config, devices=4)),
                       ("bad_devices", lambda: sequence_parallel_forward(params, jnp.zeros((2, 48, 32)), config=config, devices=0)),
                       ("bad_attention", lambda: sequence_parallel_forward(params, jnp.zeros((2, 48, 32)), config=config,
                                                                           devices=2, attention="cudnn")),
                       ("bad_mask", lambda: sequence_parallel_forward(params, jnp.zeros((2, 48, 32)), jnp.ones((2, 47), bool),
                                                                      config=config, devices=2))):
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as e:
            out[name] = str(e)
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.interpret   # our flash kernel inside the ring
def test_sequence_parallel_matches_one_device():
    out = last_json_line(run_on_host_devices(["-c", SCRIPT], 4, timeout=600))
    cases = [k for k in out if k.count("/") == 2]
    assert len(cases) == 8
    flash_cases = sorted(k for k in cases if "flash_failed_vs_reference" in out[k])
    assert flash_cases == ["False/general/2", "False/none/4", "True/general/4", "True/none/2"], flash_cases
    for name in cases:
        case = out[name]
        # exact policy: the same fp32 math in another order (one device: 0 up to rounding)
        assert case["exact_vs_one_device"] <= 1e-5, (name, case)
        # fp16 GEMMs: the harness rule against the fp32 reference, every element
        assert case["mixed_failed_vs_reference"] == 0 and case["finite"] and case["shape"] == [2, 48, 32], (name, case)
        if name in flash_cases:
            assert case["flash_failed_vs_reference"] == 0 and case["flash_vs_mixed"] <= 2e-3, (name, case)
    # N - 1 = 3 ring hops per attention, one layer: k/v, positions and key mask each travel (permutes of a
    # tuple may be fused into one op or stay several: at least 3); nothing gathers the sequence
    assert out["hlo"]["collective_permute"] >= 3 and out["hlo"]["all_gather"] == 0 and out["hlo"]["all_to_all"] == 0, out["hlo"]
    assert "multiple of 2 * devices" in out["odd_length"]
    assert "devices must be" in out["bad_devices"]
    assert "'xla' or 'pallas'" in out["bad_attention"]
    assert "valid_token_mask must have shape" in out["bad_mask"]
    forward = out["forward"]
    assert forward["vs_direct"] <= 1e-6 and forward["all_true_mask_vs_none"] == 0.0, forward
    assert forward["failed_vs_reference"] == 0 and forward["plan"].endswith("/ring-x2-devices"), forward
    assert "sequence_parallel needs no batch split" in out["with_batch_split"]
    assert "multiple of 2 * sequence_parallel" in out["odd_for_ring"]


def test_zigzag_order_balances_causal_work():
    for seq_len, devices in ((48, 4), (64, 2), (12, 1)):
        order = zigzag_order(seq_len, devices)
        assert sorted(order.tolist()) == list(range(seq_len))                 # a permutation
        per_device = order.reshape(devices, -1)
        chunk = seq_len // (2 * devices)
        assert per_device[0, :chunk].tolist() == list(range(chunk))           # device 0 holds chunk 0 ...
        assert per_device[0, chunk:].tolist() == list(range(seq_len - chunk, seq_len))   # ... and the last
        # causal (query, key) pairs whose query each device holds: equal on every device
        work = [int(np.sum(positions + 1)) for positions in per_device]
        assert len(set(work)) == 1, work
    with pytest.raises(ValueError, match="multiple of 2"):
        zigzag_order(50, 4)


@pytest.mark.slow
@pytest.mark.interpret   # its "pallas" ring
def test_ring_check_tool_on_two_cpu_devices(tmp_path):
    """bench/ring_check.py (the GPU check of the ring) end to end on two CPU devices, tiny config."""
    run_on_host_devices(["bench/ring_check.py", "--config", "2,64,32,2,48,2", "--query-chunk", "8", "--key-chunk",
                         "8", "--calls", "1", "--out", str(tmp_path), "--tag", "r"], 2, timeout=600)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["devices"] == 2 and result["failed_vs_one_device"] == 0 and set(result["rings"]) == {"xla", "pallas"}
    for ring in result["rings"].values():
        assert ring["failed_vs_one_device"] == 0 and ring["max_abs_diff"] < 2e-3
        assert ring["ring_ms"] > 0 and len(ring["ring_timing_ms"]) == 1
    assert result["one_device_ms"] > 0
