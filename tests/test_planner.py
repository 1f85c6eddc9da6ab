"""The planner is a pure function: same facts, same plan; each rule tested by the facts that trigger it."""

import dataclasses

import pytest

import ttj_jax as T
from ttj_jax.masks import MaskKind
from ttj_jax.planner import CPU, activation_bytes_per_sequence

H200 = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30)
SHAPE_1 = T.OFFICIAL["1"].config
SHAPE_14 = T.OFFICIAL["14"].config


def facts(config, mask=MaskKind.ALL_TRUE, dtype="float32"):
    return T.InputFacts(config.batch_size, config.seq_len, dtype, mask)


def test_pure_and_explained():
    a = T.plan(SHAPE_1, facts(SHAPE_1), H200)
    assert a == T.plan(SHAPE_1, facts(SHAPE_1), H200)
    line = a.explain()
    assert "\n" not in line and line.startswith(a.name) and "mixed_fp16" in line
    # the default policy's known limit, and what to run instead, in the plan's own words
    assert "0.25 and below" in line and "mixed_fp16x3" in line and "TTJ_POLICY" in line


def test_non_causal_mask_free_calls_take_cudnn_and_causal_ones_keep_our_kernel():
    """Our kernel's lead over cuDNN below S=1024 was measured on causal calls (every official shape is
    causal); without causal masking cuDNN was faster (vit-s197, bert-base). Each reason says which."""
    for S in (77, 197, 512, 1024):
        encoder = T.Config(8, S, 768, 12, 3072, 2, False)
        plan = T.plan(encoder, facts(encoder), H200)
        assert (plan.attention, plan.stack) == ("cudnn", "layers") and "not causal" in plan.explain()
        decoder = dataclasses.replace(encoder, causal=True)
        plan = T.plan(decoder, facts(decoder), H200)
        assert plan.attention == "pallas" and "on causal calls up to S=1024" in plan.explain()
        for kind in (MaskKind.GENERAL, MaskKind.UNKNOWN):   # a key mask: our kernel, said so
            plan = T.plan(encoder, facts(encoder, kind), H200)
            assert plan.attention == "pallas" and "key mask or head_dim" in plan.explain()
    wide = T.Config(8, 512, 2048, 8, 2048, 1, False)           # head_dim 256: cuDNN does not take it
    assert T.plan(wide, facts(wide), H200).attention == "pallas"
    for shape in T.OFFICIAL.values():                          # causal, all of them: no official plan moves
        assert shape.config.causal


def test_no_cudnn_attention_before_sm_80():
    """cuDNN's fused attention needs sm_80 or newer: a Turing GPU (a T4, sm_75) gets our kernel in the
    rules and no cuDNN candidate, where an A100 (sm_80) gets both."""
    from ttj_jax import planner
    t4 = T.DeviceFacts(platform="gpu", device_kind="Tesla T4", memory_bytes=15 * 2**30, compute_capability="7.5")
    a100 = dataclasses.replace(t4, device_kind="NVIDIA A100", memory_bytes=40 * 2**30, compute_capability="8.0")
    assert not t4.takes_cudnn_attention and a100.takes_cudnn_attention and H200.takes_cudnn_attention
    assert not planner.CPU.takes_cudnn_attention
    encoder = T.Config(8, 512, 768, 12, 3072, 2, False)
    long = SHAPE_14.with_input(1, 8192)
    for config in (encoder, long):
        for kind in (MaskKind.ALL_TRUE, MaskKind.UNKNOWN):
            assert all(p.attention != "cudnn" for p in planner.candidates(config, facts(config, kind), t4))
        plan = T.plan(config, facts(config), t4)
        assert plan.attention == "pallas" and "sm_80 or newer" in plan.explain()
        assert T.plan(config, facts(config), a100).attention == "cudnn"


@pytest.mark.parametrize("kind, causal, mode", [
    (MaskKind.NONE, True, "none"), (MaskKind.ALL_TRUE, True, "none"), (MaskKind.ALL_TRUE, False, "none"),
    (MaskKind.PREFIX, True, "rows"), (MaskKind.PREFIX, False, "keys"),
    (MaskKind.GENERAL, True, "keys"), (MaskKind.UNKNOWN, True, "device"),
])
def test_mask_work_follows_the_mask_kind(kind, causal, mode):
    config = T.Config(2, 16, 32, 2, 32, 1, causal)
    assert T.plan(config, facts(config, kind)).mask_mode == mode


def test_attention_choice():
    assert T.plan(SHAPE_1, facts(SHAPE_1), CPU).attention == "xla"
    assert T.plan(SHAPE_1, facts(SHAPE_1), H200).attention == "pallas"         # S=128: measured fastest
    shape_13 = T.OFFICIAL["13"].config
    assert T.plan(shape_13, facts(shape_13), H200).attention == "pallas"       # S=1024, head_dim 32
    assert T.plan(SHAPE_14, facts(SHAPE_14), H200).attention == "cudnn"       # S=100000, head_dim 64
    hopper = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30,
                           compute_capability="9.0")
    plan = T.plan(SHAPE_14, facts(SHAPE_14), hopper)                          # our Hopper kernel there
    assert plan.attention == "pallas" and "Hopper" in plan.explain()
    split = T.plan(SHAPE_14, facts(SHAPE_14), hopper, data_parallel=2)      # in a split too (per device)
    assert split.attention == "pallas" and split.data_parallel == 2 and "Hopper" in split.explain()
    from ttj_jax.layers import ATTENTION, attention_for
    long_256 = T.OFFICIAL["8"].config.with_input(2, 8192)
    assert attention_for(T.plan(long_256, facts(long_256), hopper, data_parallel=2)) is ATTENTION["pallas"]
    assert T.plan(SHAPE_14, facts(SHAPE_14, MaskKind.GENERAL), H200).attention == "pallas"   # key mask
    long_256 = T.OFFICIAL["8"].config.with_input(2, 8192)
    assert T.plan(long_256, facts(long_256), H200).attention == "pallas"       # head_dim 256
    assert T.plan(SHAPE_14, facts(SHAPE_14), H200, policy="exact_fp32").attention == "xla"
    assert T.plan(SHAPE_1, facts(SHAPE_1), H200, attention="cudnn").attention == "cudnn"
    # head_dim 32 (shape 13's heads) on Hopper: our Hopper kernel from S=8192 (measured there), cuDNN below
    long_32 = shape_13.with_input(4, 8192)
    plan = T.plan(long_32, facts(long_32), hopper)
    assert plan.attention == "pallas" and "Hopper" in plan.explain()
    shorter_32 = shape_13.with_input(4, 4096)
    assert T.plan(shorter_32, facts(shorter_32), hopper).attention == "cudnn"
    assert T.plan(shape_13, facts(shape_13), hopper).attention == "pallas"     # S=1024: the generic kernel


def test_batch_chunks_are_divisors_that_fit():
    plan = T.plan(SHAPE_14, facts(SHAPE_14), H200)
    assert plan.batch_chunk and SHAPE_14.batch_size % plan.batch_chunk == 0
    per_sequence = activation_bytes_per_sequence(SHAPE_14, SHAPE_14.seq_len, plan.attention)
    assert plan.batch_chunk * per_sequence <= 0.25 * H200.memory_bytes
    assert "batch chunks" in plan.explain()
    assert T.plan(SHAPE_1, facts(SHAPE_1), H200).batch_chunk is None
    assert T.plan(SHAPE_14, facts(SHAPE_14), CPU).batch_chunk is None          # memory unknown


def test_gemm_bound_calls_take_fp16_qkv_and_cublas():
    """Shape 8 (d_model 1024, S=128) on a GPU: the mixed_fp16_gemm16_tanh policy (fp16 q/k/v and MLP
    pre-activation, tanh GELU) and XLA's Triton GEMMs off (both measured); not on the CPU, not for short-d
    shapes, long sequences, chunked calls or a requested policy."""
    from ttj_jax.planner import GEMM_BOUND_POLICY, GEMM_BOUND_XLA_OPTIONS
    shape_8 = T.OFFICIAL["8"].config
    plan = T.plan(shape_8, facts(shape_8), H200)
    assert plan.policy == GEMM_BOUND_POLICY == "mixed_fp16_gemm16_tanh" and plan.stack == "layers"
    assert plan.xla_options == GEMM_BOUND_XLA_OPTIONS and "GEMM-bound" in plan.explain()
    assert plan.name.endswith("/xla-options")
    masked = T.plan(shape_8, facts(shape_8, MaskKind.GENERAL), H200)   # masks change nothing here
    assert masked.policy == GEMM_BOUND_POLICY and masked.mask_mode == "keys"
    assert T.plan(shape_8, facts(shape_8), CPU).xla_options == ()
    assert T.plan(shape_8, facts(shape_8), H200, policy="mixed_fp16").xla_options == ()
    assert T.plan(SHAPE_1, facts(SHAPE_1), H200).xla_options == ()
    chunked = T.plan(SHAPE_14, facts(SHAPE_14), H200)                  # d 1024 but S=100000, chunked
    assert chunked.policy == "mixed_fp16" and chunked.xla_options == ()
    long_seq = shape_8.with_input(2, 8192)
    assert T.plan(long_seq, facts(long_seq), H200).xla_options == ()


def test_invalid_plans_are_refused():
    with pytest.raises(ValueError, match="xla_options"):
        T.Plan(policy="mixed_fp16", attention="xla", mask_mode="none", xla_options=("a", 1))
    with pytest.raises(ValueError, match="xla_options"):
        T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="none", stack="fused",
               xla_options=(("a", 1),))
    with pytest.raises(ValueError, match="policy"):
        T.Plan(policy="bf16", attention="xla", mask_mode="none")
    with pytest.raises(ValueError, match="attention"):
        T.Plan(policy="mixed_fp16", attention="magic", mask_mode="none")
    with pytest.raises(ValueError, match="mask_mode"):
        T.Plan(policy="mixed_fp16", attention="xla", mask_mode="some")


def test_device_facts_read_the_compute_capability():
    import jax

    from ttj_jax.planner import device_facts
    facts_cpu = device_facts(jax.devices("cpu")[0])
    assert facts_cpu.platform == "cpu" and not facts_cpu.is_hopper
    assert T.DeviceFacts(platform="gpu", compute_capability="9.0").is_hopper
    assert not T.DeviceFacts(platform="gpu", compute_capability="8.0").is_hopper


def test_a_long_single_sequence_from_jax_is_split_over_two_gpus_as_a_ring():
    two = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30,
                        compute_capability="9.0", device_count=2)
    long = SHAPE_14.with_input(1, 100_000)
    ring = T.plan(long, facts(long), two)
    assert ring.sequence_parallel == 2 and ring.attention == "pallas" and ring.batch_chunk is None
    assert ring.name.endswith("/ring-x2-devices") and "ring of k/v blocks" in ring.explain()
    assert "one device" not in ring.explain()   # the batch split's "stays on one device" does not apply
    assert T.plan(long.with_input(1, 1_000_000), facts(long.with_input(1, 1_000_000)), two).sequence_parallel == 2
    one = dataclasses.replace(two, device_count=1)
    # not: one GPU, the bridge (torch), a batch of two, a shorter sequence (measured slower at 16384),
    # a key mask, a length that does not split into 4 zigzag chunks, a forced attention
    for config, inputs, device in (
            (long, facts(long), one),
            (long, dataclasses.replace(facts(long), caller="torch"), two),
            (long.with_input(2, 100_000), facts(long.with_input(2, 100_000)), two),
            (long.with_input(1, 16_384), facts(long.with_input(1, 16_384)), two),
            (long, facts(long, MaskKind.GENERAL), two),
            (long.with_input(1, 100_002), facts(long.with_input(1, 100_002)), two)):
        assert T.plan(config, inputs, device).sequence_parallel == 1, (config, inputs, device)
    assert T.plan(long, facts(long), two, attention="cudnn").sequence_parallel == 1
    assert "measured mask-free only" in T.plan(long, facts(long, MaskKind.GENERAL), two).explain()
    with pytest.raises(ValueError, match="multiple of 2"):
        T.plan(long.with_input(1, 100_002), facts(long.with_input(1, 100_002)), two, sequence_parallel=2)
    with pytest.raises(ValueError, match="no batch split"):
        T.plan(long, facts(long), two, sequence_parallel=2, data_parallel=1, stack="rows")
    with pytest.raises(ValueError, match="sequence_parallel"):
        T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="none", sequence_parallel=2, data_parallel=2)


def test_the_triton_whole_stack_kernel_is_planned_only_up_to_the_lengths_it_was_measured_at():
    a100 = T.DeviceFacts(platform="gpu", device_kind="NVIDIA A100", memory_bytes=80 * 2**30, compute_capability="8.0")
    at_128 = SHAPE_1.with_input(16, 128)
    assert T.plan(at_128, facts(at_128), a100).stack == "fused"
    at_256 = dataclasses.replace(SHAPE_1.with_input(16, 256), num_layers=8)
    plan = T.plan(at_256, facts(at_256), a100)
    assert plan.stack == "layers"
    # the measured planner still has it to time
    assert "fused" in {p.stack for p in T.planner.candidates(at_256, facts(at_256), a100)}


def test_deep_models_get_their_xla_program_alternatives_scanned_over_the_layers():
    """From SCAN_MIN_LAYERS layers the measured planner's XLA-program alternatives are lax.scan programs
    (one layer to compile), the rules' plan first and unrolled, its scanned twin beside it; then the
    unrolled twins of the scanned cuBLAS plans, cuDNN's first (what a call would run, measured where they
    compile in time: the long compiles queued early). A key-masked call at head_dim 128, which cuDNN's
    plans do not take, still gets unrolled cuBLAS twins (our attention's, XLA's)."""
    from ttj_jax.planner import (
        GEMM_BOUND_POLICY,
        MAX_SCANNED_CANDIDATES,
        PEER_NUMERICS_POLICY,
        SCAN_MIN_LAYERS,
        UNROLLED_TWINS_AT_DEPTH,
        candidates,
    )
    deep = T.Config(batch_size=8, seq_len=512, d_model=256, num_heads=2, ffn_dim=768, num_layers=SCAN_MIN_LAYERS + 2,
                    causal=True)
    for mask in (MaskKind.ALL_TRUE, MaskKind.UNKNOWN):
        found = candidates(deep, facts(deep, mask), H200)
        assert not found[0].scan_layers and found[0] == T.plan(deep, facts(deep, mask), H200)
        assert found[1] == dataclasses.replace(found[0], scan_layers=True) and "/scan" in found[1].name
        twins = found[2:2 + UNROLLED_TWINS_AT_DEPTH]
        assert all(not p.scan_layers and p.xla_options and "lax.scan" not in p.reason for p in twins)
        assert all(dataclasses.replace(p, scan_layers=True) in found for p in twins)
        scanned_cublas = [p for p in found if p.scan_layers and p.xla_options]
        cudnn_first = ([p for p in scanned_cublas if p.attention == "cudnn"]
                       + [p for p in scanned_cublas if p.attention != "cudnn"])
        assert twins == [dataclasses.replace(p, scan_layers=False, reason=t.reason)
                         for p, t in zip(cudnn_first, twins)]
        if mask == MaskKind.ALL_TRUE:
            assert all(p.attention == "cudnn" and p.policy == GEMM_BOUND_POLICY for p in twins[:2])
        else:   # no cuDNN plan: our attention's GEMM-bound and peer-numerics programs, unrolled
            assert not any(p.attention == "cudnn" for p in found)
            assert [(p.attention, p.policy) for p in twins[:2]] == [("pallas", GEMM_BOUND_POLICY),
                                                                   ("pallas", PEER_NUMERICS_POLICY)]
        scanned_part = found[1:2] + found[2 + UNROLLED_TWINS_AT_DEPTH:]
        assert all(p.scan_layers for p in scanned_part if p.stack == "layers")
        assert len(found) <= MAX_SCANNED_CANDIDATES + UNROLLED_TWINS_AT_DEPTH
        assert len({(p.name, p.xla_options) for p in found}) == len(found)
    shallow = dataclasses.replace(deep, num_layers=4)
    assert not any(p.scan_layers for p in candidates(shallow, facts(shallow), H200))
    with pytest.raises(ValueError, match="scan_layers"):
        dataclasses.replace(found[0], stack="rows", policy="mixed_fp16", xla_options=(), scan_layers=True)


@pytest.mark.parametrize("policy", ["exact_fp32", "tf32"])
def test_fp32_operand_policies_run_xla_attention_and_the_layer_program(policy):
    """Our attention kernels, cuDNN's and the fused stacks take fp16 operands: a policy with fp32 GEMM
    operands gets XLA's attention in the layer-by-layer program, on any GPU."""
    inputs = T.InputFacts(batch_size=64, seq_len=128, dtype="float32", mask_kind=T.MaskKind.ALL_TRUE, caller="torch")
    for facts in (T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30,
                                compute_capability="9.0"),
                  T.DeviceFacts(platform="gpu", device_kind="NVIDIA A100", memory_bytes=40 * 2**30,
                                compute_capability="8.0")):
        chosen = T.plan(T.OFFICIAL["2"].config, inputs, facts, policy=policy)
        assert (chosen.attention, chosen.stack, chosen.policy) == ("xla", "layers", policy)


@pytest.mark.parametrize("kind", [MaskKind.GENERAL, MaskKind.UNKNOWN])
def test_the_mosaic_kernels_masked_build_is_planned_for_key_masks_only_once_switched_on(monkeypatch, kind):
    """MGPU_STACK_MASKED_PLANNED: off, a torch call whose mask needs keys masked never gets the Mosaic
    kernel (rules or candidates); on, it gets the masked build where the mask-free call gets the kernel,
    at the sequence lengths where the build has run on a GPU, and the measured planner may time it; a JAX
    caller (no bridge launch) never does."""
    from ttj_jax import planner
    hopper = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30,
                           compute_capability="9.0")
    monkeypatch.setattr(planner, "MGPU_STACK_MASKED_VERIFIED", ((128, 4, 128, True), (32, 4, 128, True), (128, 4, 32, True)))
    for sid in ("2", "7", "12"):
        config = T.OFFICIAL[sid].config
        torch_facts = T.InputFacts(config.batch_size, config.seq_len, "float32", mask_kind=kind, caller="torch")
        mask_free = T.InputFacts(config.batch_size, config.seq_len, "float32", mask_kind=MaskKind.ALL_TRUE,
                                 caller="torch")
        assert T.plan(config, mask_free, hopper).stack == "fused_mgpu"
        monkeypatch.setattr(planner, "MGPU_STACK_MASKED_PLANNED", False)
        off = T.plan(config, torch_facts, hopper)
        assert off.stack != "fused_mgpu" and off.mask_mode in planner.KEY_MASK_MODES
        assert all(c.stack != "fused_mgpu" for c in planner.candidates(config, torch_facts, hopper))
        monkeypatch.setattr(planner, "MGPU_STACK_MASKED_PLANNED", True)
        on = T.plan(config, torch_facts, hopper)
        assert (on.stack, on.mask_mode) == ("fused_mgpu", off.mask_mode), on.explain()
        assert "masked build" in on.explain()
        assert any(c.stack == "fused_mgpu" for c in planner.candidates(config, torch_facts, hopper))
        jax_facts = dataclasses.replace(torch_facts, caller="jax")
        assert T.plan(config, jax_facts, hopper).stack != "fused_mgpu"


def test_the_masked_build_is_not_planned_in_a_build_that_has_not_run_on_a_gpu(monkeypatch):
    from ttj_jax import planner
    hopper = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30,
                           compute_capability="9.0")
    config = T.OFFICIAL["12"].config   # S=32
    facts_ = T.InputFacts(config.batch_size, config.seq_len, "float32", mask_kind=MaskKind.UNKNOWN, caller="torch")
    monkeypatch.setattr(planner, "MGPU_STACK_MASKED_PLANNED", True)
    monkeypatch.setattr(planner, "MGPU_STACK_MASKED_VERIFIED", ((128, 4, 128, True),))
    assert T.plan(config, facts_, hopper).stack != "fused_mgpu"
    assert all(c.stack != "fused_mgpu" for c in planner.candidates(config, facts_, hopper))
    shape_9 = T.OFFICIAL["9"].config   # S=128 but one head: another build
    facts_9 = dataclasses.replace(facts_, batch_size=shape_9.batch_size, seq_len=shape_9.seq_len)
    assert T.plan(shape_9, facts_9, hopper).stack != "fused_mgpu"
    shape_1 = T.OFFICIAL["1"].config   # shape 2's build at batch 64
    facts_1 = dataclasses.replace(facts_, batch_size=shape_1.batch_size, seq_len=shape_1.seq_len)
    assert T.plan(shape_1, facts_1, hopper).stack == "fused_mgpu"


def test_every_official_shape_on_the_mosaic_kernel_has_its_masked_build_verified():
    """As shipped: the official shapes the Mosaic kernel runs without a mask (1-5, 7, 9, 10, 12) run its
    masked build for a torch call with a mask the device decides about (the harness's inference-tensor
    masks), since each of their builds has run on a GPU with a mask with holes."""
    hopper = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30,
                           compute_capability="9.0")
    for sid in ("1", "2", "3", "4", "5", "7", "9", "10", "12"):
        config = T.OFFICIAL[sid].config
        mask_free = T.InputFacts(config.batch_size, config.seq_len, "float32", mask_kind=MaskKind.ALL_TRUE,
                                 caller="torch")
        assert T.plan(config, mask_free, hopper).stack == "fused_mgpu", sid
        device_decides = dataclasses.replace(mask_free, mask_kind=MaskKind.UNKNOWN)
        chosen = T.plan(config, device_decides, hopper)
        assert chosen.stack == "fused_mgpu" and chosen.mask_mode in T.planner.KEY_MASK_MODES, (sid, chosen.explain())
