"""What the planner and the kernels' dispatch know of a device: `DeviceFacts`, read by `device_facts()`.

Every decision that depends on the GPU generation (Hopper-only kernels, the bridge's own Mosaic GPU
launch) reads it from here, so that `TTJ_FORCE_DEVICE` can make a process plan as another GPU would:
`TTJ_FORCE_DEVICE=sm_80` on an H200 gets the plans an A100 gets and dispatches no Hopper-only kernel
(`ttj-bench --force-device`). The kernels themselves still compile for the GPU present.
"""

from __future__ import annotations

import dataclasses
import os

FORCE_DEVICE_ENV = "TTJ_FORCE_DEVICE"
# The GPU generations a process can be told to plan as: compute capability and a name for explain().
FORCIBLE = {"sm_80": "8.0", "sm_86": "8.6", "sm_89": "8.9", "sm_90": "9.0"}


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    platform: str                  # "cpu" or "gpu"
    device_kind: str = ""          # e.g. "NVIDIA H200"
    memory_bytes: int | None = None
    device_count: int = 1
    compute_capability: str = ""   # e.g. "9.0" (CUDA GPUs)

    @property
    def is_gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def is_hopper(self) -> bool:
        return self.is_gpu and self.compute_capability.startswith("9")

    @property
    def takes_cudnn_attention(self) -> bool:
        """Whether cuDNN's fused attention (jax.nn.dot_product_attention's cudnn path) runs here: sm_80 and
        newer. A GPU whose capability is not known is assumed to."""
        if not self.is_gpu:
            return False
        major = self.compute_capability.split(".")[0]
        return not major.isdigit() or int(major) >= 8


CPU = DeviceFacts(platform="cpu")


def forced_compute_capability() -> str | None:
    """The compute capability TTJ_FORCE_DEVICE asks for ("8.0" for "sm_80"), or None when unset.
    Raises ValueError for a value it does not know, rather than planning for the wrong GPU."""
    value = os.environ.get(FORCE_DEVICE_ENV, "").strip()
    if not value:
        return None
    if value not in FORCIBLE:
        raise ValueError(f"{FORCE_DEVICE_ENV}={value!r} is not one of {sorted(FORCIBLE)}")
    return FORCIBLE[value]


def device_facts(device) -> DeviceFacts:
    """Reads the facts of one jax device and how many of its kind are visible; a GPU's compute
    capability is TTJ_FORCE_DEVICE's when that is set (the only impure function of the planning)."""
    import jax
    platform = "gpu" if device.platform in ("gpu", "cuda", "rocm") else device.platform
    memory = None
    try:
        stats = device.memory_stats() or {}
        memory = stats.get("bytes_limit")
    except Exception:   # memory_stats is unimplemented on some backends (the CPU among them)
        memory = None
    kind = getattr(device, "device_kind", "")
    capability = str(getattr(device, "compute_capability", "") or "")
    forced = forced_compute_capability() if platform == "gpu" else None
    if forced is not None and forced != capability:
        kind = f"{kind} planned as sm_{forced.replace('.', '')}"
        capability = forced
    return DeviceFacts(platform=platform, device_kind=kind, memory_bytes=memory,
                       device_count=len(jax.devices(device.platform)), compute_capability=capability)


def default_device_is_hopper() -> bool:
    """Whether jax's default device is a Hopper GPU as far as planning goes (TTJ_FORCE_DEVICE included):
    the kernels' dispatch between their Hopper and generic versions asks this."""
    import jax
    if jax.default_backend() != "gpu":
        return False
    return device_facts(jax.devices()[0]).is_hopper
