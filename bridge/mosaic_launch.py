"""The bridge's launch of the Mosaic GPU whole-stack kernel on torch tensors: no JAX dispatch, no DLPack.

For calls the planner gives to `Plan.stack == "fused_mgpu"` (Hopper, mask-free, fp32, the shapes
kernels/fused_stack_mgpu.py takes), the GPU work is one kernel of ~60-120 us, and a call through jax
costs the bridge more host time than that. So the bridge compiles the kernel once, with the compiler and
launcher jaxlib ships for `plgpu.as_torch_kernel` (compat.mosaic_gpu_module + MosaicLauncher below), and
each call is one output allocation and one launch with the tensors' pointers (MosaicLauncher).
Everything about the kernel (function, argument layout, output) comes from `fused_stack_mgpu.launch_spec`.

Stream order: the launcher launches on torch's default stream. A caller on the default stream (the
harness) gets torch's own ordering: no event, no host sync. A caller on another stream gets two cached
events per call: the default stream waits for the caller's queued work, the caller's stream for the
kernel. The weights are the kernel's layout built by jax from the module's parameters once per weight
version, kept as torch-owned tensors (runtime.py), so torch's allocator orders their reuse after the
kernels that read them. Before first use the bridge compares one launch with the jax path's output on
the same input.

Switch off with TTJ_MOSAIC_LAUNCH=0 (bridge/settings.py; the bridge then runs the same kernel through jax).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from bridge import settings
from ttj_jax.config import Config
from ttj_jax.device import FORCE_DEVICE_ENV, forced_compute_capability


def unavailable_reason(device: torch.device) -> str | None:
    """Why the bridge cannot launch Mosaic GPU kernels itself on `device`, or None."""
    if not settings.mosaic_launch():
        return f"{settings.MOSAIC_LAUNCH_ENV}=0"
    forced = forced_compute_capability()
    if forced is not None and not forced.startswith("9"):
        return f"{FORCE_DEVICE_ENV} plans as compute capability {forced}, not sm_90 (Hopper)"
    if device.type != "cuda":
        return f"x is on {device}, not a CUDA device"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"{torch.cuda.get_device_name(device)} is not sm_90 (Hopper)"
    return None


def current_stream_getter(device: torch.device):
    """A zero-argument callable returning the raw cudaStream_t of torch's current stream on `device`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # what torch's own generated code calls
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


class MosaicLauncher:
    """A Mosaic GPU module (mosaic_gpu_module) compiled and loaded once by jax's own launcher for torch
    (`_compile_as_torch_gpu_kernel`, what `plgpu.as_torch_kernel` uses: jaxlib's MosaicGpuCompile), and
    launched with raw device pointers: `launch(pointers)`, the kernel's inputs then its outputs (ints).
    It launches on torch's DEFAULT stream of the device current at construction; the caller orders
    that stream against its own (MosaicStackLaunch). Skips as_torch_kernel's per-call tracing lookup,
    pytree and dtype checks (~66 us per call on the H200 host). Where jax's launcher holds its
    compiled host entry in a form known here (the closure of its `launch`, _direct_entry), the launch
    calls that entry with arguments built once: per call, the pointers are written into a kept buffer
    and one ctypes call launches, where jax's `launch` builds a torch Stream object (and, in jax 0.10,
    the argument structures) on every call. Else jax's `launch` runs as it is. On the H200 with jax
    0.11.2 (`bench/mosaic_launch_check.py --shapes 2`): 19.5 us of host time per bridge call, against
    56.0 us through jax's `launch` in the run before (`bench/results/mosaic-launch-2026-12-04-h200*.json`).
    (A launcher of our own calling the compiled host
    entry with the caller's stream, not the default one, aborted on the H200 with "cuTensorMapEncodeTiled
    failed: invalid argument", cause not found.)"""

    def __init__(self, module_asm: bytes, num_buffers: int):
        import jax
        try:
            from jax.experimental.mosaic.gpu import core as mgpu_core
            compile_for_torch = mgpu_core._compile_as_torch_gpu_kernel
        except (ImportError, AttributeError) as e:
            raise RuntimeError(f"this jax ({jax.__version__}) has no Mosaic GPU launcher for torch: {e}") from e
        if not torch.cuda.is_available():
            raise RuntimeError("MosaicLauncher needs a CUDA device (torch sees none)")
        self._launch, _ = compile_for_torch(module_asm)   # (launch, unload): loaded for the process's lifetime
        self.buffers = (ctypes.c_void_p * num_buffers)()
        self._lock = threading.Lock()
        self._num_buffers = num_buffers
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._entry, self._entry_args = self._direct_entry(self._launch, self.buffers, self._device)

    @property
    def direct(self) -> bool:
        """Whether launches call jax's host entry with the kept arguments (else jax's `launch`)."""
        return self._entry is not None

    @staticmethod
    def _direct_entry(launch, buffers, device):
        """(jax's compiled host entry, its arguments built once) from `launch`'s closure, or (None, None)
        where this jax's launcher holds neither of the two forms known:
        - entry(function, stream, buffers) (jax 0.11): the loaded function's handle (an int) in the
          closure; the default stream's handle and `buffers` are fixed, so all three are built once;
        - entry(args) (jax 0.10): args an array of pointers to the module context (in the closure), to
          the default stream's handle and to the pointer to `buffers`; the objects behind them are kept
          on the array, so they live as long as it does."""
        closure = getattr(launch, "__closure__", None)
        if closure is None:
            return None, None
        values = []
        for cell in closure:
            try:
                values.append(cell.cell_contents)
            except ValueError:   # an empty cell
                pass
        entries = [v for v in values if isinstance(v, ctypes._CFuncPtr)]
        if len(entries) != 1:
            return None, None
        entry, arity = entries[0], len(getattr(entries[0], "argtypes", None) or ())
        handles = [v for v in values if type(v) is int]
        pointers = [v for v in values if isinstance(v, ctypes._Pointer)]
        stream = ctypes.c_void_p(torch.cuda.default_stream(device).cuda_stream)
        if arity == 3 and len(handles) == 1:
            return entry, (handles[0], stream, buffers)
        if arity == 1 and len(pointers) == 1:
            ctx_ptr_ptr = pointers[0]
            stream_ptr = ctypes.pointer(stream)
            buffers_ptr = ctypes.pointer(buffers)
            buffers_ptr_ptr = ctypes.pointer(buffers_ptr)
            args = (ctypes.POINTER(ctypes.c_void_p) * 3)()
            args[0] = ctx_ptr_ptr
            args[1] = stream_ptr
            args[2] = ctypes.cast(buffers_ptr_ptr, ctypes.POINTER(ctypes.c_void_p))
            args._kept = (ctx_ptr_ptr, stream, stream_ptr, buffers, buffers_ptr, buffers_ptr_ptr)
            return entry, (args,)
        return None, None

    def native_call(self):
        """A launch made from C++ (bridge/native/lane.cpp), with a pointer buffer of its own, as keyword
        arguments of its Lane: `entry` (the address), `form`, `entry_args`, `num_buffers` and `keep_alive`.
        Form 3 calls entry(function, stream, buffers), the arguments (function, stream); form 1 calls
        entry(args) with args = [context pointer, stream pointer, pointer to the buffer's address], the
        arguments the first two. Each a pointer-sized int; the lane keeps the owner (this launcher, which
        keeps them valid) alive. None where launches go through jax's `launch`."""
        if self._entry is None:
            return None
        entry = ctypes.cast(self._entry, ctypes.c_void_p).value
        if len(self._entry_args) == 3:
            function, stream, _ = self._entry_args
            args, form = [int(function), int(stream.value or 0)], 3
        else:
            array = self._entry_args[0]
            args, form = [ctypes.cast(array[0], ctypes.c_void_p).value, ctypes.cast(array[1], ctypes.c_void_p).value], 1
        return {"entry": entry, "form": form, "entry_args": args, "num_buffers": self._num_buffers, "keep_alive": self}

    def launch(self, pointers) -> None:
        if len(pointers) != self._num_buffers:
            raise ValueError(f"{len(pointers)} pointers, the kernel takes {self._num_buffers}")
        # ctypes lets go of the GIL during the entry's call: the lock keeps another thread from writing
        # the kept buffer before this launch has read it.
        with self._lock:
            self.buffers[:] = pointers
            if self._entry is not None:
                self._entry(*self._entry_args)
            else:
                self._launch(self.buffers, self._device)


class MosaicStackLaunch:
    """The Mosaic GPU whole-stack kernel for x [batch, seq_len, d_model] of `dtype` (float32, float16 or
    bfloat16; y the same) on one CUDA device:
    `launch(x, mats, vecs)` returns a new y; masked, `launch(x, mask, mats, vecs)` with the token mask a
    contiguous [batch, seq_len] bool tensor, whose bytes the kernel reads as uint8. x must be contiguous
    and of `dtype` on the device; mats and vecs are the MgpuStackWeights arrays as torch tensors (contiguous, on
    the device). Compiles on construction (seconds); raises RuntimeError / ValueError when this jax cannot
    build it."""

    def __init__(self, config: Config, batch: int, seq_len: int, device: torch.device, masked: bool = False,
                 dtype: torch.dtype = torch.float32):
        from ttj_jax.compat import mosaic_gpu_module
        from ttj_jax.kernels import fused_stack_mgpu
        name = str(dtype).removeprefix("torch.")   # (bridge.transfer.torch_dtype_name: transfer imports this module)
        if name not in fused_stack_mgpu.IO_DTYPES:
            raise ValueError(f"{dtype=}: the kernel reads and writes one of {fused_stack_mgpu.IO_DTYPES}")
        spec = fused_stack_mgpu.launch_spec(config, batch, seq_len, masked=masked, dtype=name)
        if spec.out_dtype.name != name:
            raise ValueError(f"the kernel writes {spec.out_dtype}; this launch allocates {name}")
        self.shape, self.dtype = spec.out_shape, dtype
        self.device = device
        num_buffers = len(spec.arg_structs) + 1   # the inputs, then the one output
        with torch.cuda.device(device):   # the module loads into this device's CUDA context
            self.launcher = MosaicLauncher(mosaic_gpu_module(spec.function, *spec.arg_structs), num_buffers=num_buffers)
        self._launch = self.launcher.launch
        self.current_stream = current_stream_getter(device)   # the raw handle of torch's current stream
        self._default = torch.cuda.default_stream(device)
        self._ready, self._done = torch.cuda.Event(), torch.cuda.Event()

    def native_call(self):
        """MosaicLauncher.native_call, for a launch on the default stream of this kernel's device."""
        if self._default.cuda_stream != 0:   # the lane's stream test reads stream id 0
            return None
        return self.launcher.native_call()

    def __call__(self, x: torch.Tensor, *arrays: torch.Tensor) -> torch.Tensor:
        """arrays: (mats, vecs), or (mask, mats, vecs) for a masked launch."""
        y = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        pointers = (x.data_ptr(), *(a.data_ptr() for a in arrays), y.data_ptr())
        if self.current_stream() == 0:   # the caller is on the default stream: the launch's own stream
            self._launch(pointers)
            return y
        # Another stream: the default stream waits for the caller's queued work (x's producers), the
        # caller's stream for the kernel (y's consumers, and any reuse of x's memory).
        current = torch.cuda.current_stream(self.device)
        self._ready.record(current)
        self._default.wait_event(self._ready)
        self._launch(pointers)
        self._done.record(self._default)
        current.wait_event(self._done)
        return y
