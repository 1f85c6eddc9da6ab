"""The bridge's launch-bound fast path: the fused whole-stack kernel launched on torch tensors, no JAX dispatch.

For calls the planner gives to the fused kernel (`Plan.stack == "fused"`: mask-free, short sequences),
the work on the GPU is one kernel, and what a bridge call costs on the host decides the time the
harness sees (SPEC section 2: host time counts wherever the GPU idles). Through jax that host time is a
jitted call's dispatch plus a DLPack import and export (bench/results/bridge-profile-*.json). Here the
kernel that Pallas generates from ttj_jax/kernels/fused_stack.py (`fused_stack.direct_launch`) is
compiled once by XLA, as for the jax path (its PTX read from XLA's dump of that one compilation:
compat.xla_kernel_ptx), loaded with the CUDA driver, and each call launches it with the torch tensors'
pointers: one output allocation and one `cuLaunchKernel`.

(The Triton that ships with torch compiles the same IR too, but its build of the S=128, d=128 kernel gave
wrong results on the H200 while jaxlib's was exact: bench/results/direct-debug-2026-11-30-h200.log.)

Stream order is torch's own: the kernel runs on the caller's current stream, after whatever torch queued
there (x's producers) and before whatever it queues next (y's consumers); no event, no host sync. The
weights are the fused layout built by jax from the module's parameters once per weight version
(runtime.py keeps them as torch-owned tensors). One DirectKernel holds one parameter buffer: launch it
from one thread at a time.

Availability: CUDA, jax's GPU backend and libcuda; `unavailable_reason()`
says why not, and the bridge then runs the same kernel through jax.
"""

from __future__ import annotations

import ctypes
import os
import re
import weakref

import torch

from ttj_jax.kernels.fused_stack import DirectLaunch

# Direct launches for grids up to this many programs (a few waves on the H200's 132 SMs); larger calls
# are long enough on the GPU that jax's dispatch cost does not show, so they run through jax.
MAX_PROGRAMS = 1024
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CUDA_ERROR_INVALID_CONTEXT = 201
_DRIVER = None


def _driver():
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = ctypes.CDLL("libcuda.so.1")
        _DRIVER.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _DRIVER.cuModuleUnload.argtypes = [ctypes.c_void_p]
    return _DRIVER


def _check(result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: CUDA error {result} ({(name.value or b'?').decode()})")


def entry_parameters(ptx: str, name: str) -> list[str]:
    """The parameter types of PTX entry `name`, in order (e.g. ['.u64', '.u64', ...])."""
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if match is None:
        raise ValueError(f"no .entry {name} in the PTX")
    return re.findall(r"\.param\s+(\.\w+)", match.group(1))


def _single_entry(ptx_texts: list[str], name: str) -> tuple[str, str]:
    """(PTX, entry name) of the kernel called `name` (or the only kernel) among XLA's dumped modules."""
    entries = [(text, entry) for text in ptx_texts for entry in re.findall(r"\.entry\s+(\w+)", text)]
    named = [(t, e) for t, e in entries if name in e]
    chosen = named if len(named) == 1 else entries if len(entries) == 1 else []
    if not chosen:
        raise RuntimeError(f"expected one kernel {name!r} in XLA's PTX, found {[e for _, e in entries]}")
    return chosen[0]


def unavailable_reason(device: torch.device) -> str | None:
    """Why the direct launch cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"the direct launch needs a CUDA device, x is on {device}"
    if os.environ.get("TTJ_DIRECT_LAUNCH", "1") == "0":
        return "disabled by TTJ_DIRECT_LAUNCH=0"
    try:
        _driver()
    except OSError as e:
        return f"libcuda is not loadable ({e})"
    try:
        import jax
        jax.devices("gpu")
    except RuntimeError as e:
        return f"jax has no GPU backend here ({e})"
    return None


class DirectKernel:
    """One DirectLaunch compiled for one CUDA device. `kernel(*tensors)` launches it on torch's current
    stream of that device; the tensors are its arguments in DirectLaunch's order (contiguous, on the
    device, of the dtypes the IR was lowered for: the caller guarantees it, nothing is checked here).
    PTX parameters past those (Triton's scratch pointers, unused by this kernel: it asks for no scratch)
    are passed as null."""

    def __init__(self, spec: DirectLaunch, device: torch.device):
        from ttj_jax.compat import xla_kernel_ptx
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.spec, self.device_index = spec, index
        self.ptx, self.entry = _single_entry(xla_kernel_ptx(spec.function, *spec.arg_structs), spec.name)
        threads = re.search(r"\.entry\s+" + re.escape(self.entry) + r"\s*\(.*?\)\s*\.(?:reqntid|maxntid)\s+(\d+)",
                            self.ptx, re.S)
        if threads and int(threads.group(1)) != 32 * spec.num_warps:
            raise RuntimeError(f"PTX entry {self.entry} wants {threads.group(1)} threads, the spec "
                               f"{32 * spec.num_warps}")
        # Triton's shared memory is dynamic and its size is not in the PTX: reserve the device's opt-in
        # maximum (safe for any size the compiler chose; the kernel is register-bound to one block per SM).
        self.shared_bytes = getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin",
                                    227 * 1024)
        parameters = entry_parameters(self.ptx, self.entry)
        self.arguments = 1 + 14 + 1
        extra = parameters[self.arguments:]
        if len(parameters) < self.arguments or any(p not in (".u64", ".b64") for p in parameters):
            raise RuntimeError(f"PTX entry {spec.name} takes {parameters}; expected {self.arguments} "
                               "pointers (and optional scratch pointers)")
        driver = _driver()
        with torch.cuda.device(index):
            torch.cuda.current_stream(index)   # torch's primary context is current on this thread
            self._context = ctypes.c_void_p()
            _check(driver.cuCtxGetCurrent(ctypes.byref(self._context)), "cuCtxGetCurrent")
            module, function = ctypes.c_void_p(), ctypes.c_void_p()
            _check(driver.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(self.ptx.encode() + b"\0")),
                   "cuModuleLoadData")
            weakref.finalize(self, _unload, module.value)
            _check(driver.cuModuleGetFunction(ctypes.byref(function), module, self.entry.encode()),
                   "cuModuleGetFunction")
            if self.shared_bytes > 48 * 1024:
                _check(driver.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                 self.shared_bytes), "cuFuncSetAttribute")
        self._function = function
        # One parameter block, reused: cuLaunchKernel copies the values at launch.
        self._values = (ctypes.c_uint64 * len(parameters))()
        address = ctypes.addressof(self._values)
        self._params = (ctypes.c_void_p * len(parameters))(*[address + 8 * i for i in range(len(parameters))])
        self._extra_nulls = [0] * len(extra)
        self._block = 32 * spec.num_warps
        self._launch = driver.cuLaunchKernel
        try:
            self._stream_of = torch._C._cuda_getCurrentRawStream   # private; ~1 us against ~3 public
            self._stream_of(index)
        except (AttributeError, RuntimeError):
            self._stream_of = lambda i: torch.cuda.current_stream(i).cuda_stream

    def __call__(self, *tensors: torch.Tensor) -> None:
        self._values[:] = [t.data_ptr() for t in tensors] + self._extra_nulls
        gx, gy, gz = self.spec.grid
        result = self._launch(self._function, gx, gy, gz, self._block, 1, 1, self.shared_bytes,
                              self._stream_of(self.device_index), self._params, None)
        if result == _CUDA_ERROR_INVALID_CONTEXT:   # a thread that never touched CUDA: use torch's context
            _check(_driver().cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
            result = self._launch(self._function, gx, gy, gz, self._block, 1, 1, self.shared_bytes,
                                  self._stream_of(self.device_index), self._params, None)
        _check(result, "cuLaunchKernel")


def _unload(module: int) -> None:
    try:
        _driver().cuModuleUnload(module)
    except Exception:   # interpreter shutdown: the driver may already be gone
        pass
