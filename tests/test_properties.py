"""Property tests: hypothesis draws model shapes, inputs and masks; ttj_jax must agree with the torch
reference everywhere (exact policy within fp32 noise, mixed policy under the harness rule)."""

import numpy as np
import pytest
import torch
from conftest import baseline_and_params, to_jax, to_torch, torch_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ttj_jax as T
from bench.baseline import check_close


@st.composite
def cases(draw):
    num_heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16]))
    config = T.Config(batch_size=draw(st.integers(1, 3)), seq_len=draw(st.integers(1, 20)),
                      d_model=num_heads * head_dim, num_heads=num_heads,
                      ffn_dim=draw(st.sampled_from([16, 48])), num_layers=draw(st.integers(1, 2)),
                      causal=draw(st.booleans()))
    mask = None
    if draw(st.booleans()):
        bits = draw(st.lists(st.booleans(), min_size=config.batch_size * config.seq_len,
                             max_size=config.batch_size * config.seq_len))
        mask = torch.tensor(bits).reshape(config.batch_size, config.seq_len)
    return config, mask, draw(st.integers(0, 2**16)), draw(st.sampled_from([0.5, 1.0, 3.0]))


def _check_forward(case):
    config, mask, seed, scale = case
    base, params = baseline_and_params(config, seed=seed)
    x = torch.randn(config.batch_size, config.seq_len, config.d_model,
                    generator=torch.Generator().manual_seed(seed)) * scale
    if mask is not None:
        x = x.masked_fill(~mask[:, :, None], 0.0)
    ref = torch_reference(base, x, mask)
    exact = T.forward(params, to_jax(x), to_jax(mask), config=config, policy="exact_fp32")
    np.testing.assert_allclose(np.asarray(exact), ref.numpy(), rtol=0, atol=2e-5)
    mixed = T.forward(params, to_jax(x), to_jax(mask), config=config)
    failed, worst = check_close(to_torch(mixed), ref)
    assert failed == 0, f"{failed} elements fail the harness rule (worst {worst:.2f}) for {config}"


# Derandomized: CI draws the same 20 cases on every run. Random draws found the case below, a miss of
# the mixed policy's fp16 GEMMs at input scale 0.5 (issue 33, numerics at small scales), and would fail
# CI on one run in many, unrelated to the change under test.
@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(cases())
def test_forward_matches_torch_reference(case):
    _check_forward(case)


@pytest.mark.xfail(strict=True, reason="known: the mixed policy (fp16 GEMMs) misses the harness rule by one element "
                                       "at input scale 0.5, d_model 8, non-causal (issue 33); strict, so a fix shows")
def test_forward_known_mixed_policy_miss_at_input_scale_half():
    config = T.Config(batch_size=2, seq_len=15, d_model=8, num_heads=1, ffn_dim=16, num_layers=2, causal=False)
    _check_forward((config, None, 15729, 0.5))
