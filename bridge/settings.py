"""The bridge's settings, all read here, and what importing the bridge changes in the process.

Environment switches (read when a device's first call sets up its transfers or launches):
- `TTJ_BRIDGE_KEEP_X_IMPORT=0`: import x (and a mask the plan passes) afresh on every call instead of
  keeping the last import of the same tensor (on CUDA, where jax's compute stream is ordered after
  torch's writes).
- `TTJ_MOSAIC_LAUNCH=0`: run the Mosaic GPU whole-stack kernel through jax instead of launching it on
  torch's stream.
- `TTJ_TRITON_LAUNCH=1`: launch the kernels of plans made only of Triton kernels (the "rows" and "fused"
  stacks) on torch's stream instead of calling jax (bridge/triton_launch.py). Off by default: an
  experiment whose GPU checks have not passed yet (see that module).
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

KEEP_X_IMPORT_ENV = "TTJ_BRIDGE_KEEP_X_IMPORT"
MOSAIC_LAUNCH_ENV = "TTJ_MOSAIC_LAUNCH"
POLICY_ENV = "TTJ_POLICY"
TRITON_LAUNCH_ENV = "TTJ_TRITON_LAUNCH"
_OFF = ("0", "false", "False", "")


def keep_x_import() -> bool:
    return os.environ.get(KEEP_X_IMPORT_ENV, "1") not in _OFF


def mosaic_launch() -> bool:
    return os.environ.get(MOSAIC_LAUNCH_ENV, "1") not in _OFF


def triton_launch() -> bool:
    return os.environ.get(TRITON_LAUNCH_ENV, "0") not in _OFF


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
