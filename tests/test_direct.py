"""The fused-stack plan end to end on the CPU: the planner's rule, the kernel's Triton IR for a direct
launch, and the bridge's direct-launch plumbing with the launch itself replaced by the same kernel run in
interpret mode (the CPU twin). The real launch (Triton compiling that IR for the GPU, launched on torch's
stream) is checked on the H200 by `python -m bench.direct_check`, against the harness's baseline."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import bridge
import ttj_jax as T
from bench.baseline import check_close, harness_models, make_inputs
from bridge import direct, runtime
from ttj_jax.kernels.fused_stack import (FusedWeights, StackBlocks, copy_free, direct_launch,
                                         fused_stack_forward, stack_weights)
from ttj_jax.masks import MaskKind
from ttj_jax.planner import FUSED_STACK_MAX_ROWS

H200 = T.DeviceFacts(platform="gpu", device_kind="NVIDIA H200", memory_bytes=100 * 2**30)
SMALL = T.Config(2, 32, 64, 4, 64, 2, True)


def facts(config, mask=MaskKind.ALL_TRUE, batch=None):
    return T.InputFacts(batch or config.batch_size, config.seq_len, "float32", mask)


@pytest.mark.parametrize("sid", ["1", "2", "3", "4", "5", "6", "7", "9", "10", "12"])
def test_planner_fuses_short_mask_free_calls_on_the_gpu(sid):
    config = T.OFFICIAL[sid].config
    plan = T.plan(config, facts(config), H200)
    assert plan.stack == "fused" and plan.name.startswith("fused-stack/")
    assert "fused whole-stack kernel" in plan.explain()


def test_planner_keeps_the_xla_program_elsewhere():
    shape_2 = T.OFFICIAL["2"].config
    assert T.plan(shape_2, facts(shape_2)).stack == "layers"                                   # CPU
    for kind in (MaskKind.PREFIX, MaskKind.GENERAL, MaskKind.UNKNOWN):   # the kernel masks (GPU-checked)
        plan = T.plan(shape_2, facts(shape_2, kind), H200)
        assert plan.stack == "fused" and plan.mask_mode != "none"
    assert T.plan(shape_2, facts(shape_2), H200, policy="exact_fp32").stack == "layers"
    assert T.plan(shape_2, facts(shape_2), H200, attention="xla").stack == "layers"             # forced
    for sid in ("8", "14"):   # d_model 1024; S and d beyond both kernels
        config = T.OFFICIAL[sid].config
        assert T.plan(config, facts(config), H200).stack == "layers"
    shape_11 = T.OFFICIAL["11"].config   # 16 heads: the fused kernel measured slower, the rows stack faster
    plan_11 = T.plan(shape_11, facts(shape_11), H200)
    assert plan_11.stack == "rows" and "16 heads" in plan_11.explain()
    from_torch = T.InputFacts(shape_11.batch_size, shape_11.seq_len, "float32", MaskKind.ALL_TRUE, caller="torch")
    assert T.plan(shape_11, from_torch, H200).stack == "rows"     # the bridge too (padded heads, measured)
    odd = T.Config(1, 100, 128, 16, 128, 1, True)   # 100 rows: not whole row tiles of ROWS_BLOCK
    assert T.plan(odd, facts(odd), H200).stack == "layers"
    rows_over = FUSED_STACK_MAX_ROWS // shape_2.seq_len + 1
    assert T.plan(shape_2, facts(shape_2, batch=rows_over), H200).stack == "layers"
    assert T.plan(shape_2, facts(shape_2), H200, stack="layers").stack == "layers"


def test_fused_plans_are_mixed_one_device_unchunked():
    T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="keys", stack="fused")            # masks: fine
    with pytest.raises(ValueError, match="fused"):
        T.Plan(policy="exact_fp32", attention="xla", mask_mode="none", stack="fused")
    with pytest.raises(ValueError, match="fused"):
        T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="none", stack="fused", batch_chunk=2)
    with pytest.raises(ValueError, match="stack"):
        T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="none", stack="other")


def _structs(config):
    params = jax.eval_shape(lambda: T.init_params(jax.random.key(0), config))
    return jax.eval_shape(lambda p: stack_weights(T.prepare_weights(p, T.MIXED_FP16),
                                                  num_heads=config.num_heads), params)


def test_direct_launch_ir_has_the_documented_arguments():
    weights = _structs(SMALL)
    spec = direct_launch(weights, (6, 32, 64), "float32", causal=True, blocks=StackBlocks(num_warps=4))
    assert spec.grid == (6, 1, 1) and spec.num_warps == 4 and spec.num_stages == 1
    signature = re.search(r"tt\.func public @\w+\((.*?)\)\s*(attributes.*)?\{", spec.ttir).group(1)
    kinds = re.findall(r"!tt\.ptr<(\w+)>", signature)
    expected = ["f32"] + ["f16" if weights.arrays[n].dtype == jnp.float16 else "f32"
                          for n in FusedWeights.FIELDS] + ["f32"]
    assert kinds == expected                                   # x, the 14 weights in FIELDS order, y
    packed = direct_launch(weights, (8, 32, 64), "float32", causal=True, blocks=StackBlocks(block_sequences=4))
    assert packed.grid == (2, 1, 1)


def test_direct_launch_refuses_shapes_that_need_padding():
    assert copy_free((3, 32, 64), 64) and not copy_free((3, 20, 64), 64) and not copy_free((3, 32, 64), 48)
    assert not copy_free((3, 32, 64), 64, block_sequences=2)
    with pytest.raises(ValueError, match="padding"):
        direct_launch(_structs(SMALL), (2, 20, 64), "float32", causal=True)


class InterpretedKernel:
    """Stands in for bridge.direct.DirectKernel on the CPU: runs the same Pallas kernel (interpret mode)
    on the tensors it is handed, in DirectLaunch's argument order, and writes the output in place."""
    instances = []

    def __init__(self, spec, device):
        self.spec, self.calls = spec, 0
        InterpretedKernel.instances.append(self)

    def __call__(self, x, *tensors):
        assert 1 + len(tensors) == self.spec.argument_count
        mask = None
        if self.spec.masked:   # the direct launch hands the bool mask's bytes; the kernel reads int8
            mask, *tensors = tensors
            mask = jnp.asarray(mask.numpy().view(np.int8))
        *weights, out = tensors
        fused = FusedWeights({n: jnp.asarray(t.numpy()) for n, t in zip(FusedWeights.FIELDS, weights)},
                             d_model=x.shape[-1], num_heads=SMALL.num_heads, ffn_dim=SMALL.ffn_dim)
        y = fused_stack_forward(fused, jnp.asarray(x.numpy()), mask, num_heads=SMALL.num_heads, causal=True,
                                interpret=True)
        out.copy_(torch.from_numpy(np.array(y)))
        self.calls += 1


def test_bridge_direct_path_plumbing(monkeypatch):
    monkeypatch.setattr(direct, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(direct, "DirectKernel", InterpretedKernel)
    InterpretedKernel.instances.clear()
    base, ours = harness_models(SMALL, bridge.TTJTransformer)
    x, mask = make_inputs(SMALL, 7)
    x_before = x.clone()
    with torch.no_grad():
        y = runtime.forward(ours, x, mask, stack="fused")
        y_again = runtime.forward(ours, x, mask, stack="fused")
        layers = runtime.forward(ours, x, mask, stack="layers")
        ref = base(x, mask)
    [kernel] = InterpretedKernel.instances            # built once per input signature
    assert kernel.calls == 1 + 2                      # its check against the jax path, then the two calls
    assert torch.equal(x, x_before) and y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y, y_again)
    assert check_close(y, ref)[0] == 0
    assert check_close(y, layers)[0] == 0
    # a weight edit is seen: the fused weights are rebuilt from the new parameters
    with torch.no_grad():
        ours.final_norm.bias.add_(0.5)
        base.final_norm.bias.add_(0.5)
        y2 = runtime.forward(ours, x, mask, stack="fused")
        assert check_close(y2, base(x, mask))[0] == 0


class WrongKernel(InterpretedKernel):
    """A launch that writes the wrong thing (as a bad parameter order or binary would)."""

    def __call__(self, x, *tensors):
        super().__call__(x, *tensors)
        tensors[-1].mul_(1.01)


def test_bridge_direct_path_with_masks(monkeypatch):
    monkeypatch.setattr(direct, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(direct, "DirectKernel", InterpretedKernel)
    base, ours = harness_models(SMALL, bridge.TTJTransformer)
    x, _ = make_inputs(SMALL, 9)
    general = torch.rand(SMALL.batch_size, SMALL.seq_len, generator=torch.Generator().manual_seed(1)) < 0.6
    general[1] = False
    _, prefix = make_inputs(SMALL, 10, padding_ratio=0.5)
    with torch.no_grad():
        for mask in (general, prefix):
            InterpretedKernel.instances.clear()
            y = runtime.forward(ours, x, mask, stack="fused")
            ref = base(x, mask)
            assert [k.spec.masked for k in InterpretedKernel.instances] == [True]
            assert check_close(y, ref)[0] == 0 and (y[~mask] == 0).all()
        with torch.inference_mode():   # an inference-mode mask (unclassified) takes the fused plan too
            mask = general.clone()
            InterpretedKernel.instances.clear()
            assert check_close(runtime.forward(ours, x, mask, stack="fused"), base(x, mask))[0] == 0
            assert InterpretedKernel.instances and InterpretedKernel.instances[0].spec.masked


def test_bridge_refuses_a_direct_launch_that_disagrees_with_jax(monkeypatch):
    monkeypatch.setattr(direct, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(direct, "DirectKernel", WrongKernel)
    base, ours = harness_models(SMALL, bridge.TTJTransformer)
    x, mask = make_inputs(SMALL, 8)
    with torch.no_grad():
        y = runtime.forward(ours, x, mask, stack="fused")
        assert check_close(y, base(x, mask))[0] == 0          # served by the jax path instead
    call = runtime._STATES[ours].calls[(x.shape, x.dtype, x.device, MaskKind.ALL_TRUE, None, "fused")]
    assert call.direct is None and "differed from the jax path" in call.direct_note


def test_bridge_explains_why_the_fused_plan_runs_through_jax_on_the_cpu():
    base, ours = harness_models(SMALL, bridge.TTJTransformer)
    x, mask = make_inputs(SMALL, 3)
    with torch.no_grad():
        y = runtime.forward(ours, x, mask, stack="fused")   # CPU: the same kernel, interpreted, via jax
        assert check_close(y, base(x, mask))[0] == 0
    call = runtime._STATES[ours].calls[(x.shape, x.dtype, x.device, MaskKind.ALL_TRUE, None, "fused")]
    assert call.direct is None and "CUDA" in call.direct_note


def test_jax_forward_runs_the_fused_plan():
    params = T.init_params(jax.random.key(1), SMALL)
    x = jax.random.normal(jax.random.key(2), (SMALL.batch_size, SMALL.seq_len, SMALL.d_model))
    prepared = T.prepare_weights(params, T.MIXED_FP16)
    fused = T.forward(prepared, x, config=SMALL, stack="fused")
    raw = T.forward(params, x, config=SMALL, stack="fused")
    ref = T.reference(params, x, config=SMALL)
    assert check_close(torch.from_numpy(np.array(fused)), torch.from_numpy(np.array(ref)))[0] == 0
    np.testing.assert_allclose(np.asarray(fused), np.asarray(raw), atol=1e-5)


def test_entry_parameters_reads_the_ptx_signature():
    ptx = """.version 8.4
.target sm_90a
.visible .entry ttj_fused_stack(
	.param .u64 .ptr .global .align 1 ttj_fused_stack_param_0,
	.param .u64 .ptr .global .align 1 ttj_fused_stack_param_1,
	.param .u64 .ptr .global .align 1 ttj_fused_stack_param_2
)
.reqntid 256, 1, 1
{
	ret;
}"""
    assert direct.entry_parameters(ptx, "ttj_fused_stack") == [".u64"] * 3
    with pytest.raises(ValueError, match="no .entry"):
        direct.entry_parameters(ptx, "other")


def test_gpu_images_are_cut_from_length_delimited_fields():
    from ttj_jax.compat import find_gpu_images
    ptx = b"//\n// Generated by LLVM NVPTX Back-End\n//\n.version 8.4\n.visible .entry k(\n)\n{\n\tret;\n}\n"
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    header[0x12:0x14] = (190).to_bytes(2, "little")              # EM_CUDA
    header[0x28:0x30] = (64).to_bytes(8, "little")               # section headers right after the header
    header[0x3A:0x3C], header[0x3C:0x3E] = (64).to_bytes(2, "little"), (2).to_bytes(2, "little")
    elf = bytes(header) + bytes(128)
    blob = b"\x0a\x03abc" + b"\x12" + bytes([len(ptx)]) + ptx + b"\x1a" + bytes([0xC0, 0x01]) + elf + b"\x22\x00"
    images = dict(find_gpu_images(blob))
    assert images["ptx"] == ptx and images["cubin"] == elf
    assert find_gpu_images(b"\x12\x05//\n// Generated by") == []   # a length that runs past the blob


def test_direct_launch_is_unavailable_without_cuda():
    assert "CUDA device" in direct.unavailable_reason(torch.device("cpu"))


def test_direct_launch_is_opt_in_until_checked_on_a_gpu(monkeypatch):
    monkeypatch.delenv("TTJ_DIRECT_LAUNCH", raising=False)
    assert "opt-in" in direct.unavailable_reason(torch.device("cuda", 0))
    monkeypatch.setenv("TTJ_DIRECT_LAUNCH", "1")
    reason = direct.unavailable_reason(torch.device("cuda", 0))
    assert reason is None or "opt-in" not in reason      # past the switch: the machine's own limits


def test_direct_check_reports_a_child_that_wrote_nothing():
    # --isolate runs each shape in its own process; one that dies (here: no CUDA) is an error record.
    import argparse
    from bench import direct_check
    record = direct_check.run_shape_in_child("2", argparse.Namespace(seeds=1, quick=True))
    assert record["error"].startswith("child exited 2") and "needs a CUDA GPU" in record["error"]


class _FakeTritonResult:
    def __init__(self, asm, smem_bytes):
        self.asm, self.smem_bytes = asm, smem_bytes


def test_triton_ptx_uses_the_handler_jaxlib_registers(monkeypatch):
    # On a GPU, jax's CUDA plugin registers XLA's Triton compiler under "CUDA" at backend start (a CPU
    # jax has the registry but no handler); the direct launch compiles the kernel's IR with it.
    from jax._src.lib import triton as jax_triton
    from ttj_jax import compat
    calls = []

    def handler(module_ir, arch, num_warps, num_ctas, num_stages):
        calls.append((module_ir, arch, num_warps, num_ctas, num_stages))
        return _FakeTritonResult(".version 8.4\n.visible .entry k(\n)\n", 1234)

    monkeypatch.setitem(jax_triton._compilation_handlers, "CUDA", handler)
    build = compat.triton_ptx("module {}", "9.0", num_warps=8, num_stages=2)
    assert calls == [(b"module {}", "9.0", 8, 1, 2)]
    assert build.ptx.startswith(b".version") and build.shared_bytes == 1234

    def broken(*args):
        raise ValueError("bad IR")
    monkeypatch.setitem(jax_triton._compilation_handlers, "CUDA", broken)
    with pytest.raises(RuntimeError, match="rejected the kernel: ValueError: bad IR"):
        compat.triton_ptx("module {}", "9.0", num_warps=8, num_stages=1)
    monkeypatch.setitem(jax_triton._compilation_handlers, "CUDA", lambda *a: _FakeTritonResult("no entry", 0))
    with pytest.raises(RuntimeError, match="no PTX entry"):
        compat.triton_ptx("module {}", "9.0", num_warps=8, num_stages=1)


def test_triton_ptx_without_a_handler_says_so(monkeypatch):
    from jax._src.lib import triton as jax_triton
    from ttj_jax import compat
    monkeypatch.delitem(jax_triton._compilation_handlers, "CUDA", raising=False)
    monkeypatch.setattr(jax_triton, "has_compilation_handler", lambda platform: False, raising=False)
    with pytest.raises(RuntimeError, match="no Triton compiler"):
        compat.triton_ptx("module {}", "9.0", num_warps=8, num_stages=1)


def test_kernel_images_try_jaxlibs_triton_build_first(monkeypatch):
    from ttj_jax import compat
    spec = types.SimpleNamespace(ttir="module {}", num_warps=8, num_stages=1, function=None, arg_structs=())
    monkeypatch.setattr(compat, "triton_ptx", lambda *a, **k: compat.TritonBuild(b".entry k(", 999))
    monkeypatch.setattr(compat, "xla_gpu_images", lambda *a: [("ptx", b"x"), ("cubin", b"\x7fELF")])
    images, errors = direct.kernel_images(spec, (9, 0))
    assert images == [("ptx", b".entry k(", 999), ("cubin", b"\x7fELF", None), ("ptx", b"x", None)]
    assert errors == []

    def fails(*a, **k):
        raise RuntimeError("none here")
    monkeypatch.setattr(compat, "triton_ptx", fails)
    monkeypatch.setattr(compat, "xla_gpu_images", lambda *a: [])
    images, errors = direct.kernel_images(spec, (9, 0))
    assert images == [] and "none here" in errors[0] and "holds no cubin" in errors[1]
