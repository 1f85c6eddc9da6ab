"""The bridge's native lane (lane.cpp): a call the bridge launched itself repeated in C++, built on first use.

Why: a Mosaic-launched bridge call is one kernel of ~40-75 us on the launch-bound shapes, and its
Python path costs ~30-50 us of host time (`bench/host_parts.py`): nn.Module's call, the front of
forward, the parameters' check, the output's allocation and the launch's ctypes call. A slow host then
paces the GPU. The lane makes the same checks and the same launch from C++, one call from Python. The
rows stack's Triton kernels (bridge/triton_launch.py) repeat the same way, launched with cuLaunchKernel.

Built with torch's extension builder (`torch.utils.cpp_extension.load`: a C++ compiler and ninja) into
`<cache>/native/<torch version>-<python>-<source hash>` (<cache>: the plan cache's directory, TTJ_CACHE_DIR), once per
torch version; a later process loads the built module. It needs no CUDA headers. Where the build fails
(no compiler), the bridge warns once and keeps the Python path. `TTJ_NATIVE_LANE=0` keeps it off.
`build()` builds ahead of the first call (`ttj-bench --warm` calls it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

from bridge import settings

SOURCE = Path(__file__).with_name("lane.cpp")
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}   # "module": the loaded extension, or "error": why it is unavailable


class NativeLaneWarning(UserWarning):
    """The native lane could not be built or loaded; the bridge keeps its Python path."""


def build_dir() -> Path:
    import torch

    from ttj_jax.plan_cache import default_dir
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:10]   # a changed lane.cpp builds afresh
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}-{source}"
    return default_dir() / "native" / tag


def build(verbose: bool = False):
    """The lane extension module, built (or loaded from an earlier build) now. Raises RuntimeError where it
    cannot be built; the reason is kept, so a later call raises at once."""
    with _LOCK:
        if "module" in _STATE:
            return _STATE["module"]
        if "error" in _STATE:
            raise RuntimeError(_STATE["error"])
        try:
            from torch.utils import cpp_extension
            _find_ninja()
            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            built = any(directory.glob("ttj_native_lane*.so"))
            if not built:
                print(f"ttj-jax: building the bridge's native lane into {directory} (once per torch version, "
                      "~10-60 s)", file=sys.stderr, flush=True)
            start = time.perf_counter()
            module = cpp_extension.load(name="ttj_native_lane", sources=[str(SOURCE)], build_directory=str(directory),
                                        extra_cflags=["-O2"], verbose=verbose)
            if not built:
                print(f"ttj-jax: native lane built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        except Exception as e:   # no compiler, no ninja, a failed compile: the Python path stays
            lines = str(e).strip().splitlines()
            first = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
            _STATE["error"] = f"{type(e).__name__}: {first.strip()[:300]}"
            raise RuntimeError(_STATE["error"]) from e
        _STATE["module"] = module
        return module


def _find_ninja() -> None:
    """torch's builder runs `ninja` from PATH; where none is there, the one the `ninja` package installed
    (the project's torch and test extras) is put first on this process's PATH."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def available() -> bool:
    """Whether lanes can be made: switched on (TTJ_NATIVE_LANE) and built; builds on first use and warns
    once where the build fails."""
    if not settings.native_lane():
        return False
    if "module" in _STATE:
        return True
    try:
        build()
    except RuntimeError as e:
        if not _STATE.get("warned"):
            _STATE["warned"] = True
            warnings.warn(f"ttj-jax's native lane is unavailable ({e}); launched calls keep the Python path. "
                          f"Set {settings.NATIVE_LANE_ENV}=0 to skip the build", NativeLaneWarning, stacklevel=3)
        return False
    return True


def describe() -> str:
    """How a repeat of a launched call runs, for explain(): without building anything."""
    if not settings.native_lane():
        return f"the native lane is off ({settings.NATIVE_LANE_ENV}=0): every call takes the Python path"
    if "error" in _STATE:
        return f"the native lane is unavailable ({_STATE['error']}): every call takes the Python path"
    return "a repeat of the same call (same input layout, mask use and weights) runs through the native lane (C++)"


def lane_class():
    """lane.cpp's Lane (after available() answered True)."""
    return build().Lane

