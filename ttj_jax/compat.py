"""Version-dependent and private JAX API, kept in this one place (jax 0.10.2 on CPUs, 0.11.2 on the GPU).

The fast DLPack import: `jax.dlpack.from_dlpack` costs ~80 us per call on the H200 machine, of which the
native import is ~20 us (../shared/GPU.md); the rest is per-call device lookup and a dtype
canonicalisation that float and bool tensors never need. `dlpack_importer` does the lookup once per
device and keeps the same stream protocol: the producer is handed jax's stream, so the producer (torch)
makes that stream wait for its pending writes, with no host sync. Any failure to build the fast path
falls back to the public API.
"""

from __future__ import annotations

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


def dlpack_importer(dl_device_type: int, device_id: int) -> Callable[[Any], jax.Array]:
    """A function importing DLPack producers living on one device, zero-copy, as jax Arrays."""
    def public(tensor):
        return jax.dlpack.from_dlpack(tensor)

    if _native is None or _EXTENSION_VERSION < 300:
        return public
    try:
        platform = _DL_DEVICE_TO_PLATFORM[dl_device_type]
        device = _xla_bridge.get_backend(platform).device_from_local_hardware_id(device_id)
    except Exception:
        return public
    if platform == "cpu":
        stream = None
    else:
        try:
            stream = device.get_stream_for_external_ready_events()
        except Exception:
            return public
    to_buffer = _native.dlpack_managed_tensor_to_buffer
    dl_type = int(dl_device_type)

    if _EXTENSION_VERSION >= 467:
        def fast(tensor):
            return to_buffer(tensor.__dlpack__(stream=stream), device, stream, None, dl_type)
    else:
        def fast(tensor):
            return to_buffer(tensor.__dlpack__(stream=stream), device, stream, None)
    fast.device = device
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
