"""CPU tests for the torch peer (bench/torch_peer.py) and the timing protocol (bench/timing.py).

The peer must pass the harness's own rule (bench.baseline.check_close: zero failed elements) against
BaselineTransformer, in fp32 on the CPU, where its GEMMs use the same fp16-rounded-operand arithmetic
as on CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench.baseline import BaselineTransformer, TransformerConfig, check_close, make_inputs
from bench.timing import interleaved_host_overhead_us, loop_host_us, time_contenders
from bench.torch_peer import (
    MASK_KEYS,
    MASK_NONE,
    MASK_ROWS,
    _raised_recompile_limit,
    _record,
    _unchanged_since,
    build_peer,
    classify_mask,
)

CAUSAL = TransformerConfig(batch_size=2, seq_len=33, d_model=64, num_heads=4, ffn_dim=96, num_layers=2)
HEAD_DIM_8 = TransformerConfig(batch_size=2, seq_len=40, d_model=32, num_heads=4, ffn_dim=32, num_layers=3)
NON_CAUSAL = TransformerConfig(batch_size=3, seq_len=17, d_model=48, num_heads=2, ffn_dim=80, num_layers=2,
                               causal=False)


def _models(config, seed=0):
    torch.manual_seed(seed)
    baseline = BaselineTransformer(config).eval()
    return baseline, build_peer(baseline, config, device="cpu")


def _assert_matches(peer, baseline, x, mask):
    x_before, mask_before = x.clone(), None if mask is None else mask.clone()
    with torch.inference_mode():
        ref = baseline(x, mask)
        out = peer(x, mask)
    assert out.shape == x.shape and out.dtype == x.dtype
    failed, worst = check_close(out, ref)
    assert failed == 0, f"{failed} elements fail the harness rule (worst error/tolerance {worst:.2f})"
    assert torch.equal(x, x_before), "the peer modified its input"
    if mask is not None:
        assert torch.equal(mask, mask_before), "the peer modified the mask"
    return out


@pytest.mark.parametrize("config", [CAUSAL, HEAD_DIM_8, NON_CAUSAL], ids=["causal", "head_dim8", "non_causal"])
@pytest.mark.parametrize("padding_ratio", [0.0, 0.3])
def test_peer_matches_baseline(config, padding_ratio):
    baseline, peer = _models(config)
    for seed in (1234, 1235):
        x, mask = make_inputs(config, seed, padding_ratio=padding_ratio)
        out = _assert_matches(peer, baseline, x, mask)
        if padding_ratio > 0:
            assert not out[~mask].any(), "invalid rows must be exactly zero"


@pytest.mark.parametrize("config", [CAUSAL, NON_CAUSAL], ids=["causal", "non_causal"])
def test_peer_matches_baseline_without_mask(config):
    baseline, peer = _models(config)
    x, _ = make_inputs(config, 7)
    _assert_matches(peer, baseline, x, None)


@pytest.mark.parametrize("config", [CAUSAL, NON_CAUSAL], ids=["causal", "non_causal"])
def test_peer_matches_baseline_with_non_prefix_mask(config):
    baseline, peer = _models(config)
    x, _ = make_inputs(config, 8)
    mask = torch.rand(config.batch_size, config.seq_len, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    mask[0] = False                                    # one sequence with no valid token at all
    x = x.masked_fill(~mask[:, :, None], 0.0)
    assert classify_mask(mask, config.causal) == MASK_KEYS
    out = _assert_matches(peer, baseline.float(), x, mask)
    assert torch.isfinite(out).all() and not out[0].any()


def test_classify_mask():
    all_true = torch.ones(2, 5, dtype=torch.bool)
    prefix = torch.arange(5)[None, :] < torch.tensor([[3], [5]])
    holes = prefix.clone()
    holes[1, 2] = False
    assert classify_mask(None, True) == MASK_NONE
    assert classify_mask(all_true, True) == MASK_NONE
    assert classify_mask(prefix, True) == MASK_ROWS
    assert classify_mask(prefix, False) == MASK_KEYS   # without causal, padded keys would be seen
    assert classify_mask(holes, True) == MASK_KEYS


def test_mask_kind_cache_sees_in_place_changes():
    baseline, peer = _models(CAUSAL)
    x, mask = make_inputs(CAUSAL, 11)
    with torch.inference_mode():
        peer(x, mask)                                  # all-True: cached as "no mask"
    mask[1, 20:] = False                               # same tensor object, changed in place
    x = x.masked_fill(~mask[:, :, None], 0.0)
    out = _assert_matches(peer, baseline, x, mask)
    assert not out[1, 20:].any()


def test_mask_kind_of_inference_tensors_is_never_cached():
    baseline, peer = _models(CAUSAL)
    with torch.inference_mode():
        x, mask = make_inputs(CAUSAL, 12)              # inference tensors: no version counter
        peer(x, mask)
        mask[0, 30:] = False
        x = x.masked_fill(~mask[:, :, None], 0.0)
        out, ref = peer(x, mask), baseline(x, mask)
    assert check_close(out, ref)[0] == 0 and not out[0, 30:].any()


def test_unchanged_since_tracks_identity_and_writes():
    t = torch.zeros(3)
    source = _record(t)
    assert _unchanged_since(source, t)
    assert not _unchanged_since(source, t.clone())      # another tensor with equal values
    t.add_(1)
    assert not _unchanged_since(source, t)             # written in place
    assert not _unchanged_since(None, t)
    with torch.inference_mode():
        frozen = torch.zeros(3)
    assert _record(frozen) is None and not _unchanged_since(_record(frozen), frozen)


def test_raised_recompile_limit_is_scoped():
    import torch._dynamo
    before = dict(torch._dynamo.config.get_config_copy())
    with _raised_recompile_limit():
        assert torch._dynamo.config.recompile_limit >= 64
    assert dict(torch._dynamo.config.get_config_copy()) == before


def test_peer_with_half_input_returns_half():
    baseline, peer = _models(CAUSAL)
    x, mask = make_inputs(CAUSAL, 5)
    with torch.inference_mode():
        out = peer(x.half(), mask)
        ref = baseline(x, mask)
    assert out.dtype == torch.float16 and out.shape == x.shape
    assert (out.float() - ref).abs().max() < 0.05      # fp16 output: only a loose sanity bound


def test_peer_rejects_bad_shapes():
    _, peer = _models(CAUSAL)
    with pytest.raises(ValueError, match="x must be"):
        peer(torch.zeros(2, 33, 63), None)
    with pytest.raises(ValueError, match="valid_token_mask"):
        peer(torch.zeros(2, 33, 64), torch.ones(2, 32, dtype=torch.bool))


def test_time_contenders_alternates_order_and_reports():
    calls_seen = []
    contenders = {"a": lambda: calls_seen.append("a"), "b": lambda: calls_seen.append("b")}
    progress = []
    result = time_contenders(contenders, warmup=2, rounds=3, calls=4, device="cpu",
                             progress=lambda done, total: progress.append((done, total)))
    warmup, timed = calls_seen[:4], calls_seen[4:]
    assert warmup == ["a", "a", "b", "b"]
    assert timed == ["a"] * 4 + ["b"] * 4 + ["b"] * 4 + ["a"] * 4 + ["a"] * 4 + ["b"] * 4
    assert progress == [(1, 3), (2, 3), (3, 3)]
    for stats in result.values():
        assert stats["calls"] == 12
        assert 0 <= stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"] < 100


def test_time_contenders_tells_slow_from_fast():
    def slow():
        sum(range(20000))
    result = time_contenders({"fast": lambda: None, "slow": slow}, warmup=1, rounds=2, calls=5,
                             device="cpu")
    assert result["slow"]["median_ms"] > result["fast"]["median_ms"]


def test_host_overhead_of_a_no_op():
    assert 0 <= interleaved_host_overhead_us({"no_op": lambda: None}, 20)["no_op"]["median_us"] < 1000


def test_loop_host_us_is_the_host_time_per_call_of_a_loop():
    counted = []
    result = loop_host_us(lambda: (counted.append(1), time.sleep(0.001)), calls=4, rounds=3, warmup=2)
    assert len(counted) == 2 + 4 * 3
    assert 1000 <= result["p10_us"] <= result["median_us"] <= result["p90_us"] < 50_000


def test_interleaved_host_overhead_us_takes_turns():
    order = []
    contenders = {"fast": lambda: order.append("fast"),
                  "slow": lambda: (order.append("slow"), time.sleep(0.002))}
    result = interleaved_host_overhead_us(contenders, 6, warmup=1)
    assert set(result) == {"fast", "slow"}
    timed = order[2:]                                    # after one warm-up call each
    assert len(timed) == 12 and timed.count("fast") == 6
    assert all({timed[2 * i], timed[2 * i + 1]} == {"fast", "slow"} for i in range(6))   # one of each per turn
    assert len({tuple(timed[2 * i:2 * i + 2]) for i in range(6)}) == 2   # both orders occur (seeded shuffle)
    assert result["slow"]["median_us"] > result["fast"]["median_us"] + 1000


def test_mask_reads_once_per_tensor_and_version():
    """The training peer's all-valid test reads a mask on the host once, again only after an in-place
    write (its version moves) or for another tensor."""
    from bench.torch_peer import VersionedRead
    reads = VersionedRead(lambda mask: bool(mask.all()))
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert reads(mask) and reads(mask) and reads.reads == 1
    mask[1, 4] = False
    assert not reads(mask) and reads.reads == 2
    assert reads(torch.ones(2, 5, dtype=torch.bool)) and reads.reads == 3
    with torch.inference_mode():
        frozen = torch.ones(2, 5, dtype=torch.bool)
    assert reads(frozen) and reads(frozen) and reads.reads == 5   # no version: every call


def test_training_peer_reads_a_fixed_mask_once():
    """bench.train's peer takes SDPA's mask-free path for an all-True mask without a host read per step,
    and the masked path after the mask is written, with the baseline's outputs either way."""
    from bench import train
    from bench.baseline import BaselineTransformer, TransformerConfig
    torch.manual_seed(0)
    baseline = BaselineTransformer(TransformerConfig(batch_size=2, seq_len=6, d_model=16, num_heads=2,
                                                     ffn_dim=16, num_layers=1, causal=False))
    peer = train.peer_model(baseline, torch.device("cpu"), "bfloat16")
    x, mask = torch.randn(2, 6, 16), torch.ones(2, 6, dtype=torch.bool)
    for _ in range(3):
        y = peer.forward(x, mask)
    assert peer.mask_reads.reads == 1
    torch.testing.assert_close(y, baseline(x, mask), atol=0.1, rtol=0.05)
    mask[1, 3:] = False
    y = peer.forward(x, mask)
    assert peer.mask_reads.reads == 2
    want = baseline(x, mask)
    torch.testing.assert_close(y[mask], want[mask], atol=0.1, rtol=0.05)
