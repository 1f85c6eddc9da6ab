"""Streaming from host memory: same result as the in-memory forward, for any chunk size (a padded tail
included), one compiled program for all chunks, progress reported per chunk."""

import jax
import numpy as np
import pytest

import ttj_jax as T
from ttj_jax.compat import count_compilations
from ttj_jax.streaming import stream_forward


@pytest.mark.parametrize("batch_chunk, masked", [(2, False), (3, True), (7, False), (None, True)])
def test_streamed_equals_in_memory(batch_chunk, masked):
    config = T.Config(7, 12, 32, 2, 48, 2, True)
    params = T.init_params(jax.random.key(0), config)
    # The exact policy makes the check tight: chunking must not change the math, only the GEMM shapes.
    prepared = T.prepare_weights(params, T.EXACT_FP32)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 12, 32)).astype(np.float32)
    mask = (np.arange(12)[None] < rng.integers(1, 13, (7, 1))) if masked else None
    expected = np.asarray(T.forward(prepared, x, mask, config=config, policy="exact_fp32"))
    seen = []
    with count_compilations() as counter:
        y = stream_forward(prepared, x, mask, config=config, batch_chunk=batch_chunk, policy="exact_fp32",
                           progress=lambda done, total: seen.append((done, total)))
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_allclose(y, expected, atol=2e-5, rtol=0)   # fp32 summation-order noise only
    total = len(range(0, 7, batch_chunk or 1)) if batch_chunk else seen[-1][1]
    assert seen == [(i + 1, total) for i in range(total)]
    assert counter.count <= 1, f"{counter.count} programs compiled for one chunk shape"


def test_planner_chunk_fits_memory():
    config = T.OFFICIAL["14"].config
    facts = T.InputFacts(32, 100000, "float32")
    h200 = T.DeviceFacts(platform="gpu", memory_bytes=100 * 2**30)
    chunk = T.planner.streaming_chunk(config, facts, h200)
    assert 1 <= chunk < 32
    assert T.planner.streaming_chunk(config, facts, T.DeviceFacts(platform="cpu")) == 8


def test_bad_chunk_and_policy_are_refused():
    config = T.Config(2, 4, 16, 2, 16, 1, True)
    params = T.init_params(jax.random.key(0), config)
    x = np.zeros((2, 4, 16), np.float32)
    with pytest.raises(ValueError, match="batch_chunk=0"):
        stream_forward(T.prepare_weights(params, T.MIXED_FP16), x, config=config, batch_chunk=0)
    with pytest.raises(ValueError, match="prepared for policy"):
        stream_forward(T.prepare_weights(params, T.EXACT_FP32), x, config=config)   # plan: mixed_fp16
    with pytest.raises(ValueError, match="d_model"):
        stream_forward(T.prepare_weights(params, T.MIXED_FP16), x[..., :8], config=config)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bridge_stream_forward(dtype, capsys):
    import torch

    import bridge
    from bench.baseline import TransformerConfig, check_close
    config = TransformerConfig(5, 9, 32, 2, 48, 2, True)
    torch.manual_seed(0)
    module = bridge.TTJTransformer(config).eval()
    x = torch.randn(5, 9, 32).to(getattr(torch, dtype))
    mask = torch.arange(9)[None] < torch.tensor([[9], [3], [9], [1], [5]])
    x_before = x.clone()
    y = bridge.stream_forward(module, x, mask, batch_chunk=2)
    assert torch.equal(x, x_before) and y.dtype == x.dtype and y.device.type == "cpu"
    failed, _ = check_close(y.float(), bridge.forward(module, x, mask).float())
    assert failed == 0
    assert "chunk 3/3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="host memory"):
        bridge.stream_forward(module, x.to("meta"))
