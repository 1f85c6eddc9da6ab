"""Tensors between torch and jax on one device: zero-copy DLPack both ways, ordered on the GPU without a
host sync (one cached CUDA event through the driver), and x's import kept while the same tensor comes
back. One `Transfer` per device, made on first use (`transfer_for`)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import jax
import torch

from bridge import mosaic_launch, settings
from ttj_jax.compat import dlpack_exporter, dlpack_importer, jax_compute_stream

_TRANSFERS: dict[tuple[str, int | None], Transfer] = {}

# The current CUDA device's index: torch's C getter (what torch.cuda.current_device wraps), a fraction of a us.
current_cuda_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


class Transfer:
    """Moves tensors between torch and jax on one device, zero-copy, ordered on the GPU.

    CUDA, torch -> jax: one cached event is recorded on torch's current stream, and jax's stream for
    external ready events and jax's compute stream (where XLA runs the programs; its handle from
    `compat.jax_compute_stream`) wait on it. Then the tensors cross as plain capsules: the DLPack stream
    protocol's ordering done once per call with cached objects instead of per tensor.
    CUDA, jax -> torch: jax makes torch's current stream wait for the result (DLPack protocol).
    Elsewhere (the CPU) both directions use the plain protocol.

    The compute-stream wait orders every program queued after it behind torch's pending writes,
    whichever arrays it reads. That is what makes a kept import of x safe: `to_jax_kept` returns the
    same jax array while x is the same tensor with the same memory and layout (its contents may change:
    those writes are what the wait orders). Without that wait a kept import lets jax's program run
    ahead of torch's writes, so `to_jax_kept` is called only when `order_before_jax()` returned True;
    without the handle (another jax, the CPU) every call imports afresh.

    The event goes through the CUDA driver (raw handles, ~13 us of host time against ~25 for torch's
    Event and ExternalStream wrappers); torch's wrappers are the fallback. docs/decisions.md has the
    measurements.
    """

    def __init__(self, device: torch.device):
        probe = torch.empty(1, device=device)
        self.importer = dlpack_importer(*probe.__dlpack_device__())
        self.device = device
        self.on_cuda = device.type == "cuda" and self.importer.fast and self.importer.stream is not None
        self.export_capsule = dlpack_exporter()
        # torch's side of the export: the capsule converter and the current stream's raw handle without
        # the public wrappers' argument handling (a few us per call on the H200 host); public fallbacks.
        self.capsule_to_tensor = getattr(torch._C, "_from_dlpack", torch.utils.dlpack.from_dlpack)
        self.driver_order = None
        self.order_compute = None   # the compute stream's wait alone (order_programs)
        self.compute_stream = None
        self.kept = KeptImport()
        self.kept_mask = KeptImport()   # the mask's import, kept the same way (a mask-passing plan's)
        if self.on_cuda:
            self.jax_stream = torch.cuda.ExternalStream(self.importer.stream, device=device)
            self.event = torch.cuda.Event()
            self.current_raw_stream = mosaic_launch.current_stream_getter(device)
            if settings.keep_x_import():
                with torch.cuda.device(device):   # the probe's compile and run leave torch's device as it was
                    self.compute_stream = jax_compute_stream(self.importer.device)
            streams = (self.importer.stream,) + ((self.compute_stream,) if self.compute_stream else ())
            self.driver_order = _driver_ordering(device, self.current_raw_stream, streams)
            if self.compute_stream:
                self.order_compute = _driver_ordering(device, self.current_raw_stream, (self.compute_stream,))

    def order_before_jax(self) -> bool:
        """Makes jax's stream for external ready events, and jax's compute stream where its handle is
        known, wait for everything torch's current stream has queued so far. Returns True when the
        compute stream waited (a kept import, `to_jax_kept`, is then ordered too)."""
        if self.on_cuda:
            if self.driver_order is not None and self.driver_order():
                return self.compute_stream is not None
            self.event.record(torch.cuda.current_stream(self.device))
            self.jax_stream.wait_event(self.event)
        return False

    def order_programs(self) -> bool:
        """order_before_jax() for a call whose jax work on the imports is programs on this device and
        nothing else (forward's single-device path): where the compute stream's handle is known, only
        that stream waits (one driver call fewer: every program runs on it, so the ready-events stream's
        wait orders nothing more for them; a fresh import's definition event, recorded there, is then
        met at once). Anything else that reads the imports (a copy to another device, a host transfer)
        runs on other streams: order those with order_before_jax()."""
        if self.order_compute is not None and self.order_compute():
            return True
        return self.order_before_jax()

    def to_jax(self, tensor: torch.Tensor):
        """Call order_before_jax() first (once for all tensors of one call)."""
        if self.on_cuda:
            return self.importer.from_capsule(torch.utils.dlpack.to_dlpack(tensor))
        return self.importer(tensor)

    def to_jax_kept(self, tensor: torch.Tensor, kept: KeptImport | None = None):
        """to_jax, kept from the last call for the same tensor, memory and layout (in `kept`, default x's
        slot; `kept_mask` for the mask). Only after order_before_jax() returned True in this call (see
        the class docstring): the array aliases the tensor's memory, so later writes to it are read."""
        return (kept or self.kept).get(tensor, self.to_jax)

    def to_torch(self, array) -> torch.Tensor:
        if not self.on_cuda:
            return torch.from_dlpack(array)
        stream = self.current_raw_stream() or 1   # DLPack: 1 = the legacy default stream
        try:
            return self.capsule_to_tensor(self.export_capsule(array, stream))
        except (TypeError, ValueError, RuntimeError, AttributeError):
            # this jax's native export wants something else: use the array's own protocol from now on
            self.export_capsule = lambda a, s: a.__dlpack__(stream=s)
            return torch.utils.dlpack.from_dlpack(self.export_capsule(array, stream))


class KeptImport:
    """The last tensor imported and its jax array: `get(tensor, load)` returns the kept array while
    `tensor` is the same object with the same data pointer, shape, strides and dtype (an in-place
    `set_`, `resize_` or `.data =` changes one of those), else `load(tensor)`, which it keeps instead.
    Holding the array holds the tensor (the DLPack import references it): one input per device stays
    alive until another takes its place."""

    __slots__ = ("tensor", "key", "array")

    def __init__(self):
        self.tensor = self.key = self.array = None

    def get(self, tensor: torch.Tensor, load: Callable[[torch.Tensor], Any]):
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        if tensor is self.tensor and key == self.key:
            return self.array
        self.tensor = self.key = self.array = None   # nothing half-kept if load raises
        array = load(tensor)
        self.tensor, self.key, self.array = tensor, key, array
        return array


_LIBCUDA = []


def _libcuda():
    """The CUDA driver library, loaded once (raises OSError where there is none)."""
    if not _LIBCUDA:
        _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
    return _LIBCUDA[0]


def _driver_ordering(device: torch.device, torch_raw_stream: Callable[[], int], jax_streams: tuple[int, ...]):
    """order() -> bool: one cuEventRecord of a cached event on torch's current stream and one
    cuStreamWaitEvent of each of jax's streams on it, through the CUDA driver (see Transfer); False when
    the driver refused (e.g. a thread with no CUDA context current), and the caller then orders through
    torch. None where libcuda or the event cannot be had."""
    try:
        driver = _libcuda()
        create, record, wait = driver.cuEventCreate, driver.cuEventRecord, driver.cuStreamWaitEvent
        create.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        event = ctypes.c_void_p()
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)   # torch's context for the device current on this thread
            if create(ctypes.byref(event), 0x2):   # CU_EVENT_DISABLE_TIMING
                return None
    except (OSError, AttributeError, RuntimeError):   # no libcuda, an old driver, torch without CUDA
        return None

    index = device.index

    def order() -> bool:
        # torch's default stream is handle 0, which the driver resolves in the current context: only
        # when the device's own is current (else torch's wrappers, which switch devices, do it)
        if current_cuda_device() != index:
            return False
        if record(event, torch_raw_stream()):
            return False
        return not any(wait(stream, event, 0) for stream in jax_streams)
    order.event = event   # kept alive with the closure (never destroyed: one per device)
    return order


def _start_jax_keeping_torch_device() -> None:
    """Starts jax's backends with torch's current CUDA device restored afterwards. Starting, jax makes
    each of its GPUs current in turn; with two GPUs visible that left torch's current device at cuda:1
    (seen on the two-H200 machine), so a later `torch.empty(..., device="cuda")` landed on the wrong GPU."""
    if not torch.cuda.is_available():
        jax.devices()
        return
    current = torch.cuda.current_device()
    try:
        jax.devices()
    finally:
        torch.cuda.set_device(current)


def torch_dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's numpy name ("float32", "bool"), as jax and the planner name dtypes."""
    return str(dtype).removeprefix("torch.")


def transfer_for(device: torch.device) -> Transfer:
    key = (device.type, device.index)
    transfer = _TRANSFERS.get(key)
    if transfer is None:
        if not _TRANSFERS:
            _start_jax_keeping_torch_device()
        transfer = _TRANSFERS[key] = Transfer(device)
    return transfer
