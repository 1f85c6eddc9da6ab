"""The bridge's launch of a plan's Triton kernels (bridge/triton_launch.py), on the CPU.

The CUDA part (torch's Triton compiling the IR Pallas lowers to, the driver loading and launching it)
needs a GPU: bench/mosaic_launch_check.py --stack rows|fused --against jax runs it on the H200. Here:
reading a program into launch steps (and refusing what is not only kernels), the workspace plan, the
whole launch with each kernel evaluated by jax on views of the same workspace (InterpretedKernels, the
CPU twin), and the bridge's use of it (off by default; on, it agrees with the jax path).
"""

from __future__ import annotations

import ctypes
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import baseline_and_params, random_input

import ttj_jax as T
from bridge import settings
from bridge import triton_launch as tl
from ttj_jax import numerics, stacks
from ttj_jax.masks import MaskKind
from ttj_jax.model import executable, model_key, plan_for
from ttj_jax.params import init_params, prepare_weights

CONFIG = T.Config(2, 32, 32, 2, 32, 2, True)   # B*S = 64 rows: one row tile of the rows stack


def _program(stack: str, config=CONFIG, mask_kind=MaskKind.NONE):
    shape = (config.batch_size, config.seq_len, config.d_model)
    plan = plan_for(config, jax.ShapeDtypeStruct(shape, jnp.float32), mask_kind, device=jax.devices("cpu")[0],
                    caller="torch", stack=stack)
    prepared = prepare_weights(init_params(jax.random.PRNGKey(0), config), numerics.get_policy(plan.policy))
    weights = stacks.kernel_weights(prepared, model_key(config), stack)
    return plan, executable(plan, model_key(config)), weights


@pytest.mark.parametrize("stack, kernels", [("rows", 2 * CONFIG.num_layers + 1), ("fused", 1)])
def test_launch_of_the_program_kernels_equals_the_jax_program(stack, kernels):
    plan, run, weights = _program(stack)
    x = jax.random.normal(jax.random.PRNGKey(1), (CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model))
    launch = tl.TritonProgramLaunch(run, weights, jax.ShapeDtypeStruct(x.shape, x.dtype), None,
                                    torch.device("cpu"), kernels=tl.InterpretedKernels)
    assert launch.num_kernels == kernels
    tensors = [torch.from_numpy(np.array(a)) for a in jax.tree_util.tree_leaves(weights)]
    x_torch = torch.from_numpy(np.array(x))
    x_before = x_torch.clone()
    y = launch(x_torch, None, tensors)
    assert torch.equal(x_torch, x_before)
    np.testing.assert_array_equal(y.numpy(), np.asarray(run(weights, x, None)))


@pytest.mark.parametrize("stack", ["rows", "fused"])
@pytest.mark.parametrize("mask_kind", [MaskKind.UNKNOWN, MaskKind.GENERAL, MaskKind.PREFIX])
def test_a_masked_program_is_only_kernels_and_its_launch_equals_the_jax_program(stack, mask_kind):
    """Every mask mode of the kernels-only stacks ("device" for a mask not classified on the host, "keys",
    "rows") runs no step outside its kernels, which planner.launched_by_caller counts on: the kernels read
    the bool mask's own bytes. The launch then equals the jax program on a mask with holes and an empty
    sequence."""
    plan, run, weights = _program(stack, mask_kind=mask_kind)
    assert plan.mask_mode == {MaskKind.UNKNOWN: "device", MaskKind.GENERAL: "keys", MaskKind.PREFIX: "rows"}[mask_kind]
    x = jax.random.normal(jax.random.PRNGKey(2), (CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model))
    mask = np.random.default_rng(3).random((CONFIG.batch_size, CONFIG.seq_len)) < 0.7
    if mask_kind == MaskKind.PREFIX:
        mask = np.arange(CONFIG.seq_len)[None, :] < np.array([[CONFIG.seq_len - 5], [0]])
    mask[1] = False
    mask_struct = jax.ShapeDtypeStruct(mask.shape, jnp.bool_)
    launch = tl.TritonProgramLaunch(run, weights, jax.ShapeDtypeStruct(x.shape, x.dtype), mask_struct,
                                    torch.device("cpu"), kernels=tl.InterpretedKernels)
    tensors = [torch.from_numpy(np.array(a)) for a in jax.tree_util.tree_leaves(weights)]
    y = launch(torch.from_numpy(np.array(x)), torch.from_numpy(mask), tensors)
    want = np.asarray(run(weights, x, jnp.asarray(mask)))
    np.testing.assert_array_equal(y.numpy(), want)
    assert np.isfinite(want).all() and (want[~mask] == 0).all()


def test_the_workspace_reuses_the_bytes_of_arrays_no_longer_read():
    _, run, weights = _program("rows")
    structs = jax.ShapeDtypeStruct((CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model), jnp.float32)
    program = tl.program_steps(jax.make_jaxpr(run)(weights, structs, None))
    written = sum(tl._nbytes(v.aval) for step in program.steps for v in step.eqn.outvars)
    assert 0 < program.workspace_bytes <= written / 2
    out = program.output_base
    assert [r.base for r in program.steps[-1].outputs] == [out]


def test_plan_buffers_never_lets_a_kernel_write_over_a_live_array():
    # A random chain: each kernel reads some earlier arrays and writes one or two new ones.
    rng = np.random.default_rng(0)
    for trial in range(50):
        names = itertools.count()
        arrays, kernels = [], []
        for _ in range(int(rng.integers(2, 12))):
            reads = [a for a in arrays if rng.random() < 0.4]
            writes = [next(names) for _ in range(int(rng.integers(1, 3)))]
            kernels.append((writes, reads))
            arrays += writes
        sizes = {a: int(rng.integers(1, 2000)) for a in arrays}
        last_read = {}
        for index, (_, reads) in enumerate(kernels):
            for a in reads:
                last_read[a] = index
        offsets, total = tl.plan_buffers(kernels, sizes, last_read)
        live: set = set()
        for index, (writes, reads) in enumerate(kernels):
            for a in writes:
                assert offsets[a] % tl._ALIGN == 0 and offsets[a] + sizes[a] <= total
                for b in live | set(reads):   # arrays still to be read, and this kernel's inputs
                    if b in writes:
                        continue
                    apart = offsets[a] + sizes[a] <= offsets[b] or offsets[b] + sizes[b] <= offsets[a]
                    assert apart, (trial, index, a, b)
            for a in writes:
                if last_read.get(a, -1) > index:
                    live.add(a)
            live = {b for b in live if last_read[b] > index}


def test_a_program_with_work_outside_the_kernels_is_refused_by_name():
    _, run, weights = _program("layers")
    structs = jax.ShapeDtypeStruct((CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model), jnp.float32)
    with pytest.raises(tl.NotReplayable, match="outside a Pallas kernel"):
        tl.program_steps(jax.make_jaxpr(run)(weights, structs, None))


def test_reshapes_and_byte_preserving_casts_are_views_and_other_casts_are_refused():
    def body(x):
        return x.reshape(-1).astype(jnp.float16)
    with pytest.raises(tl.NotReplayable, match="a cast from float32 to float16"):
        tl.program_steps(jax.make_jaxpr(body)(jax.ShapeDtypeStruct((4, 4), jnp.float32)))
    with pytest.raises(tl.NotReplayable, match="not written by a kernel"):
        tl.program_steps(jax.make_jaxpr(lambda m: m.astype(jnp.int8).reshape(-1))(
            jax.ShapeDtypeStruct((4, 4), jnp.bool_)))


def test_ptx_entry_reads_the_kernel_name_and_its_parameters():
    ptx = ".visible .entry ttj_rows_entry(\n\t.param .u64 .ptr .global .align 1 p0,\n\t.param .u64 p1,\n\t.param .u64 p2\n)\n{}"
    name, params, declaration = tl.ptx_entry(ptx)
    assert (name, params) == ("ttj_rows_entry", 3) and declaration.startswith(".entry ttj_rows_entry(")
    with pytest.raises(tl.NotReplayable, match="2 kernel entries"):
        tl.ptx_entry(ptx + ptx)


def test_the_rows_stack_is_launched_by_default_the_fused_kernel_on_request(monkeypatch):
    monkeypatch.delenv(settings.TRITON_LAUNCH_ENV, raising=False)
    assert settings.triton_launch_stacks() == ("rows",)
    assert tl.unavailable_reason(torch.device("cuda", 0), "fused") is not None
    assert settings.TRITON_LAUNCH_ENV in tl.unavailable_reason(torch.device("cuda", 0), "fused")
    assert "not a CUDA device" in tl.unavailable_reason(torch.device("cpu"), "rows")
    for value, stacks_on in (("0", ()), ("off", ()), ("all", ("rows", "fused")), ("1", ("rows", "fused")),
                             ("rows", ("rows",))):
        monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, value)
        assert settings.triton_launch_stacks() == stacks_on
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "0")
    assert settings.TRITON_LAUNCH_ENV in tl.unavailable_reason(torch.device("cuda", 0), "rows")
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "everything")
    with pytest.raises(ValueError, match="TTJ_TRITON_LAUNCH"):
        settings.triton_launch_stacks()


def test_the_rows_launch_waits_for_a_gpu_run_at_a_new_width_unless_asked(monkeypatch):
    monkeypatch.delenv(settings.TRITON_LAUNCH_ENV, raising=False)
    assert all(tl.config_reason("rows", d) is None for d in tl.ROWS_GPU_VERIFIED_D_MODELS)
    assert "d_model 256" in tl.config_reason("rows", 256)
    assert tl.config_reason("fused", 256) is None   # the fused kernel is off by default anyway
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "all")
    assert tl.config_reason("rows", 256) is None


@pytest.mark.slow
def test_bridge_runs_the_rows_program_kernels_itself_when_on_and_matches_the_jax_path(monkeypatch):
    import bridge
    from bridge import runtime
    baseline, _ = baseline_and_params(CONFIG, 5)
    ours = bridge.TTJTransformer(CONFIG)
    ours.load_state_dict(baseline.state_dict())
    x = random_input(CONFIG, 6)
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "0")
    with torch.inference_mode():   # off: through jax, and the note says why
        through_jax = runtime.forward(ours, x, stack="rows")
    [call] = [c for k, c in runtime._STATES[ours].calls.items() if k[-1] == "rows"]
    assert call.direct is None and settings.TRITON_LAUNCH_ENV in call.direct_note

    ours = bridge.TTJTransformer(CONFIG)
    ours.load_state_dict(baseline.state_dict())
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "rows")
    monkeypatch.setattr(tl, "unavailable_reason", lambda device, stack: None)
    monkeypatch.setattr(tl, "kernels_for", lambda device: tl.InterpretedKernels)
    x_before = x.clone()
    with torch.inference_mode():
        y = runtime.forward(ours, x, stack="rows")
        again = runtime.forward(ours, x, stack="rows")
    [call] = [c for k, c in runtime._STATES[ours].calls.items() if k[-1] == "rows"]
    assert call.direct is not None, call.direct_note
    assert torch.equal(x, x_before) and torch.equal(y, again) and torch.equal(y, through_jax)
    with torch.inference_mode():   # the harness's all-True mask: the plan takes none, the launch ignores it
        assert torch.equal(runtime.forward(ours, x, torch.ones(x.shape[:2], dtype=torch.bool), stack="rows"), y)

    class Off(tl.InterpretedKernels):   # a launch whose output is off by 1% of the tolerance's scale
        def __call__(self, tensors):
            super().__call__(tensors)
            tensors[-1].add_(0.03 * tensors[-1].abs().max())
    ours = bridge.TTJTransformer(CONFIG)
    ours.load_state_dict(baseline.state_dict())
    monkeypatch.setattr(tl, "kernels_for", lambda device: Off)
    with torch.inference_mode():
        assert torch.equal(runtime.forward(ours, x, stack="rows"), through_jax)
    [call] = [c for k, c in runtime._STATES[ours].calls.items() if k[-1] == "rows"]
    assert call.direct is None and "exact fp32 program" in call.direct_note


# --- the native lane's launch of the kernels (bridge/native/lane.cpp, form 4) ---------------------------

class DriverStandIn:
    """cuLaunchKernel as the native lane calls it, on CPU memory: the launch of function handle k + 1
    evaluates step k's pallas_call with jax on the arrays at the addresses its parameters point to, and
    writes its outputs there; records each launch's configuration and its scratch parameters' values."""

    def __init__(self, program: tl.Program):
        self.program, self.calls = program, []
        u, vp = ctypes.c_uint, ctypes.c_void_p
        self._fn = ctypes.CFUNCTYPE(ctypes.c_int, vp, u, u, u, u, u, u, u, vp, vp, vp)(self._launch)
        self.address = ctypes.cast(self._fn, ctypes.c_void_p).value

    def _launch(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        from jax._src.pallas.pallas_call import pallas_call_p
        step = self.program.steps[function - 1]
        avals = [v.aval for v in step.eqn.invars] + [v.aval for v in step.eqn.outvars]
        slots = (ctypes.c_void_p * (len(avals) + 2)).from_address(params)
        addresses = [ctypes.c_uint64.from_address(slots[i]).value for i in range(len(avals) + 2)]
        arrays = [np.frombuffer((ctypes.c_char * tl._nbytes(a)).from_address(p), dtype=np.dtype(a.dtype)).reshape(a.shape)
                  for p, a in zip(addresses, avals)]
        inputs = [jnp.asarray(a.copy()) for a in arrays[:len(step.eqn.invars)]]
        for out, value in zip(arrays[len(step.eqn.invars):], pallas_call_p.bind(*inputs, **step.eqn.params)):
            out[...] = np.asarray(value)
        self.calls.append((function, (gx, gy, gz), (bx, by, bz), shared, stream, extra, addresses[len(avals):]))
        return 0


class StandInKernels(tl.CudaKernels):
    """CudaKernels' launch specs for the native lane, with the stand-in driver (no CUDA)."""

    def __init__(self, program: tl.Program):
        self.driver = DriverStandIn(program)
        binaries = [tl.KernelBinary(f"k{i}", b"", (i + 1, 1, 1), 4, 1024 * i, len(s.inputs) + len(s.outputs) + 2)
                    for i, s in enumerate(program.steps)]
        self._refs = [ref for step in program.steps for ref in step.inputs + step.outputs]
        self.kernel_specs = tl.launch_specs(program, binaries, range(1, len(binaries) + 1))
        self._launch = self.driver._fn
        self._stream = lambda: 0


@pytest.mark.slow   # builds the native lane (bridge/native) in a fresh cache
@pytest.mark.parametrize("masked", [False, True])
def test_the_native_lane_launches_the_program_kernels_as_the_jax_program_runs(monkeypatch, tmp_path, masked):
    """The lane's form 4 with the launch's native_call: every kernel launched in order with its grid,
    warps and shared memory, its arrays at the right addresses (weights, x, the mask, the workspace, the
    output), null scratch pointers, on the default stream; the output equals the jax program's."""
    from bridge import native
    from bridge.direct import LANE_DEVICE_MASK, LANE_NO_MASK
    monkeypatch.setenv("TTJ_CACHE_DIR", str(tmp_path))
    plan, run, weights = _program("rows", mask_kind=MaskKind.PREFIX if masked else MaskKind.NONE)
    assert (plan.mask_mode != "none") == masked
    shape = (CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model)
    mask_struct = jax.ShapeDtypeStruct(shape[:2], jnp.bool_) if masked else None
    launch = tl.TritonProgramLaunch(run, weights, jax.ShapeDtypeStruct(shape, jnp.float32), mask_struct,
                                    torch.device("cpu"), kernels=StandInKernels)
    spec = launch.native_call()
    assert spec["form"] == 4 and spec["keep_alive"] is launch and spec["entry"] == launch._kernels.driver.address
    tensors = [torch.from_numpy(np.array(a)) for a in jax.tree_util.tree_leaves(weights)]
    lane = native.build().Lane(sizes=list(shape), dtype=torch.float32, params=[torch.zeros(3)], weights=tensors,
                               mask_mode=LANE_DEVICE_MASK if masked else LANE_NO_MASK, kept_mask=None, **spec)
    x = torch.randn(shape)
    mask = torch.ones(shape[:2], dtype=torch.bool)   # a prefix mask (the plan the program was made for)
    mask[0, 5:] = False
    mask[1] = False
    x_before, mask_before = x.clone(), mask.clone()
    y = lane.run(x, mask) if masked else lane.run(x)
    calls = launch._kernels.driver.calls
    assert [c[0] for c in calls] == list(range(1, launch.num_kernels + 1))
    assert all(c[1] == (c[0], 1, 1) and c[2] == (128, 1, 1) and c[3] == 1024 * (c[0] - 1) for c in calls)
    assert all(c[4] is None and c[5] is None and c[6] == [0, 0] for c in calls)   # default stream, null scratch
    expected = run(weights, jnp.asarray(x.numpy()), jnp.asarray(mask.numpy()) if masked else None)
    np.testing.assert_array_equal(y.numpy(), np.asarray(expected))
    assert torch.equal(x, x_before) and torch.equal(mask, mask_before)
    y2 = lane.run(x, mask) if masked else lane.run(x)
    assert y2.data_ptr() != y.data_ptr() and torch.equal(y, y2)


def test_a_call_whose_plan_takes_no_mask_ignores_the_mask_given():
    """The harness passes its all-True mask to a plan that needs none: the launch must not read it as one
    of the program's arrays (it once took the mask's place for the workspace's, and the workspace's for
    the output's)."""
    plan, run, weights = _program("rows")
    shape = (CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model)
    launch = tl.TritonProgramLaunch(run, weights, jax.ShapeDtypeStruct(shape, jnp.float32), None,
                                    torch.device("cpu"), kernels=tl.InterpretedKernels)
    tensors = [torch.from_numpy(np.array(a)) for a in jax.tree_util.tree_leaves(weights)]
    x = torch.randn(shape)
    y = launch(x, torch.ones(shape[:2], dtype=torch.bool), tensors)
    np.testing.assert_array_equal(y.numpy(), np.asarray(run(weights, jnp.asarray(x.numpy()), None)))


def test_half_x_runs_as_float32_where_the_rules_give_the_launched_rows_stack(monkeypatch):
    """An fp16/bf16 x at a rows plan is cast to float32 around the bridge's launch (the program's own first
    step is that cast, which the launch cannot run), so it keeps the launch and the lane; not where the
    launch is off, or for a split plan."""
    import types

    import bridge
    from bridge import direct, runtime
    state = runtime._state(bridge.TTJTransformer(CONFIG), None)
    x = types.SimpleNamespace(dtype=torch.float16, device=torch.device("cuda", 0),
                              shape=(CONFIG.batch_size, CONFIG.seq_len, CONFIG.d_model))
    plan = types.SimpleNamespace(stack="rows", data_parallel=1)
    monkeypatch.setattr(direct, "make_plan", lambda config, facts, device: plan)
    monkeypatch.setattr(direct, "device_facts", lambda device: None)
    monkeypatch.setattr(tl, "unavailable_reason", lambda device, stack: None if stack == "rows" else "off")
    assert direct.half_runs_as_float32(state, x, MaskKind.NONE, jax_device=object())
    x.dtype = torch.bfloat16
    assert direct.half_runs_as_float32(state, x, MaskKind.NONE, jax_device=object())
    plan.data_parallel = 2
    assert not direct.half_runs_as_float32(state, x, MaskKind.NONE, jax_device=object())
    plan.data_parallel, plan.stack = 1, "fused"   # its launch is off
    assert not direct.half_runs_as_float32(state, x, MaskKind.NONE, jax_device=object())
    plan.stack = "layers"                           # the XLA program takes fp16 x as it is
    assert not direct.half_runs_as_float32(state, x, MaskKind.NONE, jax_device=object())
    plan.stack = "fused_mgpu"   # planned for x's own dtype: the Mosaic kernel reads and writes it as it is
    for dtype in (torch.float16, torch.bfloat16):
        x.dtype = dtype
        assert not direct.half_runs_as_float32(state, x, MaskKind.NONE, jax_device=object())
    x.dtype = torch.float32
    plan.stack = "rows"
    assert not direct.half_runs_as_float32(state, x, MaskKind.NONE, jax_device=object())


def test_the_bridge_tells_the_planner_which_stacks_it_launches_itself(monkeypatch):
    """direct.self_launched_stacks, which the measured planner charges no bridge host time: the Mosaic
    stack where its launch takes the call, the Triton stacks the setting turns on at GPU-checked widths;
    nothing on the CPU. build_call hands it to the planner."""
    import types

    import bridge
    from bridge import direct, mosaic_launch, runtime
    cuda = torch.device("cuda", 0)
    wide = T.Config(batch_size=2, seq_len=16, d_model=256, num_heads=2, ffn_dim=64, num_layers=2, causal=True)
    monkeypatch.delenv(settings.TRITON_LAUNCH_ENV, raising=False)
    monkeypatch.setattr(mosaic_launch, "unavailable_reason", lambda device: "not Hopper")
    monkeypatch.setattr(tl, "unavailable_reason", lambda device, stack: None
                        if stack in settings.triton_launch_stacks() else "off")
    assert direct.self_launched_stacks(CONFIG, 2, 16, torch.device("cpu")) == ()
    assert direct.self_launched_stacks(CONFIG, 2, 16, cuda) == ("rows",)
    assert direct.self_launched_stacks(wide, 2, 16, cuda) == ()      # a width the rows launch has not run at
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "all")
    assert direct.self_launched_stacks(wide, 2, 16, cuda) == ("rows", "fused")
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "0")
    assert direct.self_launched_stacks(CONFIG, 2, 16, cuda) == ()
    monkeypatch.setattr(mosaic_launch, "unavailable_reason", lambda device: None)
    takes = {"fused_mgpu": lambda config, batch, seq_len: None if seq_len <= 128 else "too long"}
    monkeypatch.setattr(stacks, "get", lambda name: types.SimpleNamespace(bridge_launch=takes.get(name)))
    assert direct.self_launched_stacks(CONFIG, 2, 16, cuda) == ("fused_mgpu",)
    assert direct.self_launched_stacks(CONFIG, 2, 256, cuda) == ()
    monkeypatch.undo()
    # the Mosaic stack's own answer, for any length and model a call may bring (S above the kernel's
    # 128-row tile, odd S, a width it does not take): a reason, never an exception
    monkeypatch.setattr(mosaic_launch, "unavailable_reason", lambda device: None)
    monkeypatch.setenv(settings.TRITON_LAUNCH_ENV, "0")
    mosaic = T.Config(batch_size=2, seq_len=128, d_model=128, num_heads=4, ffn_dim=128, num_layers=2, causal=True)
    assert direct.self_launched_stacks(mosaic, 2, 128, cuda) == ("fused_mgpu",)
    assert direct.self_launched_stacks(mosaic, 3, 64, cuda) == ()          # half a tile: the jax path pads
    for seq_len in (197, 256, 512, 100):
        assert direct.self_launched_stacks(mosaic, 2, seq_len, cuda) == ()
        assert "does not take" in direct.launch_reason("fused_mgpu", mosaic, 2, seq_len, cuda)
    assert direct.self_launched_stacks(wide, 2, 128, cuda) == ()
    monkeypatch.undo()

    seen = {}
    real_plan_for = runtime.plan_for

    def plan_for(*args, **kwargs):
        seen.update(kwargs)
        return real_plan_for(*args, **kwargs)
    monkeypatch.setattr(runtime, "plan_for", plan_for)
    monkeypatch.setattr(direct, "self_launched_stacks", lambda config, batch, seq_len, device: ("rows",))
    ours = bridge.TTJTransformer(CONFIG)
    with torch.inference_mode():
        ours(random_input(CONFIG, 1))
    assert seen["self_launched"] == ("rows",) and seen["caller"] == "torch"


def test_a_refused_launch_the_planner_counted_on_is_planned_again_without_it(monkeypatch):
    """The planner chose the rows plan because the bridge launches it; the launch is refused (here: its
    one-time check): the call is planned again with the rows stack charged as a plan through jax, and
    explain() says so. Where the second planning gives the same plan, it runs through jax."""
    import bridge
    from bridge import direct, runtime
    rows = T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="none", stack="rows", reason="rows")
    layers = T.Plan(policy="mixed_fp16", attention="pallas", mask_mode="none", reason="layers")
    asked = []

    def plan_for(config, probe, kind, **kwargs):
        asked.append(kwargs["self_launched"])
        return rows if "rows" in kwargs["self_launched"] else layers
    monkeypatch.setattr(runtime, "plan_for", plan_for)
    monkeypatch.setattr(direct, "self_launched_stacks", lambda config, batch, seq_len, device: ("rows",))
    monkeypatch.setattr(direct, "triton_kernels", lambda state, call, x: (None, "refused by its check"))
    ours = bridge.TTJTransformer(CONFIG)
    x = random_input(CONFIG, 2)
    with torch.inference_mode():
        y = ours(x)
    [call] = runtime._STATES[ours].calls.values()
    assert asked == [("rows",), ()] and call.plan == layers
    assert "refused by its check" in call.direct_note and "planned again" in call.direct_note
    assert "planned again" in bridge.explain(ours, x)
    with torch.inference_mode():
        assert torch.equal(ours(x), y) and len(asked) == 2   # planned once per signature

    asked.clear()
    monkeypatch.setattr(runtime, "plan_for", lambda config, probe, kind, **kwargs: asked.append(1) or rows)
    ours = bridge.TTJTransformer(CONFIG)
    with torch.inference_mode():
        ours(x)
    [call] = runtime._STATES[ours].calls.values()
    assert len(asked) == 2 and call.plan == rows and call.direct is None   # the same plan: through jax
