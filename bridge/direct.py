"""The bridge's own launches: which calls get one, how each is built and checked before first use, and
the native lane that repeats them.

- The Mosaic GPU whole-stack kernel (bridge/mosaic_launch.py), checked against the jax path's output
  (the same binary: to rounding noise).
- The rows stack's Triton kernels (bridge/triton_launch.py), compiled by torch's Triton, checked beside
  the jax path against the exact fp32 program (another compile of the same kernels).
- fp16/bf16 x computed as float32 where that keeps a call on one of these launches.
- The native lane (bridge/native): after a launched call on the default stream, a C++ object that
  repeats it while its inputs, mask use and weights are unchanged (runtime.fast_forward asks it first).

Functions of the module's state (runtime._ModuleState) and call (runtime.Call); runtime.py calls them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import torch

from bridge import mosaic_launch, native, settings, triton_launch
from bridge.transfer import Transfer, torch_dtype_name
from ttj_jax import stacks
from ttj_jax.device import device_facts
from ttj_jax.masks import MaskKind
from ttj_jax.numerics import harness_check
from ttj_jax.params import params_from_state_dict
from ttj_jax.planner import KEY_MASK_MODES, InputFacts, Plan
from ttj_jax.planner import plan as make_plan


@dataclasses.dataclass
class Call:
    """What the bridge keeps per call signature (runtime.py): the plan, its program, how x crosses to
    jax, and the bridge's own launch of it where it has one."""
    plan: Plan
    run: Callable
    transfer: Transfer
    passes_mask: bool
    upcast_to: torch.dtype | None   # float64 (and, for the bridge's own launches, fp16/bf16) x computes in
    #                                 float32 and the output is cast back
    # The plan's whole-stack kernel launched on torch tensors, no JAX dispatch: direct(x, mask, weights)
    # -> y, weights the kernel's layout as torch tensors (_ModuleState.kernel_tensors), through
    # bridge/mosaic_launch.py.
    direct: Callable | None = None
    direct_note: str = ""           # why a whole-stack plan runs through jax instead, when it does
    direct_device: int | None = None   # the CUDA device index a direct launch needs current
    # The weights this call's program takes, and the _ModuleState.generation they were built in: one
    # integer comparison per call instead of the per-weight-version cache lookups.
    weights_generation: int = -1
    weights: Any = None


def launch_reason(stack_name: str, config, batch_size: int, seq_len: int, device: torch.device) -> str | None:
    """Why the bridge does not launch the kernels of a `stack_name` plan itself for a call of this shape on
    `device`, or None where it does (as its settings and the device stand; what the launch's one-time
    check may still refuse is not known here)."""
    stack = stacks.get(stack_name)
    if stack.bridge_launch is not None:   # the Mosaic GPU stack
        return mosaic_launch.unavailable_reason(device) or stack.bridge_launch(config, batch_size, seq_len)
    if stack.kernels_only:                # a program of Triton kernels
        return (triton_launch.unavailable_reason(device, stack_name)
                or triton_launch.config_reason(stack_name, config.d_model))
    return f"the {stack_name} stack runs through jax"


def self_launched_stacks(config, batch_size: int, seq_len: int, device: torch.device) -> tuple[str, ...]:
    """The stacks whose kernels the bridge would launch itself for a call of this shape on `device`
    (launch_reason): the measured planner charges no bridge host time to those plans
    (planner.InputFacts.self_launched)."""
    if device.type != "cuda":
        return ()
    return tuple(name for name in ("fused_mgpu", *settings.triton_launch_stacks())
                 if launch_reason(name, config, batch_size, seq_len, device) is None)


def half_runs_as_float32(state, x: torch.Tensor, kind: MaskKind, jax_device) -> bool:
    """Whether an fp16/bf16 x is computed as float32 (cast in, output cast back): where the rules give
    float32 x a stack the bridge launches itself and give x's own dtype none (the rows stack's Triton
    program casts x to float32 first thing, a cast the bridge's launch does not run; the Mosaic GPU
    kernel reads and writes the half dtypes in planner.MGPU_STACK_IO_DTYPES itself, where planned), the
    two casts cost a few microseconds and the jax call they replace costs ~0.1-0.2 ms of host time."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.device.type != "cuda" or jax_device is None:
        return False
    facts = InputFacts(batch_size=x.shape[0], seq_len=x.shape[1], dtype="float32", mask_kind=kind,
                       caller="torch")
    device = device_facts(jax_device)
    if make_plan(state.config, dataclasses.replace(facts, dtype=torch_dtype_name(x.dtype)), device).stack == "fused_mgpu":
        return False   # the kernel takes x as it is
    rules = make_plan(state.config, facts, device)
    return rules.data_parallel == 1 and launch_reason(rules.stack, state.config, x.shape[0], x.shape[1], x.device) is None


def mosaic_kernel(state, call: Call, shape, device: torch.device, dtype: torch.dtype = torch.float32):
    """(launch, "") for the Mosaic GPU stack on this input (bridge/mosaic_launch.py), x of `dtype` as the
    kernel takes it (after any upcast), or (None, why it runs through jax)."""
    why = launch_reason(call.plan.stack, state.config, shape[0], shape[1], device)
    if why is not None:
        return None, why
    masked = call.plan.mask_mode in KEY_MASK_MODES   # any mask: the kernel's masked build
    try:
        kernel = mosaic_launch.MosaicStackLaunch(state.config, shape[0], shape[1], device,
                                                 **({"masked": True} if masked else {}),
                                                 **({"dtype": dtype} if dtype != torch.float32 else {}))
    except (RuntimeError, ValueError, OSError) as e:
        return None, f"the Mosaic GPU launch is unavailable: {type(e).__name__}: {e}"
    if call.plan.mask_mode == "rows":   # a prefix mask under causal attention: rows zeroed after the kernel
        def run(x, mask, tensors):
            return torch.where(mask.unsqueeze(-1), kernel(x, *tensors), 0.0)
        mode = "rows"
    elif masked:   # the kernel reads the bool mask's bytes (runtime.py hands it over launchable)
        def run(x, mask, tensors):
            return kernel(x, mask, *tensors)
        mode = "masked"
    else:
        def run(x, mask, tensors):
            return kernel(x, *tensors)
        mode = "plain"
    # for the native lane (lane_mask_mode) and diagnostic tools (bench/host_parts.py)
    run.kernel, run.mode = kernel, mode
    disagreement = compare_with_jax(state, run, call, shape, torch_dtype_name(dtype), device)
    return (None, disagreement) if disagreement is not None else (run, "")


def triton_kernels(state, call: Call, x: torch.Tensor):
    """(launch, "") running the plan's Triton kernels on torch's stream (bridge/triton_launch.py), or
    (None, why it runs through jax)."""
    why = launch_reason(call.plan.stack, state.config, x.shape[0], x.shape[1], x.device)
    if why is None and call.plan.policy != "mixed_fp16":
        why = f"policy {call.plan.policy}: the bridge keeps kernel weights of mixed_fp16 only"
    if why is not None:
        return None, why
    dtype = "float32" if call.upcast_to is not None else torch_dtype_name(x.dtype)
    x_struct = jax.ShapeDtypeStruct(tuple(x.shape), dtype)
    mask_struct = jax.ShapeDtypeStruct(tuple(x.shape[:2]), "bool") if call.passes_mask else None
    try:
        launch = triton_launch.TritonProgramLaunch(
            call.run, state.kernel_jax_weights(call.plan.stack), x_struct, mask_struct, x.device,
            kernels=triton_launch.kernels_for(x.device))
    except triton_launch.NotReplayable as e:
        return None, f"the program is not only Triton kernels: {e}"
    except (RuntimeError, OSError, ImportError, AttributeError) as e:
        return None, f"the Triton launch is unavailable: {type(e).__name__}: {e}"
    disagreement = check_against_exact(state, launch, call, x.shape, dtype, x.device)
    return (None, disagreement) if disagreement is not None else (launch, "")


# Another Triton build compiles the same kernels: each kernel's outputs then differ from XLA's compile by
# fp16 roundings (measured within one fp16 ulp per kernel), which cascade over the layers. So the
# launch is checked against the exact fp32 program, beside the jax path: its worst error over the
# harness tolerance may exceed the jax path's by at most this much (and stays within the planner's
# margin for alternatives, autotune.ACCURACY_MARGIN, where the jax path is within it).
TRITON_CHECK_ALLOWANCE = 0.25


def check_against_exact(state, run, call: Call, shape, dtype, device) -> str | None:
    """Runs `run(x, mask, weights)` (the bridge's launch of the plan's Triton kernels) once on a random
    input, with the jax path and the exact fp32 program (autotune.exact_output) on its first sequences.
    Returns why the launch cannot be used, or None. Once per input signature."""
    from ttj_jax import autotune
    jx, jmask, direct_out, jax_out = both_paths(state, run, call, shape, dtype, device)
    state.weights("mixed_fp16")   # the parameters' jax views (state.views) are current
    exact = autotune.exact_output(state.config, call.plan, params_from_state_dict(state.views, state.config), jx, jmask)
    if exact is None:
        return "no exact fp32 reference fits at this size to check the bridge's launch against: running through jax"
    rows = exact.shape[0]
    worst_direct = float(harness_check(call.transfer.to_jax(direct_out)[:rows], exact)[1])
    worst_jax = float(harness_check(jax_out[:rows], exact)[1])
    bound = min(1.0, max(autotune.ACCURACY_MARGIN, worst_jax + TRITON_CHECK_ALLOWANCE))
    if not worst_direct <= bound:   # also catches NaN
        return (f"the direct launch's error against the exact fp32 program was {worst_direct:.3g} of the harness "
                f"tolerance on a test input, the jax path's {worst_jax:.3g} (allowed: {bound:.3g}): running through jax")
    return None


def both_paths(state, run, call: Call, shape, dtype, device):
    """The probe input (probe_input) through the direct launch `run(x, mask, weights)` and through the jax
    path: (x and the mask as jax arrays, the launch's torch output, the jax path's output)."""
    x, mask = probe_input(call, shape, dtype, device)
    stack = call.plan.stack
    direct_out = run(x, mask, state.kernel_tensors(stack))
    call.transfer.order_before_jax()
    jx, jmask = call.transfer.to_jax(x), None if mask is None else call.transfer.to_jax(mask)
    return jx, jmask, direct_out, call.run(state.kernel_jax_weights(stack), jx, jmask)


def probe_input(call: Call, shape, dtype, device):
    """A seeded random x and, where the plan takes one, a mask that exercises it (an all-invalid first
    sequence included)."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tuple(shape), generator=generator, device=device).to(getattr(torch, str(dtype)))
    mask = None
    if call.passes_mask and call.plan.mask_mode == "rows":   # a prefix mask, an empty sequence included
        lengths = torch.randint(0, shape[1] + 1, (shape[0],), generator=generator, device=device)
        mask = torch.arange(shape[1], device=device)[None, :] < lengths[:, None]
        mask[0] = False
    elif call.passes_mask:   # a general mask (a fully invalid sequence included) exercises every path
        mask = torch.rand(tuple(shape[:2]), generator=generator, device=device) < 0.7
        mask[0] = False
    return x, mask


# Pallas's Triton lowering declares every kernel pointer 32-byte divisible (`tt.divisibility`), and the Mosaic
# kernel's TMA copies need 16-byte aligned addresses. torch's allocations are aligned far beyond that; a view
# into another tensor need not be (bridge/native/lane.cpp checks the same).
KERNEL_POINTER_ALIGN = 32


def launchable(t: torch.Tensor) -> torch.Tensor:
    """t as a launch hands it to kernels: contiguous and KERNEL_POINTER_ALIGN-aligned, itself where it is,
    else a copy (the caller's tensor is never changed)."""
    if t.is_contiguous() and t.data_ptr() % KERNEL_POINTER_ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# The direct launch runs the binary the jax path runs: its output must match to rounding noise.
DIRECT_CHECK_ATOL = 1e-4


def compare_with_jax(state, run, call: Call, shape, dtype, device) -> str | None:
    """Runs `run(x, mask, weights)` (a direct launch of the binary the jax path runs) once on a random
    input and compares it with the jax path (the same plan through jax): within DIRECT_CHECK_ATOL.
    Returns why it cannot be used, or None. One host sync, once per input signature."""
    _, _, direct_out, jax_result = both_paths(state, run, call, shape, dtype, device)
    jax_out = call.transfer.to_torch(jax_result)
    difference = float((direct_out.float() - jax_out.float()).abs().max())
    if not difference <= DIRECT_CHECK_ATOL:   # also catches NaN
        return (f"the direct launch differed from the jax path by {difference:.3g} (> "
                f"{DIRECT_CHECK_ATOL}) on a test input: running through jax")
    return None


# The native lane's mask modes (bridge/native/lane.cpp, MaskMode).
LANE_NO_MASK, LANE_KEPT_MASK, LANE_DEVICE_MASK, LANE_INFERENCE_MASK, LANE_KEPT_MASK_ROWS, LANE_KEPT_MASK_PASSED = range(6)
LANE_KEPT_MODES = (LANE_KEPT_MASK, LANE_KEPT_MASK_ROWS, LANE_KEPT_MASK_PASSED)


def lane_mask_mode(state, call: Call, mask: torch.Tensor | None, kind: MaskKind) -> int | None:
    """How a lane repeats this launched call's mask handling, or None where it cannot:
    - no mask: LANE_NO_MASK;
    - a GPU mask classified on the host and kept (classify) for the mask-free kernel: LANE_KEPT_MASK,
      the same tensor at the same version; LANE_KEPT_MASK_ROWS where its invalid rows are zeroed after
      the kernel (a prefix mask under causal attention, the "rows" run);
    - the kernel's masked build reading a mask the device decides about: LANE_DEVICE_MASK under
      TTJ_GPU_MASK=device (any mask), LANE_INFERENCE_MASK for an inference-tensor mask (no version counter:
      only inference-tensor masks repeat this call);
    - a launch that reads a GPU mask classified on the host and kept (the masked build, or a Triton
      program that takes the mask, such as the rows stack's for a prefix mask): LANE_KEPT_MASK_PASSED, the
      same tensor at the same version, its bytes handed to the launch.
    A host mask (read on every call) is left to the Python path."""
    mode = getattr(call.direct, "mode", None)
    if mask is None:
        return LANE_NO_MASK if mode == "plain" and kind == MaskKind.NONE else None
    if mask.device.type != "cuda":
        return None
    kept = (not mask.is_inference() and not state.mask_on_device and state.mask_ref is not None
            and state.mask_ref() is mask and state.mask_version == mask._version)
    if mode == "rows" or (mode == "plain" and not call.passes_mask):
        return None if not kept else LANE_KEPT_MASK_ROWS if mode == "rows" else LANE_KEPT_MASK
    if mode == "masked" and kind == MaskKind.UNKNOWN:
        if state.mask_on_device:
            return LANE_DEVICE_MASK
        return LANE_INFERENCE_MASK if mask.is_inference() else None
    if mode == "masked" and kept:
        return LANE_KEPT_MASK_PASSED
    return None


def arm_lane(state, call: Call, x: torch.Tensor, mask: torch.Tensor | None, kind: MaskKind,
              tensors: list[torch.Tensor]) -> None:
    """After a launched call on the default stream (x: the x it launched with, contiguous as given: float32,
    or a half dtype the Mosaic kernel reads as it is; an x of another dtype, `call.upcast_to`, is cast in
    and out by the lane as here): a native lane that repeats it (fast_forward), unless
    the one armed already does. Nothing where the lane cannot repeat it (lane_mask_mode, inference-tensor
    parameters, a launcher of unknown form) or native lanes are unavailable (bridge/native)."""
    kernel = getattr(call.direct, "kernel", None)
    if x.device.type != "cuda" or kernel is None or kernel.current_stream():
        return   # the lane launches on the default stream only (as MosaicStackLaunch does without events)
    mask_key = None if mask is None else (id(mask), None if mask.is_inference() else mask._version)
    key = (id(call), id(state.watch), state.generation, id(tensors), mask_key)
    if state.lane_key == key:
        return
    state.lane_key, state.lane = key, None
    mode = lane_mask_mode(state, call, mask, kind)
    launch = kernel.native_call()
    if mode is None or launch is None or any(p.is_inference() for p in state.params) or not native.available():
        return
    if launch["form"] == 4 and x.dtype != torch.float32:
        return   # the lane casts x to float32 (and the output back): a Triton program for another x dtype cannot repeat
    state.lane = native.lane_class()(
        sizes=list(x.shape), dtype=call.upcast_to or x.dtype, params=state.params, weights=tensors, mask_mode=mode,
        kept_mask=mask if mode in LANE_KEPT_MODES else None, **launch,
        **({"kernel_dtype": x.dtype} if x.dtype != torch.float32 else {}))
