"""The bridge's launch of a plan's Triton kernels on torch tensors: no JAX dispatch.

Some plans compile to a program that is nothing but Pallas kernels lowered through Triton, joined by
reshapes: `Plan.stack == "rows"` (per layer our flash-attention kernel and one row-tile kernel, 9
kernels at 4 layers) and `"fused"` (the whole stack in one Triton kernel), the plans of GPUs without
Mosaic GPU (A100, RTX 4090) and of Hopper shapes the Mosaic kernel does not take. Through jax, each
call of such a program pays jax's dispatch from torch (~0.1-0.2 ms of host time on the H200 host: more
than the GPU needs at shapes 2, 7 and 11). Here the bridge runs the same kernels itself:

- `program_steps` reads the plan's program (its jaxpr, nested calls inlined) into launch steps. It
  accepts only `pallas_call` (without aliasing), reshapes (free on contiguous buffers) and casts that do
  not change the bytes (same dtype, bool to int8); anything else makes the plan ineligible, with the
  primitive named, and the call runs through jax as before.
- `plan_buffers` places every intermediate array in one workspace, reusing the bytes of arrays no
  longer read (a kernel's outputs never share bytes with its inputs); the program's output is written
  straight into the tensor returned.
- Each kernel is compiled by the Triton that torch ships (`compile_kernel`), from the Triton IR that
  Pallas' lowering builds for jax's path (recorded while lowering the kernel alone; jax hands that IR
  to XLA, whose Triton compile is out of reach), with the kernel's warps and stages; the cubin is
  loaded with the CUDA driver (ctypes) into the device's primary context and launched with
  cuLaunchKernel on torch's current stream, so torch's stream order covers inputs, workspace and output
  without events. The kernel ABI is Triton's: the array parameters in order (inputs, then outputs),
  then null pointers for its scratch parameters (kernels that need scratch memory are refused).
- Per call: one workspace and one output allocation, the pointers written into one kept argument
  array, and one driver call per kernel.

Two Triton builds compile the same IR, so the outputs may differ by rounding (fp16 roundings that cascade
over the layers): before first use the bridge checks one launch and the jax path against the exact fp32
program (bridge/direct.py, check_against_exact), and runs through jax where the launch is less accurate or
where torch's Triton cannot read this jax's IR (the note says why). Needs CUDA and torch's `triton`.

Status: ON for the "rows" stack (TTJ_TRITON_LAUNCH=rows, the default; bridge/settings.py), with repeats
through the native lane (bridge/native/lane.cpp, form 4: the kernels launched from C++). On an H100
(jax 0.11.2, torch 2.11's Triton 3.6; bench/triton_kernel_diff.py, bench/results/triton-kernel-diff-
2026-12-05-h100.json) each rows kernel's outputs are within one fp16 ulp of XLA's compile, the launch is
deterministic and stream-ordered, and the harness check passes on 5 seeds at shapes 11, 2 and 7. The
fused whole-stack kernel stays behind TTJ_TRITON_LAUNCH=all: at d_model 128 (shape 2; 98 KB of shared
memory) it computed values far off the jax path's on the H200 (the check refused it) and a later launch
faulted with an illegal address; not explained yet (docs/decisions.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

# Primitives whose body is another jaxpr that runs as it is: inlined.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
          "remat", "checkpoint")
_ALIGN = 256   # bytes: every workspace array starts on this boundary (Triton assumes 16)


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class NotReplayable(ValueError):
    """The program contains something the bridge cannot run itself; the message says what."""


@dataclasses.dataclass(frozen=True)
class Ref:
    """Where an array lives: `base` indexes the call's base tensors (the program's inputs in order, then
    the workspace, then the output), `offset` is in bytes."""
    base: int
    offset: int


@dataclasses.dataclass
class Step:
    """One kernel launch: the pallas_call equation, and its inputs' and outputs' Refs."""
    eqn: Any
    inputs: list[Ref]
    outputs: list[Ref]


@dataclasses.dataclass
class Program:
    steps: list[Step]
    num_inputs: int                 # base tensors 0 .. num_inputs-1: the program's inputs (flattened)
    workspace_bytes: int            # base num_inputs
    out_shape: tuple[int, ...]      # base num_inputs + 1
    out_dtype: np.dtype

    @property
    def workspace_base(self) -> int:
        return self.num_inputs

    @property
    def output_base(self) -> int:
        return self.num_inputs + 1


def _inner_jaxpr(eqn):
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(name)
        if inner is not None:
            return inner
    return None


class _Value:
    """One array of the flattened program. A nested call's body may be one jaxpr object inlined several
    times (the layers' flash-attention calls): its vars get a fresh _Value per inlining."""
    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


def _flat_equations(jaxpr, env: dict, out: list):
    """The equations of `jaxpr` with nested calls inlined, as (primitive name, eqn, inputs, outputs),
    inputs and outputs _Values; `env` maps jaxpr's vars to them (its invars on entry)."""
    from jax.extend import core as jcore

    def value(v):   # a literal gets a _Value of its own, which no array defines (refused where read)
        return _Value(v.aval) if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        inner = _inner_jaxpr(eqn) if name in _CALLS else None
        if inner is not None:
            closed = inner if hasattr(inner, "consts") else None
            inner_jaxpr = inner.jaxpr if closed is not None else inner
            if (closed is not None and closed.consts) or inner_jaxpr.constvars:
                raise NotReplayable(f"constants inside a nested {name}")
            sub_env = dict(zip(inner_jaxpr.invars, [value(v) for v in eqn.invars]))
            _flat_equations(inner_jaxpr, sub_env, out)
            for inner_out, outer_out in zip(inner_jaxpr.outvars, eqn.outvars):
                if isinstance(inner_out, jcore.Literal):
                    raise NotReplayable(f"a nested {name} returns a literal")
                env[outer_out] = sub_env[inner_out]
            continue
        inputs = [value(v) for v in eqn.invars]
        outputs = [_Value(v.aval) for v in eqn.outvars]
        env.update(zip(eqn.outvars, outputs))
        out.append((name, eqn, inputs, outputs))


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def program_steps(closed_jaxpr) -> Program:
    """The launch steps of a program's jaxpr (module docstring), its intermediate arrays placed in one
    workspace (`plan_buffers`'s rule). Raises NotReplayable naming what it cannot run."""
    jaxpr = closed_jaxpr.jaxpr
    if closed_jaxpr.consts or jaxpr.constvars:
        raise NotReplayable("the program closes over constants")
    if len(jaxpr.outvars) != 1:
        raise NotReplayable(f"the program returns {len(jaxpr.outvars)} arrays, not one")
    equations: list = []
    program_inputs = [_Value(v.aval) for v in jaxpr.invars]
    env = dict(zip(jaxpr.invars, program_inputs))
    _flat_equations(jaxpr, env, equations)
    out_var = env.get(jaxpr.outvars[0])

    # Every var maps to the array it is a view of ("root": a program input or a kernel output).
    root: dict = {v: v for v in program_inputs}
    kernels = []   # (eqn, input roots, output vars)
    for name, eqn, invars, outvars in equations:
        if name not in ("reshape", "convert_element_type", "pallas_call"):
            raise NotReplayable(f"the program runs {name!r} outside a Pallas kernel")
        if any(v not in root for v in invars):
            raise NotReplayable(f"{name} reads a constant or literal, not an array of the program")
        if name == "reshape":
            if eqn.params.get("dimensions") is not None:
                raise NotReplayable("a reshape with transposed dimensions")
            root[outvars[0]] = root[invars[0]]
        elif name == "convert_element_type":
            old, new = np.dtype(invars[0].aval.dtype), np.dtype(outvars[0].aval.dtype)
            if not (old == new or (old == np.bool_ and new == np.int8)):   # bool bytes are 0/1: an int8 view
                raise NotReplayable(f"a cast from {old} to {new}")
            root[outvars[0]] = root[invars[0]]
        else:
            if eqn.params.get("input_output_aliases"):
                raise NotReplayable("a Pallas kernel that writes into its input")
            kernels.append((eqn, [root[v] for v in invars], outvars))
            for v in outvars:
                root[v] = v
    out_root = root.get(out_var)
    if out_root is None or out_root in program_inputs:
        raise NotReplayable("the program's output is not written by a kernel")

    inputs = {v: Ref(i, 0) for i, v in enumerate(program_inputs)}
    sizes = {}
    last_read = {}
    for index, (_, ins, outs) in enumerate(kernels):
        for v in ins:
            last_read[v] = index
        for v in outs:
            sizes[v] = _nbytes(v.aval)
    offsets, workspace = plan_buffers(
        [([v for v in outs if v is not out_root], [v for v in ins if v not in inputs]) for _, ins, outs in kernels],
        sizes, last_read)
    program = Program([], len(jaxpr.invars), workspace, tuple(out_var.aval.shape), np.dtype(out_var.aval.dtype))

    def ref(v) -> Ref:
        if v in inputs:
            return inputs[v]
        if v is out_root:
            return Ref(program.output_base, 0)
        return Ref(program.workspace_base, offsets[v])

    program.steps = [Step(eqn, [ref(v) for v in ins], [ref(v) for v in outs]) for eqn, ins, outs in kernels]
    return program


def plan_buffers(kernels: Sequence[tuple[list, list]], sizes: dict, last_read: dict) -> tuple[dict, int]:
    """Workspace offsets for the arrays kernels write: kernels[i] = (the arrays kernel i writes, the
    workspace arrays it reads); sizes in bytes; last_read[a] = the last kernel reading a. Arrays whose
    last reader has run give their bytes back (after the kernel's own outputs are placed, so no kernel
    writes over what it reads); a new array takes the smallest free block that holds it, else the end.
    Returns ({array: offset}, workspace bytes)."""
    free: list[tuple[int, int]] = []   # (size, offset) of blocks no longer read
    offsets: dict = {}
    end = 0
    for index, (writes, reads) in enumerate(kernels):
        for a in writes:
            need = _aligned(sizes[a])
            fits = [block for block in free if block[0] >= need]
            if fits:
                block = min(fits)
                free.remove(block)
                offsets[a] = block[1]
                if block[0] > need:
                    free.append((block[0] - need, block[1] + need))
            else:
                offsets[a], end = end, end + need
        for a in set(reads) | set(writes):
            if last_read.get(a, -1) <= index and a in offsets:   # read for the last time (or never read)
                free.append((_aligned(sizes[a]), offsets[a]))
    return offsets, end


# --- Compiling a kernel with torch's Triton -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelBinary:
    name: str              # the kernel's entry
    image: bytes           # what the driver loads: a cubin
    grid: tuple[int, int, int]
    num_warps: int
    shared_bytes: int
    num_params: int        # the arrays, then Triton's scratch pointers (passed null)
    entry: str = ""        # the PTX entry's declaration (diagnostics)


_capture_lock = threading.Lock()


@contextlib.contextmanager
def _recorded_modules():
    """The Triton modules (and grids) pallas_call's lowering builds, recorded for lowerings on this thread
    only (other threads may be compiling plans meanwhile)."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    real = registration.lowering
    thread = threading.get_ident()
    seen: list = []

    class Recorder:
        def __getattr__(self, name):
            return getattr(real, name)

        def lower_jaxpr_to_triton_module(self, *args, **kwargs):
            result = real.lower_jaxpr_to_triton_module(*args, **kwargs)
            if threading.get_ident() == thread:
                seen.append(result)
            return result

    with _capture_lock:
        registration.lowering = Recorder()
        try:
            yield seen
        finally:
            registration.lowering = real


def _grid3(grid) -> tuple[int, int, int]:
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    return tuple(int(g) for g in grid) + (1,) * (3 - len(grid))


def triton_ir(eqn) -> tuple[list[str], tuple[int, int, int]]:
    """The Triton IR jax's path hands to XLA for one pallas_call equation: the module as text (pretty and
    generic forms) and the grid."""
    import jax
    from jax._src.pallas.pallas_call import pallas_call_p
    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    params = dict(eqn.params)

    def kernel(*args):
        return pallas_call_p.bind(*args, **params)

    with _recorded_modules() as seen:
        jax.jit(kernel).lower(*structs)
    if len(seen) != 1:
        raise NotReplayable(f"lowering the kernel built {len(seen)} Triton modules, not one")
    operation = seen[0].module.operation
    texts = [operation.get_asm(enable_debug_info=False), operation.get_asm(print_generic_op_form=True)]
    return texts, _grid3(seen[0].grid)


_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)", re.S)


def ptx_entry(ptx: str) -> tuple[str, int, str]:
    """(name, number of parameters, declaration) of the PTX's one kernel entry."""
    entries = list(_ENTRY.finditer(ptx))
    if len(entries) != 1:
        raise NotReplayable(f"the PTX has {len(entries)} kernel entries, not one")
    name, params = entries[0].groups()
    return name, params.count(".param"), entries[0].group(0)


def compile_kernel(eqn) -> KernelBinary:
    """One pallas_call equation's Triton kernel, compiled by the Triton that torch ships (`triton`) from the
    Triton IR Pallas lowers it to (jaxlib's own Triton compile runs inside XLA, out of reach)."""
    import tempfile

    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise RuntimeError(f"torch's Triton is not importable: {e}") from e
    texts, grid = triton_ir(eqn)
    compiler_params = eqn.params.get("compiler_params")
    num_warps = getattr(compiler_params, "num_warps", None) or 4
    num_stages = getattr(compiler_params, "num_stages", None) or 3
    major, minor = torch.cuda.get_device_capability()
    target = GPUTarget("cuda", 10 * major + minor, 32)
    errors = []
    compiled = None
    with tempfile.TemporaryDirectory() as directory:
        for form, text in zip(("text", "generic text"), texts):
            path = os.path.join(directory, f"kernel_{len(errors)}.ttir")
            with open(path, "w") as f:
                f.write(text)
            try:
                compiled = triton.compile(path, target=target, options={"num_warps": num_warps,
                                                                       "num_stages": num_stages})
                break
            except Exception as e:   # noqa: BLE001 - a parse or compile error of this Triton: try the next form
                errors.append(f"{form}: {type(e).__name__}: {str(e)[:300]}")
    if compiled is None:
        raise NotReplayable(f"torch's Triton {triton.__version__} cannot compile the Triton IR of this jax: "
                            + "; ".join(errors))
    metadata = compiled.metadata
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(metadata, scratch, 0):
            raise NotReplayable(f"the kernel needs Triton's {scratch.replace('_', ' ')} ({getattr(metadata, scratch)})")
    if getattr(metadata, "num_ctas", 1) != 1:
        raise NotReplayable(f"a kernel of {metadata.num_ctas} CTAs per cluster")
    name, num_params, declaration = ptx_entry(compiled.asm.get("ptx", ""))
    arrays = len(eqn.invars) + len(eqn.outvars)
    if num_params < arrays:
        raise NotReplayable(f"the kernel takes {num_params} parameters for {arrays} arrays")
    return KernelBinary(name, compiled.asm["cubin"], grid, metadata.num_warps, metadata.shared, num_params,
                        declaration)


_COMPILED: dict = {}


def _compiled(eqn) -> KernelBinary:
    """compile_kernel, once per distinct kernel (the layers' flash-attention calls are one kernel)."""
    try:
        key = (tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars), tuple(sorted(eqn.params.items())))
        hash(key)
    except TypeError:
        return compile_kernel(eqn)
    binary = _COMPILED.get(key)
    if binary is None:
        binary = _COMPILED[key] = compile_kernel(eqn)
    return binary


def unavailable_reason(device: torch.device, stack: str = "rows") -> str | None:
    """Why the bridge cannot launch the Triton kernels of a `stack` plan's program itself on `device`,
    or None."""
    from bridge import settings
    if stack not in settings.triton_launch_stacks():
        return (f"the bridge's own launch of the {stack} stack's Triton kernels is off "
                f"({settings.TRITON_LAUNCH_ENV}={'all' if stack == 'rows' else 'all, an experiment'} turns it on)")
    if device.type != "cuda":
        return f"x is on {device}, not a CUDA device"
    if torch.version.cuda is None:
        return "this torch is not a CUDA build"
    return None


# The model widths at which the rows stack's kernels, compiled by torch's Triton, have run on a GPU
# (bench/triton_kernel_diff.py and bench/mosaic_launch_check.py on an H100: shapes 2, 7, 11, 13). The
# width sets the kernels' tiles and shared memory; the fused kernel's unexplained fault (module docstring)
# is why a new width waits for a GPU run before the bridge launches it by default.
ROWS_GPU_VERIFIED_D_MODELS = (32, 128)


def config_reason(stack: str, d_model: int) -> str | None:
    """Why the bridge does not launch this stack's kernels for this model width by default, or None."""
    from bridge import settings
    if stack == "rows" and d_model not in ROWS_GPU_VERIFIED_D_MODELS and not settings.triton_launch_any_width():
        return (f"d_model {d_model}: the bridge launches the rows kernels at the widths they have run at on a GPU, "
                f"{ROWS_GPU_VERIFIED_D_MODELS} ({settings.TRITON_LAUNCH_ENV}=all launches them at any width)")
    return None


def kernels_for(device: torch.device) -> Callable | None:
    """How a Program's kernels run on `device`: None, the CUDA launch (CudaKernels); tests on the CPU
    substitute InterpretedKernels here."""
    return None


# --- The CUDA driver ---------------------------------------------------------------------------------

_STATIC_SHARED_LIMIT = 49152
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class _Driver:
    """The few CUDA driver entry points the launch needs, through ctypes."""

    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"the CUDA driver library is not loadable: {e}") from e
        vp, u = ctypes.c_void_p, ctypes.c_uint
        self.lib = lib
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_int]
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        lib.cuLaunchKernel.restype = ctypes.c_int
        self.launch = lib.cuLaunchKernel

    def check(self, status: int, what: str) -> None:
        if status != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {(name.value or b'?').decode()} ({status})")

    def load(self, binary: KernelBinary) -> int:
        """The kernel loaded into the current context; its function handle."""
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), binary.image),
                   f"loading {binary.name}")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, binary.name.encode()),
                   f"finding {binary.name}")
        if binary.shared_bytes > _STATIC_SHARED_LIMIT:
            self.check(self.lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   binary.shared_bytes), f"shared memory for {binary.name}")
        return function.value


_DRIVER: list[_Driver] = []


def _driver() -> _Driver:
    if not _DRIVER:
        _DRIVER.append(_Driver())
    return _DRIVER[0]


# --- The launch --------------------------------------------------------------------------------------

def launch_specs(program: Program, binaries: Sequence[KernelBinary], functions: Sequence[int]) -> list[tuple]:
    """Per kernel, how the native lane (bridge/native/lane.cpp, form 4) launches it: (function handle, grid
    x, y, z, block x, dynamic shared bytes, per parameter the slot of its array among all kernels' arrays
    in order (the steps' inputs then outputs), or -1 for Triton's scratch parameters, passed null)."""
    specs, first = [], 0
    for step, binary, function in zip(program.steps, binaries, functions):
        arrays = len(step.inputs) + len(step.outputs)
        slots = list(range(first, first + arrays)) + [-1] * (binary.num_params - arrays)
        specs.append((function, *binary.grid, 32 * binary.num_warps, binary.shared_bytes, slots))
        first += arrays
    return specs


class CudaKernels:
    """Launches a Program's kernels on raw pointers: one kept array of the arrays' pointer values for all
    kernels (written per call in one slice assignment), and per kernel its cuLaunchKernel arguments built
    once."""

    def __init__(self, program: Program, device: torch.device, compile: Callable = _compiled):
        from bridge.mosaic_launch import current_stream_getter
        driver = _driver()
        binaries = [compile(step.eqn) for step in program.steps]
        self.binaries = binaries
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)   # the primary context exists and is current
            loaded: dict = {}   # a kernel launched several times is loaded once
            for binary in binaries:
                if binary not in loaded:
                    loaded[binary] = driver.load(binary)
            functions = [loaded[b] for b in binaries]
        self._refs = [ref for step in program.steps for ref in step.inputs + step.outputs]
        # The arrays' pointer values, all kernels' in order, written per call; one last slot stays 0, the
        # null every scratch parameter points to.
        self._values = (ctypes.c_uint64 * (len(self._refs) + 1))()
        base = ctypes.addressof(self._values)
        null = base + 8 * len(self._refs)
        # The native lane's specs (launch_specs), and from them each kernel's cuLaunchKernel arguments here:
        # its parameters point at its arrays' slots in self._values (a scratch parameter at the null slot).
        self.kernel_specs = launch_specs(program, binaries, functions)
        self._launches = []
        for function, gx, gy, gz, bx, shared, slots in self.kernel_specs:
            params = (ctypes.c_void_p * len(slots))(*[null if slot < 0 else base + 8 * slot for slot in slots])
            self._launches.append((function, gx, gy, gz, bx, 1, 1, shared, params))
        self._stream = current_stream_getter(device)
        self._check = driver.check
        self._launch = driver.launch
        self.num_kernels = len(binaries)
        self._lock = threading.Lock()

    @property
    def refs(self) -> list[Ref]:
        return self._refs

    @property
    def launch_address(self) -> int:
        """cuLaunchKernel's address (the native lane calls it)."""
        return ctypes.cast(self._launch, ctypes.c_void_p).value

    def current_stream(self) -> int:
        return self._stream()

    def __call__(self, pointers: Sequence[int]) -> None:
        stream = self._stream()
        launch = self._launch
        # ctypes lets go of the GIL during each driver call: the lock keeps another thread from rewriting
        # the kept pointer values between this call's launches.
        with self._lock:
            self._values[:len(self._refs)] = [pointers[r.base] + r.offset for r in self._refs]
            for function, gx, gy, gz, bx, by, bz, shared, params in self._launches:
                status = launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, None)
                if status:
                    self._check(status, "launching a Triton kernel")


class TritonProgramLaunch:
    """A plan's program (`run(weights, x, mask)`) run by launching its Triton kernels on torch tensors:
    `launch(x, mask, weight_tensors)` returns a new output tensor. weight_tensors: the leaves of the
    weights pytree the program was traced with, as torch tensors, in jax's flattening order; x and the
    mask as the program takes them (contiguous; the mask bool). Built per input signature: traces the
    program, compiles and loads its kernels (raises NotReplayable, or RuntimeError where the driver or
    jaxlib cannot)."""

    def __init__(self, run: Callable, weights, x_struct, mask_struct, device: torch.device,
                 kernels: Callable | None = None):
        import jax
        closed = jax.make_jaxpr(run)(weights, x_struct, mask_struct)
        self.program = program_steps(closed)
        self.num_weights = len(jax.tree_util.tree_leaves(weights))
        expected = self.num_weights + 1 + (mask_struct is not None)
        if self.program.num_inputs != expected:
            raise NotReplayable(f"the program takes {self.program.num_inputs} inputs, expected {expected}")
        self.device = device
        self.out_dtype = getattr(torch, self.program.out_dtype.name)
        self._kernels = kernels(self.program) if kernels is not None else CudaKernels(self.program, device)
        self._takes_pointers = isinstance(self._kernels, CudaKernels)
        self.num_kernels = len(self.program.steps)
        self.mode = "masked" if mask_struct is not None else "plain"   # how the call uses the mask (direct.lane_mask_mode)
        self.kernel = self   # what the native lane asks for the stream and the launch (as MosaicStackLaunch)

    def current_stream(self) -> int:
        """The raw handle of torch's current stream on this device (0: the default stream)."""
        return self._kernels.current_stream() if self._takes_pointers else 0

    def native_call(self) -> dict | None:
        """The native lane's launch of this program (bridge/native/lane.cpp, form 4), as keyword arguments
        of its Lane: cuLaunchKernel's address, the kernels, each kernel array's (buffer, byte offset) in the
        lane's buffer order (x, the mask where the program takes one, the weights, the output, the
        workspace), the workspace's size. None where the kernels are not launched through the driver."""
        if not self._takes_pointers:
            return None
        program, masked = self.program, self.mode == "masked"
        weights = self.num_weights
        lane_index = {weights: 0, program.workspace_base: 2 + masked + weights, program.output_base: 1 + masked + weights}
        if masked:
            lane_index[weights + 1] = 1
        lane_index.update({b: 1 + masked + b for b in range(weights)})
        return {"entry": self._kernels.launch_address, "form": 4, "entry_args": [],
                "num_buffers": 3 + masked + weights, "keep_alive": self,
                "kernels": self._kernels.kernel_specs,
                "refs": [(lane_index[r.base], r.offset) for r in self._kernels.refs],
                "workspace_bytes": program.workspace_bytes}

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """The program's output. `mask` is read only where the program takes one (mode "masked"): a call
        whose plan needs no mask (the harness's all-True mask, say) may pass it and it is ignored."""
        program = self.program
        if self.mode == "masked" and mask is None:
            raise ValueError("this program takes a mask")
        workspace = torch.empty(max(program.workspace_bytes, 1), dtype=torch.uint8, device=self.device)
        out = torch.empty(program.out_shape, dtype=self.out_dtype, device=self.device)
        tensors = [*weights, x] + ([mask] if self.mode == "masked" else []) + [workspace, out]
        if self._takes_pointers:
            self._kernels([t.data_ptr() for t in tensors])
        else:
            self._kernels(tensors)
        return out


class InterpretedKernels:
    """The CPU twin of CudaKernels (tests): each step's pallas_call evaluated by jax on views of the same
    base tensors, at the same workspace offsets, so the dataflow and the buffer plan are what the GPU
    launch runs."""

    def __init__(self, program: Program):
        self.program = program

    def __call__(self, tensors: Sequence[torch.Tensor]) -> None:
        import jax
        from jax._src.pallas.pallas_call import pallas_call_p

        def view(ref: Ref, aval) -> torch.Tensor:
            base = tensors[ref.base]
            flat = base.reshape(-1).view(torch.uint8)
            dtype = getattr(torch, np.dtype(aval.dtype).name) if np.dtype(aval.dtype) != np.bool_ else torch.bool
            size = _nbytes(aval)
            return flat[ref.offset:ref.offset + size].view(dtype).view(tuple(aval.shape))

        for step in self.program.steps:
            args = [jax.numpy.asarray(view(r, v.aval).numpy()) for r, v in zip(step.inputs, step.eqn.invars)]
            results = pallas_call_p.bind(*args, **step.eqn.params)
            for r, v, value in zip(step.outputs, step.eqn.outvars, results):
                view(r, v.aval).copy_(torch.from_numpy(np.array(value)))
