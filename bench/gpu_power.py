"""The GPU's SM clock and power draw while a benchmark times something: nvidia-smi sampled in the background.

Why the benchmarks record it: on the H200, our attention kernel and cuDNN both run at the 700 W power cap
on random fp16 data, the cap holds the SM clock at ~1740-1785 MHz instead of 1980, and their speed follows
that clock (the same kernel: 559.5 TFLOP/s on zero Q and K, uncapped, against 492.6 on random data). So a
TFLOP/s figure means little without the clock and power it ran at (docs/power.md).

    with sampling(on_gpu) as power:   # a running PowerSampler, or None where nothing is sampled
        start = time.perf_counter(); ...timed work...; end = time.perf_counter()
        power.window(start, end)   # {"sm_clock_mhz", "power_w", "power_capped", "samples", ...} or None

It samples one GPU, nvidia-smi's index 0 unless told (`gpu_index`): on a several-GPU machine, the one the
benchmark's single-device timings run on. Where nvidia-smi is missing (a CPU machine) the sampler
records nothing and window() returns None.
The clock is read as it is at each sample; nvidia-smi's power.draw is an average over a longer period,
so for timings shorter than a second or so it lags (0.3 s timings read 204-278 W while "capped"). Read
the clock; take the power of short windows as a lower bound.
And read the clock as a relative figure: under the power cap it is ~10% above the clock the SMs
effectively deliver (Nsight Compute counts the same SM cycles per call at any clock, and plain runs'
times then imply ~1.55 GHz where nvidia-smi samples ~1.72, for our kernel and for cuBLAS alike).
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import statistics
import subprocess
import threading
import time

FIELDS = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")
# drivers before the rename call the last field clocks_throttle_reasons
LEGACY_REASONS_FIELD = "clocks_throttle_reasons.active"
# bits of the clock event (throttle) reasons that lower the clock
REASONS = {0x1: "gpu_idle", 0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake"}
SW_POWER_CAP = 0x4


def parse_sample(line: str) -> tuple[float, float, float, int] | None:
    """(SM clock MHz, power W, temperature C, reasons bitmask) from one csv,noheader,nounits line; None
    for anything else (a header, '[N/A]', an error message)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        return float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)
    except ValueError:
        return None


def nvidia_smi_command(interval_ms: int, gpu_index: int = 0) -> list[str] | None:
    """The sampling command for this driver's field names; None without nvidia-smi or a GPU it sees."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    for fields in (FIELDS, FIELDS[:3] + (LEGACY_REASONS_FIELD,)):
        query = [exe, f"--id={gpu_index}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        try:
            probe = subprocess.run(query, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        if probe.returncode == 0 and parse_sample(probe.stdout.strip().splitlines()[0] if probe.stdout.strip() else ""):
            return query + ["-lms", str(interval_ms)]
    return None


class PowerSampler:
    """Context manager: runs `command` (nvidia-smi's sampling loop by default) and keeps its samples as
    (perf_counter time, SM clock MHz, power W, temperature C, reasons bitmask)."""

    def __init__(self, interval_ms: int = 50, gpu_index: int = 0, command: list[str] | None = None):
        self.command = command if command is not None else nvidia_smi_command(interval_ms, gpu_index)
        self.samples: list[tuple[float, float, float, float, int]] = []
        self._process = None
        self._reader = None

    def __enter__(self) -> PowerSampler:
        if self.command:
            try:
                self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                                 text=True)
            except OSError:
                self._process = None
        if self._process is not None:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            value = parse_sample(line)
            if value is not None:
                self.samples.append((time.perf_counter(), *value))

    def __exit__(self, *exc) -> bool:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._reader.join(timeout=5)
        return False

    @property
    def active(self) -> bool:
        return self._process is not None

    def window(self, start: float, end: float) -> dict | None:
        """Medians of the samples taken in [start, end] (perf_counter seconds), whether the power cap
        was lowering the clock in any of them, and which reasons were; None when there are none."""
        return self.windows([(start, end)])

    def windows(self, ranges) -> dict | None:
        """window() over the samples taken in any of the (start, end) ranges."""
        inside = [s for s in self.samples if any(start <= s[0] <= end for start, end in ranges)]
        if not inside:
            return None
        reasons = 0
        for sample in inside:
            reasons |= sample[4]
        return {"sm_clock_mhz": statistics.median(s[1] for s in inside),
                "power_w": round(statistics.median(s[2] for s in inside), 1),
                "temperature_c": max(s[3] for s in inside),
                "power_capped": bool(reasons & SW_POWER_CAP),
                "reasons": [name for bit, name in REASONS.items() if reasons & bit],
                "samples": len(inside)}


@contextlib.contextmanager
def sampling(enabled: bool = True, **kwargs):
    """A running PowerSampler(**kwargs) for the duration, or None where `enabled` is False or nothing
    can be sampled (no nvidia-smi): what the benchmark runners pass down to their timings."""
    if not enabled:
        yield None
        return
    with PowerSampler(**kwargs) as power:
        yield power if power.active else None


def nvml_energy_reader(gpu_index: int = 0, library: str = "libnvidia-ml.so.1"):
    """A function that returns GPU `gpu_index`'s energy counter in joules (NVML's total energy
    consumption since the driver loaded, read in mJ), or None where NVML or the counter is missing (a
    CPU machine). Why (docs/power.md): at the H200's power cap, time per call is energy per
    call over ~690 W, so energy per call is what a faster kernel must lower; nvidia-smi's power.draw is
    a lagging average and its clock reads ~10% high there. The counter advances in steps of some
    milliseconds: read it over many calls (joules_per_call)."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    handle = ctypes.c_void_p()
    if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(gpu_index, ctypes.byref(handle)) != 0:
        return None

    def read() -> float:
        millijoules = ctypes.c_ulonglong()
        status = nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules))
        if status != 0:
            raise RuntimeError(f"nvmlDeviceGetTotalEnergyConsumption returned {status}")
        return millijoules.value / 1000.0
    try:
        read()
    except RuntimeError:
        return None
    return read


def joules_per_call(fn, args, calls: int, read_energy, block=None) -> dict | None:
    """Energy and time per call over `calls` back-to-back calls of fn(*args) closed by one block (by
    default jax.block_until_ready): {"joules_per_call", "ms_per_call", "watts", "calls"}; None without a
    reader. Warm fn up (compile) first."""
    if read_energy is None:
        return None
    if block is None:
        import jax  # noqa: PLC0415
        block = jax.block_until_ready
    energy, start = read_energy(), time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    block(out)
    seconds, joules = time.perf_counter() - start, read_energy() - energy
    return {"joules_per_call": joules / calls, "ms_per_call": seconds * 1e3 / calls,
            "watts": joules / seconds if seconds > 0 else None, "calls": calls}
