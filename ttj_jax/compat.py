"""Version-dependent and private JAX API, kept in this one place (jax 0.10.2 on CPUs, 0.11.2 on the GPU).

The fast DLPack import: `jax.dlpack.from_dlpack` costs ~80 us per call on the H200 machine, of which the
native import is ~20 us (../shared/GPU.md); the rest is per-call device lookup and a dtype
canonicalisation that float and bool tensors never need. `dlpack_importer` does the lookup once per
device and keeps the same stream protocol: the producer is handed jax's stream, so the producer (torch)
makes that stream wait for its pending writes, with no host sync. Any failure to build the fast path
falls back to the public API.
"""

from __future__ import annotations

import io
from typing import Any, Callable

import jax

try:   # private, checked at import; the public fallback below keeps behaviour if it moves
    from jax._src.dlpack import _DL_DEVICE_TO_PLATFORM
    from jax._src.lib import _jax as _native
    from jax._src.lib import jaxlib_extension_version as _EXTENSION_VERSION
    from jax._src import xla_bridge as _xla_bridge
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
        from jax._src import monitoring   # the public module has no unregister in every version
        monitoring.unregister_event_duration_listener(self._listener)
        return False


def shard_map(f, *, mesh, in_specs, out_specs):
    """jax.shard_map with replication/VMA checking off (the bodies here hold no collectives, and Pallas
    calls carry no VMA rules); the flag's name moved between versions."""
    import inspect
    params = inspect.signature(jax.shard_map).parameters
    flag = {"check_vma": False} if "check_vma" in params else {"check_rep": False} if "check_rep" in params else {}
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **flag)


class TritonKernelIR:
    """One Pallas kernel as Pallas lowered it for the GPU's Triton path: the Triton IR (MLIR text and the
    bytecode XLA is handed), its name and its grid. Its arguments are pointers, the pallas_call's inputs
    then its outputs, in order."""

    def __init__(self, name: str, ttir: str, bytecode: bytes, grid: tuple[int, int, int]):
        self.name, self.ttir, self.bytecode, self.grid = name, ttir, bytecode, grid


def pallas_triton_kernels(fn, *arg_structs) -> list[TritonKernelIR]:
    """The Triton IR of every generic Pallas kernel in `fn(*arg_structs)`, lowered for CUDA (no GPU
    needed). Uses Pallas' private lowering hook (`lower_jaxpr_to_triton_module`), wrapped for the
    duration of one fresh lowering of `fn`; raises RuntimeError when that hook is not where it was."""
    try:
        from jax._src.pallas.triton import lowering
        original = lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"this jax ({jax.__version__}) has no Pallas Triton lowering hook: {e}") from e
    captured = []

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        operation = result.module.operation
        name = str(operation.attributes["sym_name"]).strip('"')
        grid = tuple(result.grid) + (1,) * (3 - len(result.grid))
        buffer = io.BytesIO()
        operation.write_bytecode(buffer)
        captured.append(TritonKernelIR(name, operation.get_asm(enable_debug_info=False), buffer.getvalue(), grid))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:   # a new function object each time: jit's caches never skip the lowering we need to see
        jax.jit(lambda *a: fn(*a)).trace(*arg_structs).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return captured


def xla_kernel_ptx(fn, *arg_structs) -> list[str]:
    """The PTX XLA generates for jit(fn)(*arg_structs) on the GPU, one text per dumped module: for a
    function that is one pallas_call (plus free reshapes) that is the Pallas kernel as XLA compiled it,
    with XLA's own Triton (jaxlib exposes no Triton compiler of its own from jax 0.11 on). Read from
    XLA's dump of this one compilation (compiler option xla_dump_to). Needs a GPU backend."""
    import glob
    import os
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        jax.jit(lambda *a: fn(*a)).lower(*arg_structs).compile(compiler_options={"xla_dump_to": folder})
        texts = []
        for path in sorted(glob.glob(os.path.join(folder, "*.ptx"))):
            with open(path) as f:
                texts.append(f.read())
    if not texts:
        raise RuntimeError("XLA dumped no PTX for this function (not a GPU backend?)")
    return texts
