"""The bridge's launch-bound fast path: the fused whole-stack kernel launched on torch tensors, no JAX dispatch.

For calls the planner gives to the fused kernel (`Plan.stack == "fused"`: mask-free, short sequences),
the work on the GPU is one kernel, and what a bridge call costs on the host decides the time the
harness sees (SPEC section 2: host time counts wherever the GPU idles). Through jax that host time is a
jitted call's dispatch plus a DLPack import and export (bench/results/bridge-profile-*.json). Here the
kernel that Pallas generates from ttj_jax/kernels/fused_stack.py (`fused_stack.direct_launch`) is
compiled once to PTX by jaxlib's own Triton compiler (the pipeline XLA builds it with for the jax path,
compat.triton_ptx; else from jax's serialization of that executable, compat.xla_gpu_images, which held
nothing in jax 0.11), loaded with the CUDA driver, and each call launches it with the
torch tensors' pointers: one output allocation and one `cuLaunchKernel`. Before first use the bridge
compares one launch with the jax path's output on the same input, and falls back to jax on a mismatch.

(The Triton that ships with torch compiles the same IR too, but its build of the S=128, d=128 kernel gave
wrong results on the H200 while jaxlib's was exact: bench/results/direct-debug-2026-11-30-h200.log.)

Stream order is torch's own: the kernel runs on the caller's current stream, after whatever torch queued
there (x's producers) and before whatever it queues next (y's consumers); no event, no host sync. The
weights are the fused layout built by jax from the module's parameters once per weight version
(runtime.py keeps them as torch-owned tensors). One DirectKernel holds one parameter buffer: launch it
from one thread at a time.

Availability: opt-in with TTJ_DIRECT_LAUNCH=1 (until bench.direct_check has passed on a GPU: an earlier
build crashed the CUDA context there), CUDA, jax's GPU backend and libcuda; `unavailable_reason()`
says why not, and the bridge then runs the same kernel through jax. With jax 0.11.2 (the H200 machine's)
no build is found at all: its jaxlib exposes no Triton compiler and XLA's executable holds no cubin or PTX
for the kernel (bench/results/direct-2026-11-30-nvidia-h200-session5.json).
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


def unavailable_reason(device: torch.device) -> str | None:
    """Why the direct launch cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"the direct launch needs a CUDA device, x is on {device}"
    if os.environ.get("TTJ_DIRECT_LAUNCH", "0") != "1":
        return ("the direct launch is opt-in (TTJ_DIRECT_LAUNCH=1) until this build of it has passed "
                "`python -m bench.direct_check` on a GPU")
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
    Kernel parameters past those (Triton's scratch pointers, unused by this kernel) are passed as null.
    The bridge checks a new DirectKernel against the jax path once before using it (runtime.py)."""

    def __init__(self, spec: DirectLaunch, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.spec, self.device_index = spec, index
        self.arguments = spec.argument_count
        driver = _driver()
        with torch.cuda.device(index):
            torch.cuda.current_stream(index)   # torch's primary context is current on this thread
            self._context = ctypes.c_void_p()
            _check(driver.cuCtxGetCurrent(ctypes.byref(self._context)), "cuCtxGetCurrent")
            images, errors = kernel_images(spec, torch.cuda.get_device_capability(index))
            if not images:
                raise RuntimeError("no build of the kernel: " + "; ".join(errors))
            for kind, image, shared_bytes in images:
                try:
                    self._load(kind, image)
                    break
                except RuntimeError as e:
                    errors.append(f"{kind}: {e}")
            else:
                raise RuntimeError("no loadable kernel image: " + "; ".join(errors))
        # Triton's shared memory is dynamic: the size its compiler reported, else the device's opt-in
        # maximum (safe for any size the compiler chose; the kernel is register-bound to one block per SM).
        self.shared_bytes = shared_bytes if shared_bytes is not None else getattr(
            torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 227 * 1024)
        if self.shared_bytes > 48 * 1024:
            _check(driver.cuFuncSetAttribute(self._function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                             self.shared_bytes), "cuFuncSetAttribute")
        # One parameter block, reused: cuLaunchKernel copies the values at launch.
        self._values = (ctypes.c_uint64 * self.parameter_count)()
        address = ctypes.addressof(self._values)
        self._params = (ctypes.c_void_p * self.parameter_count)(
            *[address + 8 * i for i in range(self.parameter_count)])
        self._extra_nulls = [0] * (self.parameter_count - self.arguments)
        self._block = 32 * spec.num_warps
        self._launch = driver.cuLaunchKernel
        try:
            self._stream_of = torch._C._cuda_getCurrentRawStream   # private; ~1 us against ~3 public
            self._stream_of(index)
        except (AttributeError, RuntimeError):
            self._stream_of = lambda i: torch.cuda.current_stream(i).cuda_stream

    def _load(self, kind: str, image: bytes) -> None:
        driver = _driver()
        module = ctypes.c_void_p()
        data = image + b"\0" if kind == "ptx" else image
        _check(driver.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(data)), f"cuModuleLoadData({kind})")
        names = _function_names(module) if kind == "cubin" else re.findall(rb"\.entry\s+(\w+)", image)
        names = [n.decode() if isinstance(n, bytes) else n for n in names]
        chosen = [n for n in names if self.spec.name in n] or names
        if len(chosen) != 1:
            driver.cuModuleUnload(module)
            raise RuntimeError(f"expected one kernel {self.spec.name!r}, the image has {names}")
        self.entry = chosen[0]
        function = ctypes.c_void_p()
        _check(driver.cuModuleGetFunction(ctypes.byref(function), module, self.entry.encode()),
               "cuModuleGetFunction")
        sizes = _parameter_sizes(function)
        if sizes is None and kind == "ptx":
            sizes = [8 if t in (".u64", ".b64") else 0 for t in entry_parameters(image.decode(), self.entry)]
        if sizes is None or len(sizes) < self.arguments or any(size != 8 for size in sizes):
            driver.cuModuleUnload(module)
            raise RuntimeError(f"kernel {self.entry} takes parameters of sizes {sizes}; expected "
                               f"{self.arguments} pointers (and optional scratch pointers)")
        weakref.finalize(self, _unload, module.value)
        self.kind, self._function, self.parameter_count = kind, function, len(sizes)

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


def kernel_images(spec: DirectLaunch, capability: tuple[int, int]):
    """([(kind, image, shared memory bytes or None), ...] in the order to try, [why a source failed]).
    First jaxlib's own Triton compiler on the kernel's IR (compat.triton_ptx: XLA's pipeline, the build
    the jax path runs), then whatever XLA's serialized executable holds (compat.xla_gpu_images; jax 0.11's
    held nothing: bench/results/direct-2026-11-30-nvidia-h200-session3.json)."""
    from ttj_jax.compat import triton_ptx, xla_gpu_images
    images, errors = [], []
    try:
        build = triton_ptx(spec.ttir, f"{capability[0]}.{capability[1]}", num_warps=spec.num_warps,
                           num_stages=spec.num_stages)
        images.append(("ptx", build.ptx, build.shared_bytes))
    except RuntimeError as e:
        errors.append(f"jaxlib's Triton compiler: {e}")
    try:
        found = sorted(xla_gpu_images(spec.function, *spec.arg_structs), key=lambda i: i[0] != "cubin")
        images.extend((kind, image, None) for kind, image in found)
        if not found:
            errors.append("XLA's compiled executable holds no cubin or PTX for the kernel")
    except Exception as e:   # noqa: BLE001 - one source failing leaves the other
        errors.append(f"XLA's executable: {type(e).__name__}: {e}")
    return images, errors


def _function_names(module: ctypes.c_void_p) -> list[str]:
    """Names of the kernels in a loaded module (CUDA 12.4+ driver API)."""
    driver = _driver()
    count = ctypes.c_uint()
    _check(driver.cuModuleGetFunctionCount(ctypes.byref(count), module), "cuModuleGetFunctionCount")
    functions = (ctypes.c_void_p * count.value)()
    _check(driver.cuModuleEnumerateFunctions(functions, count, module), "cuModuleEnumerateFunctions")
    names = []
    for function in functions:
        name = ctypes.c_char_p()
        _check(driver.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(function)), "cuFuncGetName")
        names.append(name.value.decode())
    return names


def _parameter_sizes(function: ctypes.c_void_p) -> list[int] | None:
    """Byte sizes of a kernel's parameters, in order (cuFuncGetParamInfo, CUDA 12.4+), or None."""
    driver = _driver()
    if not hasattr(driver, "cuFuncGetParamInfo"):
        return None
    sizes = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while driver.cuFuncGetParamInfo(function, ctypes.c_size_t(len(sizes)), ctypes.byref(offset),
                                    ctypes.byref(size)) == 0:
        sizes.append(size.value)
        if len(sizes) > 256:
            break
    return sizes


def _unload(module: int) -> None:
    try:
        _driver().cuModuleUnload(module)
    except Exception:   # interpreter shutdown: the driver may already be gone
        pass
