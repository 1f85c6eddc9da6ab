"""The bridge's settings, all read here, and what importing the bridge changes in the process.

Environment switches (read when a device's first call sets up its transfers or launches):
- `TTJ_BRIDGE_KEEP_X_IMPORT=0`: import x (and a mask the plan passes) afresh on every call instead of
  keeping the last import of the same tensor (on CUDA, where jax's compute stream is ordered after
  torch's writes).
- `TTJ_MOSAIC_LAUNCH=0`: run the Mosaic GPU whole-stack kernel through jax instead of launching it on
  torch's stream.
- `TTJ_NATIVE_LANE=0`: never repeat a launched call through the native lane (bridge/native); read when
  a lane would be armed, after a launched call with new inputs or weights.
- `TTJ_TRITON_LAUNCH`: which plans made only of Triton kernels the bridge launches itself on torch's
  stream instead of calling jax (bridge/triton_launch.py): `rows` (the default: the "rows" stack), `all`
  (also the "fused" whole-stack kernel, an experiment: see that module) or `0` (none).
- `TTJ_GPU_MASK`: how a GPU mask's kind (all True, a prefix, general) is found. No choice can give a stale
  answer to a mask written behind torch's version counter (`.data`, a DLPack consumer, a kernel) but `host`.
  - `auto` (the default): a call with at least `planner.HOST_MASK_READ_MIN_FLOP` of work reads the mask on
    the host on every call (one host sync, under ~1% of such a call); a smaller one never reads it: its
    program (or the Mosaic kernel's masked build) decides on the device, branch-free.
  - `device`: every GPU mask is decided on the device.
  - `host`: a GPU mask's kind is read once per tensor and version (one host sync), then kept: the fastest,
    and stale after a write that does not bump the version (then call `bridge.refresh(module)`).
- `TTJ_POLICY=<name>`: a numerics policy (`ttj_jax.numerics.POLICIES`) for every inference call signature the
  bridge plans from then on, instead of the planner's choice (read when a signature is first planned):
  `mixed_fp16x3` or `tf32` for inputs at small scales (docs/decisions.md, "Numerics").

Effects of `import bridge`:
- `XLA_PYTHON_CLIENT_PREALLOCATE=false` unless already set, so jax does not take 75% of the GPU's
  memory at its first operation (torch shares the device). It must be set before jax starts its GPU
  backend, which importing the bridge first ensures.
- Two global torch hooks that count parameter and submodule registrations (runtime.py): they return
  None, so torch keeps what was assigned.
"""

from __future__ import annotations

import os

GPU_MASK_ENV = "TTJ_GPU_MASK"
GPU_MASK_CHOICES = ("auto", "host", "device")
GPU_MASK_DEFAULT = "auto"
KEEP_X_IMPORT_ENV = "TTJ_BRIDGE_KEEP_X_IMPORT"
MOSAIC_LAUNCH_ENV = "TTJ_MOSAIC_LAUNCH"
NATIVE_LANE_ENV = "TTJ_NATIVE_LANE"
POLICY_ENV = "TTJ_POLICY"
TRITON_LAUNCH_ENV = "TTJ_TRITON_LAUNCH"
_OFF = ("0", "false", "False", "")


def gpu_mask_mode() -> str:
    """How a GPU mask's kind is found (TTJ_GPU_MASK, read when a module's first call sets up its state): one
    of GPU_MASK_CHOICES, else ValueError."""
    value = os.environ.get(GPU_MASK_ENV, "").strip() or GPU_MASK_DEFAULT
    if value not in GPU_MASK_CHOICES:
        raise ValueError(f"{GPU_MASK_ENV}={value!r}: choose one of {GPU_MASK_CHOICES}")
    return value


def keep_x_import() -> bool:
    return os.environ.get(KEEP_X_IMPORT_ENV, "1") not in _OFF


def mosaic_launch() -> bool:
    return os.environ.get(MOSAIC_LAUNCH_ENV, "1") not in _OFF


TRITON_LAUNCH_CHOICES = {"rows": ("rows",), "all": ("rows", "fused"), "1": ("rows", "fused")}
TRITON_LAUNCH_DEFAULT = "rows"


def triton_launch_stacks() -> tuple[str, ...]:
    """The stacks whose Triton kernels the bridge launches itself (TTJ_TRITON_LAUNCH). ValueError for a
    value that is not one of TRITON_LAUNCH_CHOICES or off."""
    value = os.environ.get(TRITON_LAUNCH_ENV, TRITON_LAUNCH_DEFAULT).strip()
    if value in _OFF or value in ("off", "none"):
        return ()
    if value not in TRITON_LAUNCH_CHOICES:
        raise ValueError(f"{TRITON_LAUNCH_ENV}={value!r}: choose one of {sorted(TRITON_LAUNCH_CHOICES)} or 0")
    return TRITON_LAUNCH_CHOICES[value]


def triton_launch_any_width() -> bool:
    """Whether TTJ_TRITON_LAUNCH=all lifts the rows launch's limit to GPU-checked model widths
    (triton_launch.ROWS_GPU_VERIFIED_D_MODELS)."""
    return os.environ.get(TRITON_LAUNCH_ENV, TRITON_LAUNCH_DEFAULT).strip() == "all"


def requested_policy() -> str | None:
    """The numerics policy TTJ_POLICY names, or None (unset or empty: the planner's). ValueError for a
    name that is not a policy."""
    value = os.environ.get(POLICY_ENV, "").strip()
    if not value:
        return None
    from ttj_jax.numerics import POLICIES  # deferred: this module is read before jax starts
    if value not in POLICIES:
        raise ValueError(f"{POLICY_ENV}={value!r} is not a numerics policy; choose one of {sorted(POLICIES)}")
    return value


def apply_process_defaults() -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def native_lane() -> bool:
    """Whether the bridge repeats its launched calls through the native lane (bridge/native)."""
    return os.environ.get(NATIVE_LANE_ENV, "1") not in _OFF
