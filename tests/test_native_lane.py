"""The native lane (bridge/native/lane.cpp) on the CPU: built with torch's extension builder, given CPU
tensors and a stand-in for jax's host entry (a ctypes callback that records the buffer it is handed and
writes the output), so every check that sends a call back to the Python path is exercised here; the GPU
run is bench/host_parts.py and bench/native_lane_check.py on the H200."""

from __future__ import annotations

import ctypes

import pytest
import torch

from bridge import direct, native, runtime
from bridge.direct import (
    LANE_DEVICE_MASK,
    LANE_INFERENCE_MASK,
    LANE_KEPT_MASK,
    LANE_KEPT_MASK_PASSED,
    LANE_KEPT_MASK_ROWS,
    LANE_NO_MASK,
)

pytestmark = pytest.mark.slow   # the first test in a fresh cache builds the extension (~10-60 s)

B, S, D = 2, 4, 8


@pytest.fixture(scope="module")
def lane_module(tmp_path_factory):
    import os
    old = os.environ.get("TTJ_CACHE_DIR")
    os.environ["TTJ_CACHE_DIR"] = str(tmp_path_factory.mktemp("native-cache"))
    try:
        return native.build()
    finally:
        if old is None:
            os.environ.pop("TTJ_CACHE_DIR")
        else:
            os.environ["TTJ_CACHE_DIR"] = old


class StandIn:
    """jax's host entry, form 3 (entry(function, stream, buffers)) or form 1 (entry(args), args pointing
    at the context, the stream and the buffer's address), reading the kernel's pointers from what it is
    handed as the real entry does: records each call's pointers and writes y = x + 1 + the sum of the
    weights' first elements into the output."""

    def __init__(self, num_buffers: int, form: int = 3):
        self.num_buffers, self.form, self.calls = num_buffers, form, []
        if form == 3:
            self._fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(self._entry3)
            self.args = [77, 0]
        else:
            self._fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._entry1)
            self._context, self._stream = ctypes.c_void_p(77), ctypes.c_void_p(0)
            self.args = [ctypes.addressof(self._context), ctypes.addressof(self._stream)]
        self.entry = ctypes.cast(self._fn, ctypes.c_void_p).value

    def _entry3(self, function, stream, buffers):
        assert function == 77 and not stream
        self._record(buffers)

    def _entry1(self, args):
        array = (ctypes.c_void_p * 3).from_address(args)
        assert array[0] == self.args[0] and array[1] == self.args[1]
        self._record(ctypes.c_void_p.from_address(array[2]).value)

    def _record(self, buffers):
        array = (ctypes.c_void_p * self.num_buffers).from_address(buffers)
        pointers = [array[i] for i in range(self.num_buffers)]
        self.calls.append(pointers)
        self.on_call(pointers)

    def on_call(self, pointers):
        pass


def _tensor_at(pointer: int, like: torch.Tensor) -> torch.Tensor:
    array = (ctypes.c_float * like.numel()).from_address(pointer)
    return torch.frombuffer(array, dtype=torch.float32).view(like.shape)


def make_lane(lane_module, mask_mode=LANE_NO_MASK, kept_mask=None, form=3, params=None, weights=None,
              dtype=torch.float32):
    params = params if params is not None else [torch.randn(D), torch.randn(D, D)]
    weights = weights if weights is not None else [torch.randn(3), torch.randn(5)]
    masked = mask_mode in (LANE_DEVICE_MASK, LANE_INFERENCE_MASK, LANE_KEPT_MASK_PASSED)
    entry = StandIn(2 + len(weights) + masked, form)
    shift = 1.0 + sum(float(w[0]) for w in weights)

    def write(pointers):
        x = _tensor_at(pointers[0], torch.empty(B, S, D))
        _tensor_at(pointers[-1], torch.empty(B, S, D)).copy_(x + shift)
    entry.on_call = write
    lane = lane_module.Lane(sizes=[B, S, D], dtype=dtype, params=params, weights=weights, mask_mode=mask_mode,
                            kept_mask=kept_mask, entry=entry.entry, form=form, entry_args=entry.args,
                            num_buffers=entry.num_buffers, keep_alive=entry)
    return lane, entry, params, weights, shift


@pytest.mark.parametrize("form", [3, 1])
def test_launch_hands_the_entry_every_pointer_in_order(lane_module, form):
    lane, entry, params, weights, shift = make_lane(lane_module, form=form)
    x = torch.randn(B, S, D)
    y = lane.run(x)
    assert y is not None and y.shape == x.shape and y.dtype == torch.float32
    assert entry.calls == [[x.data_ptr(), *(w.data_ptr() for w in weights), y.data_ptr()]]
    torch.testing.assert_close(y, x + shift)
    y2 = lane.run(x)
    assert y2.data_ptr() != y.data_ptr()                  # a new output per call (y is still alive)
    torch.testing.assert_close(y, x + shift)              # the first output is left as it was


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_another_dtype_is_cast_in_and_out(lane_module, dtype):
    lane, entry, params, weights, shift = make_lane(lane_module, dtype=dtype)
    x = torch.randn(B, S, D).to(dtype)
    seen = {}
    write = entry.on_call

    def check(pointers):
        seen["x"] = _tensor_at(pointers[0], torch.empty(B, S, D)).clone()   # the kernel reads float32
        write(pointers)
    entry.on_call = check
    y = lane.run(x)
    assert y is not None and y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(seen["x"], x.float())
    torch.testing.assert_close(y, (x.float() + shift).to(dtype))
    assert lane.run(x.float()) is None   # float32 x is another call


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_kernel_of_the_calls_dtype_gets_x_as_it_is(lane_module, dtype):
    """kernel_dtype: the launch reads and writes x's own dtype (the Mosaic kernel's half builds): the
    entry sees x's own memory and writes the output the call returns, no cast either way."""
    params, weights = [torch.randn(D), torch.randn(D, D)], [torch.randn(3), torch.randn(5)]
    entry = StandIn(2 + len(weights), 3)
    lane = lane_module.Lane(sizes=[B, S, D], dtype=dtype, params=params, weights=weights, mask_mode=LANE_NO_MASK,
                            kept_mask=None, entry=entry.entry, form=3, entry_args=entry.args,
                            num_buffers=entry.num_buffers, keep_alive=entry, kernel_dtype=dtype)
    x = torch.randn(B, S, D).to(dtype)

    def write(pointers):   # y = 2 x, in x's dtype (2-byte elements)
        source = (ctypes.c_uint16 * x.numel()).from_address(pointers[0])
        target = (ctypes.c_uint16 * x.numel()).from_address(pointers[-1])
        torch.frombuffer(target, dtype=dtype).copy_(torch.frombuffer(source, dtype=dtype) * 2)
    entry.on_call = write
    y = lane.run(x)
    assert y is not None and y.dtype == dtype and y.shape == x.shape
    assert entry.calls[0][0] == x.data_ptr() and entry.calls[0][-1] == y.data_ptr()
    torch.testing.assert_close(y, x * 2)
    assert lane.run(x.float()) is None   # float32 x is another call


def test_other_inputs_go_back_to_python(lane_module):
    lane, entry, params, _, _ = make_lane(lane_module)
    x = torch.randn(B, S, D)
    assert lane.run(torch.randn(B, S + 1, D)) is None              # another shape
    assert lane.run(x.double()) is None                             # another dtype
    assert lane.run(torch.randn(B, D, S).transpose(1, 2)) is None   # not contiguous
    assert lane.run(torch.randn(B * S * D + 1)[1:].view(B, S, D)) is None   # contiguous, 4 bytes off alignment
    assert lane.run(x, torch.ones(B, S, dtype=torch.bool)) is None  # a mask where the call had none
    assert lane.run(x, None) is not None
    assert len(entry.calls) == 1


def test_launchable_copies_only_what_the_kernels_cannot_take():
    aligned = torch.randn(B, S, D)
    assert direct.launchable(aligned) is aligned
    for view in (torch.randn(B * S * D + 1)[1:].view(B, S, D), torch.randn(B, D, S).transpose(1, 2)):
        before = view.clone()
        copy = direct.launchable(view)
        assert copy.is_contiguous() and copy.data_ptr() % direct.KERNEL_POINTER_ALIGN == 0
        assert torch.equal(copy, view) and torch.equal(view, before)
    mask = torch.rand(B * S + 1) < 0.5
    copy = direct.launchable(mask[1:].view(B, S))
    assert copy.data_ptr() % direct.KERNEL_POINTER_ALIGN == 0 and torch.equal(copy, mask[1:].view(B, S))


def test_parameter_changes_go_back_to_python(lane_module):
    lane, entry, params, _, _ = make_lane(lane_module)
    x = torch.randn(B, S, D)
    assert lane.run(x) is not None
    with torch.no_grad():
        params[1].mul_(2.0)                 # an in-place write: the version moves
    assert lane.run(x) is None
    lane, entry, params, _, _ = make_lane(lane_module)
    params[0].data = torch.randn(D)         # new memory behind the same tensor: the pointer moves
    assert lane.run(x) is None


def test_a_call_that_records_for_autograd_goes_back_to_python(lane_module):
    params = [torch.randn(D, requires_grad=True), torch.randn(D, D)]
    lane, *_ = make_lane(lane_module, params=params)
    x = torch.randn(B, S, D)
    assert lane.run(x) is None                         # grad mode, a parameter requires grad
    with torch.no_grad():
        assert lane.run(x) is not None
    with torch.inference_mode():
        assert lane.run(x) is not None
    lane, *_ = make_lane(lane_module)
    assert lane.run(x.requires_grad_()) is None        # x requires grad


def test_kept_mask_is_the_same_tensor_at_the_same_version(lane_module):
    mask = torch.ones(B, S, dtype=torch.bool)
    lane, entry, *_ = make_lane(lane_module, LANE_KEPT_MASK, kept_mask=mask)
    x = torch.randn(B, S, D)
    assert lane.run(x, mask) is not None
    assert entry.calls[-1][0] == x.data_ptr() and len(entry.calls[-1]) == 4   # the mask is not handed over
    assert lane.run(x, mask.clone()) is None       # another tensor with the same contents
    assert lane.run(x) is None                     # no mask
    mask[0, 1] = False                             # a write torch sees
    assert lane.run(x, mask) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kept_prefix_mask_zeroes_the_invalid_rows_after_the_kernel(lane_module, dtype):
    mask = torch.arange(S)[None, :] < torch.tensor([S, 2])[:, None]   # a prefix mask: lengths S and 2
    lane, entry, _, _, shift = make_lane(lane_module, LANE_KEPT_MASK_ROWS, kept_mask=mask, dtype=dtype)
    x = torch.randn(B, S, D).to(dtype)
    y = lane.run(x, mask)
    assert y is not None and y.dtype == dtype and len(entry.calls[-1]) == 4   # the kernel takes no mask
    expected = torch.where(mask.unsqueeze(-1), x.float() + shift, 0.0).to(dtype)   # runtime.py's "rows" run
    assert torch.equal(y, expected)
    mask[1, 2] = True
    assert lane.run(x, mask) is None


def test_a_kept_mask_the_launch_reads_is_handed_over_while_it_is_the_same_tensor_at_the_same_version(lane_module):
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 2:] = False
    lane, entry, _, weights, _ = make_lane(lane_module, LANE_KEPT_MASK_PASSED, kept_mask=mask)
    x = torch.randn(B, S, D)
    y = lane.run(x, mask)
    assert y is not None
    assert entry.calls[-1] == [x.data_ptr(), mask.data_ptr(), *(w.data_ptr() for w in weights), y.data_ptr()]
    assert lane.run(x, mask.clone()) is None       # another tensor with the same contents
    assert lane.run(x) is None
    with torch.inference_mode():
        assert lane.run(x, torch.ones(B, S, dtype=torch.bool)) is None
    mask[0, 1] = False                             # a write torch sees
    assert lane.run(x, mask) is None


def test_kept_mask_must_be_a_versioned_tensor(lane_module):
    with torch.inference_mode():
        mask = torch.ones(B, S, dtype=torch.bool)
    with pytest.raises(ValueError):
        make_lane(lane_module, LANE_KEPT_MASK, kept_mask=mask)


@pytest.mark.parametrize("mode", [LANE_DEVICE_MASK, LANE_INFERENCE_MASK])
def test_masked_build_reads_the_mask_given(lane_module, mode):
    lane, entry, _, weights, _ = make_lane(lane_module, mode)
    x = torch.randn(B, S, D)
    with torch.inference_mode():
        inference_mask = torch.ones(B, S, dtype=torch.bool)
    y = lane.run(x, inference_mask)
    assert y is not None
    assert entry.calls[-1] == [x.data_ptr(), inference_mask.data_ptr(), *(w.data_ptr() for w in weights), y.data_ptr()]
    plain_mask = torch.ones(B, S, dtype=torch.bool)
    # a versioned mask: the device decides under TTJ_GPU_MASK=device; in host mode it is classified in Python
    assert (lane.run(x, plain_mask) is not None) == (mode == LANE_DEVICE_MASK)
    assert lane.run(x, torch.ones(B, S, dtype=torch.float32)) is None          # not bool
    assert lane.run(x, torch.ones(B, S + 1, dtype=torch.bool)[:, :S]) is None  # not contiguous
    if mode == LANE_DEVICE_MASK:   # contiguous, 1 byte off the kernels' pointer alignment
        assert lane.run(x, torch.ones(B * S + 1, dtype=torch.bool)[1:].view(B, S)) is None
    assert lane.run(x) is None


def test_construction_refuses_what_it_cannot_check(lane_module):
    with torch.inference_mode():
        params = [torch.randn(D)]
    with pytest.raises(ValueError):
        make_lane(lane_module, params=params)   # an inference tensor has no version counter
    with pytest.raises(ValueError):
        lane_module.Lane(sizes=[B, S], dtype=torch.float32, params=[torch.randn(D)], weights=[], mask_mode=0, kept_mask=None, entry=1,
                         form=3, entry_args=[0, 0], num_buffers=2, keep_alive=None)


def test_lane_mask_mode_follows_the_python_path():
    class Run:
        mode = "plain"

    class Call:
        direct, passes_mask = Run(), False

    class State:
        mask_ref = mask_version = None
        mask_on_device = False

    from ttj_jax.masks import MaskKind
    state, call = State(), Call()
    assert direct.lane_mask_mode(state, call, None, MaskKind.NONE) == LANE_NO_MASK
    mask = torch.ones(B, S, dtype=torch.bool)
    assert direct.lane_mask_mode(state, call, mask, MaskKind.ALL_TRUE) is None   # a host mask: read every call
    Run.mode = "rows"
    assert direct.lane_mask_mode(state, call, None, MaskKind.NONE) is None
    Call.passes_mask = True
    assert direct.lane_mask_mode(state, call, mask, MaskKind.PREFIX) is None   # a host mask, again

    class GpuMask:   # what lane_mask_mode reads of a CUDA tensor
        device = torch.device("cuda", 0)

        def __init__(self, version=0, inference=False):
            self._version, self.inference = version, inference

        def is_inference(self):
            return self.inference
    kept = GpuMask(version=3)
    state.mask_ref, state.mask_version = (lambda: kept), 3
    expected = {("plain", False, MaskKind.ALL_TRUE): LANE_KEPT_MASK,
                ("rows", True, MaskKind.PREFIX): LANE_KEPT_MASK_ROWS,
                ("masked", True, MaskKind.PREFIX): LANE_KEPT_MASK_PASSED,   # a Triton program that takes the mask
                ("masked", True, MaskKind.GENERAL): LANE_KEPT_MASK_PASSED}  # the masked build
    for (mode, passes, kind), lane_mode in expected.items():
        Run.mode, Call.passes_mask = mode, passes
        assert direct.lane_mask_mode(state, call, kept, kind) == lane_mode
        assert direct.lane_mask_mode(state, call, GpuMask(version=4), kind) is None   # not the kept tensor
    state.mask_version = 4   # the kept tensor was written since it was classified
    assert direct.lane_mask_mode(state, call, kept, MaskKind.GENERAL) is None
    assert direct.lane_mask_mode(state, call, GpuMask(inference=True), MaskKind.UNKNOWN) == LANE_INFERENCE_MASK
    state.mask_on_device = True
    assert direct.lane_mask_mode(state, call, GpuMask(), MaskKind.UNKNOWN) == LANE_DEVICE_MASK


def test_switch_keeps_lanes_off(monkeypatch):
    monkeypatch.setenv("TTJ_NATIVE_LANE", "0")
    assert native.available() is False


def test_failed_build_warns_once_and_keeps_python(monkeypatch, tmp_path):
    monkeypatch.setenv("TTJ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "SOURCE", native.SOURCE.with_name("missing.cpp"))
    monkeypatch.setenv("TTJ_NATIVE_LANE", "1")
    with pytest.warns(native.NativeLaneWarning, match="unavailable"):
        assert native.available() is False
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.available() is False


class StubLane:
    """Stands in for an armed lane in a module's state: answers every call with one tensor."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def run(self, x, mask=None):
        self.calls += 1
        return self.answer


@pytest.mark.parametrize("plug_in", ["class", "drop-in"])
def test_the_bridge_asks_the_lane_first_except_where_python_must_decide(plug_in):
    """bridge.ops.forward (both plug-in ways) returns the armed lane's answer; it does not ask the lane
    when options or a config are given, after a parameter or submodule was registered anywhere (the
    structure check runs in Python first), or under torch's overwrite-on-conversion flag."""
    import bridge
    from bench.baseline import TransformerConfig
    from bench.compile_check import DropIn

    config = TransformerConfig(batch_size=2, seq_len=8, d_model=32, num_heads=2, ffn_dim=32, num_layers=1, causal=True)
    module = (bridge.TTJTransformer if plug_in == "class" else DropIn)(config).eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        real = module(x)
        state = runtime.module_state(module)
        stub = StubLane(torch.full_like(x, 7.0))
        state.lane = stub
        assert module(x) is stub.answer
        assert bridge.forward(module, x) is stub.answer
        assert torch.equal(bridge.forward(module, x, stack="layers"), real)    # options: Python
        assert torch.equal(bridge.forward(module, x, config=config), real)     # a config: Python
        torch.nn.Linear(2, 2)                                                  # a registration anywhere
        assert torch.equal(module(x), real)                                    # Python checks the structure
        assert module(x) is stub.answer                                        # and the lane answers again
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            assert torch.equal(module(x), real)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        bridge.refresh(module)                                                 # a new state: no lane
        assert torch.equal(module(x), real)


def test_describe_says_how_repeats_run_without_building(monkeypatch):
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setenv("TTJ_NATIVE_LANE", "0")
    assert "off" in native.describe()
    monkeypatch.setenv("TTJ_NATIVE_LANE", "1")
    assert "runs through the native lane" in native.describe()
    native._STATE["error"] = "RuntimeError: no compiler"
    assert "unavailable (RuntimeError: no compiler)" in native.describe()
    assert "module" not in native._STATE   # nothing was built
