"""The bridge's launch-bound fast path: the fused whole-stack kernel launched on torch tensors, no JAX dispatch.

For calls the planner gives to the fused kernel (`Plan.stack == "fused"`: mask-free, short sequences),
the work on the GPU is one kernel, and what a bridge call costs on the host decides the time the
harness sees (SPEC section 2: host time counts wherever the GPU idles). Through jax that host time is a
jitted call's dispatch plus a DLPack import and export (bench/results/bridge-profile-*.json). Here the
kernel that Pallas generates from ttj_jax/kernels/fused_stack.py, as Triton IR
(`fused_stack.direct_launch`), is compiled once by the Triton compiler that ships with torch for this
GPU, and each call launches it with the torch tensors' pointers: one output allocation and one launch.

Stream order is torch's own: the kernel runs on the caller's current stream, after whatever torch queued
there (x's producers) and before whatever it queues next (y's consumers); no event, no host sync. The
weights are the fused layout built by jax from the module's parameters once per weight version
(runtime.py caches them as torch tensors sharing jax's memory).

Availability: CUDA, and the `triton` package importable (it ships with CUDA builds of torch).
`unavailable_reason()` says why not; the bridge then runs the same kernel through jax.
"""

from __future__ import annotations

import os
import tempfile

import torch

from ttj_jax.kernels.fused_stack import DirectLaunch


def unavailable_reason(device: torch.device) -> str | None:
    """Why the direct launch cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"the direct launch needs a CUDA device, x is on {device}"
    if os.environ.get("TTJ_DIRECT_LAUNCH", "1") == "0":
        return "disabled by TTJ_DIRECT_LAUNCH=0"
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        return f"the triton package is not importable ({e})"
    return None


class DirectKernel:
    """One DirectLaunch compiled for one CUDA device. `kernel(*tensors)` launches it on torch's current
    stream of that device; the tensors are its arguments in DirectLaunch's order (contiguous, on the
    device, of the dtypes the IR was lowered for: the caller guarantees it, nothing is checked here)."""

    def __init__(self, spec: DirectLaunch, device: torch.device):
        import triton
        from triton.backends.compiler import GPUTarget
        major, minor = torch.cuda.get_device_capability(device)
        self.spec = spec
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        with tempfile.TemporaryDirectory() as folder:   # triton.compile reads IR from a file
            path = os.path.join(folder, f"{spec.name}.ttir")
            with open(path, "w") as f:
                f.write(spec.ttir)
            with torch.cuda.device(self.device_index):
                self.compiled = triton.compile(
                    path, target=GPUTarget("cuda", major * 10 + minor, 32),
                    options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
                self.compiled._init_handles()   # loads the binary now, not inside the first timed call
        self.grid = spec.grid
        self._launcher = self.compiled.run
        self._function = self.compiled.function
        self._metadata = self.compiled.packed_metadata
        try:
            self._stream_of = torch._C._cuda_getCurrentRawStream   # private; ~1 us against ~3 public
            self._stream_of(self.device_index)
        except (AttributeError, RuntimeError):
            self._stream_of = lambda index: torch.cuda.current_stream(index).cuda_stream

    @property
    def shared_bytes(self) -> int:
        return self.compiled.metadata.shared

    def __call__(self, *tensors: torch.Tensor) -> None:
        gx, gy, gz = self.grid
        self._launcher(gx, gy, gz, self._stream_of(self.device_index), self._function, self._metadata,
                       None, None, None, *tensors)
