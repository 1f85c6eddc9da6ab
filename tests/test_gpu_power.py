"""bench/gpu_power.py: the background sampler that records the SM clock and power draw of benchmark
timings (nvidia-smi on the GPU machine; here a stand-in command prints its lines), and the NVML energy
counter read per call (here a stand-in counter)."""

import sys
import time

import pytest
from conftest import RecordingPower

import bench.bench_attention as ba
from bench import gpu_power
from bench.gpu_power import PowerSampler, parse_sample, sampling

# what `nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active
# --format=csv,noheader,nounits -lms 50` prints on the H200 under the power cap, and when idle
CAPPED, IDLE = "1770, 689.52, 67, 0x0000000000000004", "345, 94.88, 39, 0x0000000000000001"


def test_parse_sample_reads_nvidia_smi_lines_and_rejects_the_rest():
    assert parse_sample(CAPPED) == (1770.0, 689.52, 67.0, 4)
    assert parse_sample(IDLE) == (345.0, 94.88, 39.0, 1)
    for line in ("", "clocks.current.sm [MHz], power.draw [W]", "1770, [N/A], 67, 0x4",
                 "No devices were found", "1770, 689.5, 67"):
        assert parse_sample(line) is None


def _stand_in(lines, pause_s):
    """A command printing `lines` one by one, `pause_s` apart, then waiting to be terminated."""
    script = ("import sys, time\n"
              f"for line in {lines!r}:\n"
              "    print(line, flush=True)\n"
              f"    time.sleep({pause_s})\n"
              "time.sleep(60)\n")
    return [sys.executable, "-c", script]


def test_window_takes_medians_of_the_samples_inside_it_and_flags_the_power_cap():
    lines = [IDLE, "not a sample", CAPPED, "1740, 690.1, 68, 0x4", "1785, 688.0, 68, 0x0000000000000000"]
    with PowerSampler(command=_stand_in(lines, 0.05)) as power:
        assert power.active
        deadline = time.perf_counter() + 30
        while len(power.samples) < 4 and time.perf_counter() < deadline:
            time.sleep(0.05)
    assert len(power.samples) == 4   # the malformed line is dropped
    times = [s[0] for s in power.samples]
    assert times == sorted(times)
    everything = power.window(times[0], times[-1])
    assert everything["samples"] == 4 and everything["power_capped"]
    assert everything["sm_clock_mhz"] == 1755.0   # median of 345, 1770, 1740, 1785
    assert set(everything["reasons"]) == {"gpu_idle", "sw_power_cap"}
    loaded = power.window(times[1], times[-1])
    assert loaded["sm_clock_mhz"] == 1770.0 and loaded["power_w"] == 689.5 and loaded["temperature_c"] == 68.0
    last = power.window(times[-1], times[-1] + 1)
    assert last["samples"] == 1 and not last["power_capped"] and last["reasons"] == []
    assert power.window(times[-1] + 0.001, times[-1] + 1) is None
    # several ranges: the samples in any of them (the idle one and the last)
    both = power.windows([(times[0], times[0]), (times[-1], times[-1])])
    assert both["samples"] == 2 and both["sm_clock_mhz"] == (345.0 + 1785.0) / 2


def test_sampling_yields_a_running_sampler_or_none():
    with sampling(False) as power:
        assert power is None
    with sampling(command=[]) as power:   # nothing to sample with
        assert power is None
    with sampling(command=_stand_in([CAPPED], 0.01)) as power:
        assert isinstance(power, PowerSampler) and power.active


def test_without_a_sampling_command_nothing_is_recorded():
    with PowerSampler(command=[]) as power:
        assert not power.active
    assert power.window(0.0, time.perf_counter()) is None


def test_bench_attention_records_and_prints_the_clock_of_a_timing():
    record = {"gpu_state": {"sm_clock_mhz": 1770.0, "power_w": 689.5, "power_capped": True}}
    assert ba._gpu_text(record) == "; 1770 MHz 690 W capped"
    assert ba._gpu_text({"gpu_state": None}) == "" and ba._gpu_text({}) == ""

    import jax
    import jax.numpy as jnp
    args = tuple(jnp.full((1, 4, 1, 8), value, jnp.float32) for value in (1.0, 2.0, 3.0))

    def attention_like(q, k, v):
        return q * k + v
    compiled = jax.jit(attention_like).lower(*args).compile()
    power = RecordingPower({"sm_clock_mhz": 1980.0, "power_w": 578.0, "power_capped": False})
    timing = ba._measure(attention_like, compiled, args, power)   # short calls: timed in one program
    # the window asked for is the one around the timings that gave "ms"
    assert timing["gpu_state"]["sm_clock_mhz"] == 1980.0 and len(power.asked) == 1
    start, end = power.asked[0]
    # it spans the timing that reached MIN_TIMING_S and the repeats after it, of which at least half took
    # the median time or longer (each repeat's time varies with the host's load, so no fixed total)
    repeat_s = timing["ms"] * timing["in_graph_repeats"] * timing["calls_per_timing"] / 1e3
    assert end - start >= ba.MIN_TIMING_S + (ba.TIMING_REPEATS + 1) // 2 * repeat_s * 0.999
    assert timing["in_graph_repeats"] == ba.IN_GRAPH_REPEATS
    assert ba._measure(attention_like, compiled, args)["gpu_state"] is None


def test_energy_per_call_is_the_counter_difference_over_the_calls():
    # a stand-in counter that advances 0.5 J per call made: energy per call and mean power come back
    made = []
    counter = {"joules": 100.0}

    def fn(x):
        made.append(x)
        counter["joules"] += 0.5
        return x

    result = gpu_power.joules_per_call(fn, (3,), 8, lambda: counter["joules"], block=lambda out: out)
    assert made == [3] * 8
    assert result["calls"] == 8 and result["joules_per_call"] == pytest.approx(0.5)
    assert result["watts"] == pytest.approx(0.5 * 8 / (result["ms_per_call"] * 8 / 1e3))
    assert gpu_power.joules_per_call(fn, (3,), 8, None) is None


def test_without_nvml_there_is_no_energy_reader():
    assert gpu_power.nvml_energy_reader(library="libno-such-nvml.so") is None
    reader = gpu_power.nvml_energy_reader()   # None on a CPU machine; on a GPU one, a rising counter
    if reader is not None:
        assert reader() <= reader()
