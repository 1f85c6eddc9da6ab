"""Version-dependent and private JAX API, kept in this one place (jax 0.10.2 on CPUs, 0.11.2 on the GPU).

The fast DLPack import: `jax.dlpack.from_dlpack` costs ~80 us per call on the H200 machine, of which the
native import is ~20 us; the rest is per-call device lookup and a dtype
canonicalisation that float and bool tensors never need. `dlpack_importer` does the lookup once per
device and keeps the same stream protocol: the producer is handed jax's stream, so the producer (torch)
makes that stream wait for its pending writes, with no host sync. Any failure to build the fast path
falls back to the public API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

try:   # private, checked at import; the public fallback below keeps behaviour if it moves
    from jax._src import xla_bridge as _xla_bridge
    from jax._src.dlpack import _DL_DEVICE_TO_PLATFORM
    from jax._src.lib import _jax as _native
    from jax._src.lib import jaxlib_extension_version as _EXTENSION_VERSION
except ImportError:   # pragma: no cover - depends on the installed jax
    _native = None

# dtypes that cross without canonicalisation (x64 mode off narrows 64-bit types, so they are excluded)
FAST_DTYPE_NAMES = frozenset({"float32", "float16", "bfloat16", "bool"})


class DlpackImporter:
    """Imports DLPack producers living on one device, zero-copy, as jax Arrays.

    `importer(tensor)` follows the protocol: the producer is handed `importer.stream` (jax's stream for
    external ready events) and orders its pending writes before it. `importer.from_capsule(capsule)`
    takes a capsule whose producer the caller has already ordered before `importer.stream` (the bridge
    does that with one cached CUDA event, far cheaper than the producer's per-call protocol work).
    `importer.fast` says whether the native path is in use (else both go through the public API).
    """

    def __init__(self, dl_device_type: int, device_id: int):
        self.fast = False
        self.stream = None
        self.device = None
        try:
            platform = _DL_DEVICE_TO_PLATFORM[dl_device_type]
            self.device = _xla_bridge.get_backend(platform).device_from_local_hardware_id(device_id)
            if platform != "cpu":
                self.stream = self.device.get_stream_for_external_ready_events()
            self._to_buffer = _native.dlpack_managed_tensor_to_buffer
            self._extra = (None, int(dl_device_type)) if _EXTENSION_VERSION >= 467 else (None,)
            self.fast = _native is not None
        except Exception:   # private API moved or unavailable: the public path below still works
            self.fast = False

    def __call__(self, tensor) -> jax.Array:
        if not self.fast:
            return jax.dlpack.from_dlpack(tensor)
        return self._to_buffer(tensor.__dlpack__(stream=self.stream), self.device, self.stream, *self._extra)

    def from_capsule(self, capsule) -> jax.Array:
        if not self.fast:
            return jax.dlpack.from_dlpack(_CapsuleHolder(capsule, self.device))
        return self._to_buffer(capsule, self.device, self.stream, *self._extra)


class _CapsuleHolder:
    """Wraps an already-ordered capsule for the public API (no stream work: it is done)."""

    def __init__(self, capsule, device):
        self.capsule, self.jax_device = capsule, device

    def __dlpack__(self, stream=None, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (2 if self.jax_device.platform == "gpu" else 1), self.jax_device.local_hardware_id


def dlpack_importer(dl_device_type: int, device_id: int) -> DlpackImporter:
    return DlpackImporter(dl_device_type, device_id)


def dlpack_exporter() -> Callable[[jax.Array, int], Any]:
    """export(array, consumer_stream) -> a DLPack capsule; the consumer stream is made to wait for the
    array's producer on the device (no host sync). Uses the native call when it takes a jax Array
    directly, else the array's own `__dlpack__`."""
    native = getattr(_native, "buffer_to_dlpack_managed_tensor", None) if _native is not None else None

    def protocol(array, stream):
        return array.__dlpack__(stream=stream)

    if native is None:
        return protocol

    def fast(array, stream):
        return native(array, stream=stream)
    return fast


def tracing() -> bool:
    """Whether a jax transform (jit, grad, vmap, ...) is tracing right now: one flag read (~0.2 us),
    where walking an argument's leaves for tracers costs ~12-18 us per call."""
    try:
        from jax._src import core  # the public API has no equivalent
        return not core.trace_state_clean()
    except (ImportError, AttributeError):
        return True   # unknown: callers then take their traced path, which is always correct


def jax_version() -> str:
    return jax.__version__


class count_compilations:
    """Context manager counting XLA backend compilations inside it (jax.monitoring's compile event).

        with count_compilations() as counter:
            ...
        counter.count
    """
    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listener(self, event, duration_secs, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        from jax._src import monitoring  # the public module has no unregister in every version
        monitoring.unregister_event_duration_listener(self._listener)
        return False


def shard_map(f, *, mesh, in_specs, out_specs):
    """jax.shard_map with replication/VMA checking off (Pallas calls carry no VMA rules; the one
    collective, ring_attention's ppermute, moves per-device blocks, nothing replicated); the flag's name
    moved between versions."""
    import inspect
    params = inspect.signature(jax.shard_map).parameters
    flag = {"check_vma": False} if "check_vma" in params else {"check_rep": False} if "check_rep" in params else {}
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **flag)


def mosaic_gpu_interpret_params(**options):
    """Mosaic GPU's interpret-mode parameters (a private class in jax 0.10-0.11): what `plgpu.kernel(...,
    interpret=...)` takes to run a kernel body on a CPU."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(**options)


def mosaic_gpu_module(fn, *arg_structs) -> bytes:
    """The serialized Mosaic GPU module of `fn(*arg_structs)`, a function that is one Mosaic GPU kernel
    call and nothing else (as `plgpu.as_torch_kernel` requires), lowered for CUDA (no GPU needed).
    Checks what a launch with raw pointers (bridge.mosaic_launch.MosaicLauncher) assumes: the kernel's operands are the function's
    arguments in order and its results are returned in order (no buffers, constants or reshapes
    around the call). Raises ValueError otherwise, RuntimeError where this jax lowers differently."""
    try:
        from jax._src.lib.mlir import passmanager
        from jax._src.lib.mlir.dialects import func, hlo
        from jax.experimental.mosaic import gpu as mgpu
    except ImportError as e:   # pragma: no cover - depends on the installed jax
        raise RuntimeError(f"this jax ({jax.__version__}) lacks Mosaic GPU's lowering: {e}") from e
    module = jax.jit(lambda *a: fn(*a)).trace(*arg_structs).lower(lowering_platforms=("cuda",)).compiler_ir()
    with module.context:
        mgpu.dialect.register_inliner_extensions(module.context)   # jit outlines bodies: inline them
        passmanager.PassManager.parse("builtin.module(inline{default-pipeline=})").run(module.operation)
        mains = [op for op in module.body.operations
                 if isinstance(op, func.FuncOp) and op.name.value == "main"]
        if len(mains) != 1:
            raise ValueError("expected one main function in the lowered module")
        [body] = mains[0].body.blocks
        operations = list(body.operations)
        if len(operations) != 2:
            raise ValueError(f"expected the kernel call and a return, found {len(operations)} operations: "
                             + ", ".join(op.operation.name for op in operations))
        call, ret = operations
        if not (isinstance(call, hlo.CustomCallOp) and call.call_target_name.value == "mosaic_gpu_v2"):
            raise ValueError(f"expected a mosaic_gpu_v2 custom call, found {call.operation.name}")
        if list(call.operands) != list(body.arguments):
            raise ValueError("the kernel's operands are not the function's arguments in order")
        if list(ret.operands) != list(call.results):
            raise ValueError("the function does not return the kernel's results in order")
        if call.output_operand_aliases is not None and len(call.output_operand_aliases):
            raise ValueError("the kernel aliases an input to an output")
        try:
            return bytes(call.attributes["mhlo.backend_config"]["module"].value_bytes)
        except (KeyError, AttributeError) as e:
            raise RuntimeError(f"this jax ({jax.__version__}) stores the Mosaic GPU module elsewhere: {e}") from e


def jax_compute_stream(device) -> int | None:
    """The raw CUDA stream XLA runs jax's programs on for `device` (a jax Device), as
    `jax.experimental.buffer_callback` hands it to a callback (`ctx.stream`): probed twice, returned only
    when both runs saw the same nonzero handle. None where this jax has no buffer_callback, on a device
    without a GPU context (the CPU), or on any failure. One small compile per call of this function.
    The bridge waits on this stream for torch's pending writes (bridge/transfer.py, Transfer), which
    orders every later program on it, not only those reading a fresh import."""
    try:
        from jax.experimental.buffer_callback import buffer_callback  # noqa: PLC0415
    except ImportError:   # pragma: no cover - depends on the installed jax
        return None
    seen: list[int] = []

    def note_stream(ctx, out):
        del out
        seen.append(int(ctx.stream))

    probe = jax.jit(lambda: buffer_callback(note_stream, jax.ShapeDtypeStruct((1,), np.float32),
                                            has_side_effect=True)())
    try:
        with jax.default_device(device):
            for _ in range(2):
                jax.block_until_ready(probe())
    except Exception:   # noqa: BLE001 - no GPU context (the CPU) or an API change: no handle
        return None
    return seen[0] if len(seen) == 2 and seen[0] == seen[1] and seen[0] else None
