"""`python -m bench.scale`: shape 14 (or any causal config) checked and timed without its impossible baseline.

Shape 14 (B=32, S=100000, d=1024) has no baseline: its [B, H, S, S] scores would take 20 TB. Instead:
  1. time ttj-jax through the bridge, harness-style (CUDA events on torch's stream, median of the timed
     calls after one warm-up), and measure the device memory it needs beyond its input and output;
  2. prefix check, every sequence: causal output rows [:, :K] depend only on input rows [:, :K] (docs/spec.md),
     so each sequence's first K output rows are compared with a reference run on its first K input rows:
     the torch baseline in fp32 with TF32 off when its K x K scores fit, else the chunked fp32 reference;
  3. full check, the first N sequences: the chunked fp32 reference (ttj_jax/chunked_reference.py) on the
     whole sequence; this is what catches an error that only long range attention makes.
Every comparison uses the harness rule. Writes `<out>/scale-<date>-<gpu>.json`; exits 1 if any element fails.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402  (sets up jax's allocator before jax touches the GPU)
import ttj_jax as T  # noqa: E402
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.gpu_power import PowerSampler, sampling  # noqa: E402
from bench.paths import default_out_dir  # noqa: E402
from bench.report import slug  # noqa: E402
from ttj_jax.chunked_reference import chunked_reference_forward  # noqa: E402
from ttj_jax.params import to_jax_array  # noqa: E402
from ttj_jax.planner import forward_flop  # noqa: E402

# The torch baseline builds about three [1, H, K, K] fp32 tensors at once (scores, masked scores, probs):
# below this size for one of them it is the prefix reference, above it the chunked reference is.
TORCH_PREFIX_SCORES_LIMIT_BYTES = 8e9
# Rows per slice where two full outputs are compared element by element (max |diff|), bounding the
# temporaries on the device.
CHECK_ROWS = 8192
INPUT_SEED = 1234
PEER_BATCH_CHUNK = 4   # the torch peer runs shape 14 four sequences at a time, as its reference number was taken
GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="14", help="an official shape id (ttj_jax.shapes.OFFICIAL)")
    p.add_argument("--config", default=None, help="B,S,d,H,ffn,L: a custom causal config instead of --shape")
    p.add_argument("--prefix-k", type=int, default=8192, help="rows per sequence in the prefix check")
    p.add_argument("--prefix-ref", choices=("auto", "torch", "chunked"), default="auto",
                   help="prefix reference: the torch baseline (fp32, TF32 off) or the chunked JAX one; "
                        "auto picks torch while its K x K scores fit")
    p.add_argument("--full-ref", type=int, default=2, help="sequences checked whole against the chunked reference")
    p.add_argument("--ref-chunk", type=int, default=2048,
                   help="query and key chunk of the chunked reference (live scores: H * chunk^2 * 4 bytes)")
    p.add_argument("--timing-calls", type=int, default=3, help="timed calls after one warm-up call")
    p.add_argument("--peer", action="store_true", help="also time the torch peer, in batch chunks of 4")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--multi-second", default="6",
                   help="with several devices: the second config split over them (shape id or B,S,d,H,ffn,L)")
    p.add_argument("--no-multi", action="store_true", help="skip the several-devices section")
    p.add_argument("--split-chunks", default="1,4",
                   help="with several devices: chunk counts to time the split with (bridge.forward's "
                        "split_chunks: copies between GPUs overlapped with compute), comma separated; a "
                        "dash-separated entry gives chunk weights (1-4-4-1: small first and last chunks)")
    p.add_argument("--split-chunks-first", default=None,
                   help="the same for this input (shape 14) alone; default: --split-chunks")
    p.add_argument("--split-home-rows", default="0",
                   help="with several devices: rows computed on x's own device alone besides its share of the "
                        "split (bridge.forward's split_home_rows), comma separated; combined with each chunk count")
    p.add_argument("--stream", action="store_true",
                   help="keep x in host memory and stream it through the device (bridge.stream_forward); "
                        "with XLA_PYTHON_CLIENT_MEM_FRACTION capping jax below the input's size")
    p.add_argument("--stream-chunk", type=int, default=None,
                   help="sequences per streamed chunk (default: the planner's, from device memory)")
    p.add_argument("--out", default=default_out_dir(), help="folder for the JSON")
    p.add_argument("--tag", default=None, help="file name stem (default: scale-<date>-<gpu>)")
    args = p.parse_args(argv)
    if args.timing_calls < 1 or args.prefix_k < 1 or args.full_ref < 0 or args.ref_chunk < 1:
        p.error("--timing-calls, --prefix-k and --ref-chunk must be >= 1, --full-ref >= 0")
    return args


def config_from_args(args) -> T.Config:
    return config_from_spec(args.shape if args.config is None else args.config)


def config_from_spec(spec: str) -> T.Config:
    """An official shape id, or six ints B,S,d,H,ffn,L for a custom causal config."""
    if "," not in spec:
        if spec not in T.OFFICIAL:
            raise ValueError(f"unknown shape id {spec!r}; known: {list(T.OFFICIAL)}")
        return T.OFFICIAL[spec].config
    fields = [int(v) for v in spec.split(",")]
    if len(fields) != 6:
        raise ValueError(f"a config needs six ints B,S,d,H,ffn,L; got {spec!r}")
    B, S, d, H, ffn, L = fields
    return T.Config(batch_size=B, seq_len=S, d_model=d, num_heads=H, ffn_dim=ffn, num_layers=L, causal=True)


class Progress:
    """One rich progress bar per step when rich is installed, plain lines otherwise."""

    def __init__(self):
        try:
            from rich.progress import Progress as RichProgress
            from rich.progress import TimeElapsedColumn
            self._rich = RichProgress(*RichProgress.get_default_columns(), TimeElapsedColumn())
            self._rich.start()
        except ImportError:
            self._rich = None

    def start(self, name: str, total: int):
        self._name, self._total, self._done = name, total, 0
        if self._rich is not None:
            self._task = self._rich.add_task(name, total=total)

    def advance(self, note: str = ""):
        self._done += 1
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=f"{self._name} {note}".strip())
        else:
            print(f"{self._name}: {self._done}/{self._total} {note}".rstrip(), flush=True)

    def close(self):
        if self._rich is not None:
            self._rich.stop()


@contextlib.contextmanager
def exact_fp32_matmuls():
    """TF32 off while the torch baseline serves as the reference (the harness turns it on: docs/spec.md)."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32 = saved[1]


def make_input(config: T.Config, device: torch.device):
    """randn(B, S, d) fp32 written in place, so no second full-size temporary (13.1 GB at shape 14) exists;
    and the harness's all-True mask (a tensor, not None)."""
    gen = torch.Generator(device=device).manual_seed(INPUT_SEED)
    x = torch.empty(config.batch_size, config.seq_len, config.d_model, device=device)
    x.normal_(generator=gen)
    return x, torch.ones(config.batch_size, config.seq_len, dtype=torch.bool, device=device)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_calls(fn, calls: int, device, progress: Progress, name: str, power: PowerSampler | None = None,
                gpu_states: dict | None = None):
    """1 warm-up call (its wall time, compile included, reported apart), then `calls` timed calls: CUDA events
    on torch's current stream as the harness records them, perf_counter on the CPU. Returns (ms list,
    first call s, last output). The previous output is dropped before each call so two never coexist.
    With a running PowerSampler, gpu_states[name] gets the SM clock and power of the timed calls
    (bench/gpu_power.py: on the H200 the power cap sets the clock)."""
    progress.start(name, calls + 1)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    first_call_s = time.perf_counter() - t0
    progress.advance(f"warm-up {first_call_s:.1f} s")
    timed_from = time.perf_counter()
    samples = []
    for _ in range(calls):
        out = None
        if device.type == "cuda":
            torch.cuda.set_device(device)   # a jax call may have made another GPU current (see main)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(device))
            out = fn()
            end.record(torch.cuda.current_stream(device))
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            out = fn()
            samples.append((time.perf_counter() - t) * 1e3)
        progress.advance(f"{samples[-1]:.1f} ms")
    if power is not None and gpu_states is not None:
        gpu_states[name] = power.window(timed_from, time.perf_counter())
    return samples, first_call_s, out


def _jax_memory(device):
    if device.type != "cuda":
        return None
    try:
        return jax.devices()[device.index or 0].memory_stats() or None
    except Exception:   # memory_stats is optional in PJRT plugins
        return None


def time_bridge(ours, x, mask, args, device, progress, power=None, gpu_states=None):
    """Times the bridge and measures its peak device memory beyond its input and output: torch's own
    allocations (reset just before) plus jax's allocator (its peak since process start; nothing jax ran
    before this outweighs it: weight views are torch's memory). The output lives in exactly one of the two
    allocators (jax's, when the bridge exports zero-copy), so it is subtracted once from their sum.
    Caveat: jax's peak includes the warm-up call, and with it compile-time scratch such as autotuning."""
    jax_before = _jax_memory(device)
    if device.type == "cuda":
        torch_before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        samples, first_call_s, out = timed_calls(lambda: ours(x, mask), args.timing_calls, device, progress,
                                                 "ttj via bridge", power, gpu_states)
    if device.type != "cuda":
        return samples, first_call_s, out, {"peak_extra_gb": None, "torch_peak_extra_gb": None,
                                            "jax_peak_extra_gb": None}
    torch_extra = torch.cuda.max_memory_allocated(device) - torch_before
    jax_after = _jax_memory(device)
    jax_extra = (jax_after["peak_bytes_in_use"] - jax_before.get("bytes_in_use", 0)
                 if jax_before and jax_after and "peak_bytes_in_use" in jax_after else None)
    # Without jax's figure the output's owner is unknown, so no total is claimed.
    total = None if jax_extra is None else (torch_extra + jax_extra - out.numel() * out.element_size()) / GB
    return samples, first_call_s, out, {"peak_extra_gb": total, "torch_peak_extra_gb": torch_extra / GB,
                                        "jax_peak_extra_gb": None if jax_extra is None else jax_extra / GB}


def time_stream(ours, x, mask, args, progress):
    """--stream: the input in host memory, streamed through the device in batch chunks
    (bridge.stream_forward). Run under a cap on jax's memory (XLA_PYTHON_CLIENT_MEM_FRACTION) to show an
    input larger than what jax may use. One warm-up on the first chunk's worth of sequences (compiles),
    then one timed full pass, wall clock. Returns what time_bridge returns; the output is on the host."""
    x_host, mask_host = x.cpu(), mask.cpu()
    chunk = args.stream_chunk
    if chunk is None:   # the planner's chunk, fixed here so the warm-up compiles the timed pass's program
        from ttj_jax.masks import classify_mask
        from ttj_jax.planner import InputFacts, device_facts, streaming_chunk
        B, S = x_host.shape[:2]
        chunk = streaming_chunk(T.Config.from_object(ours.config),
                                InputFacts(B, S, "float32", classify_mask(mask_host.numpy())),
                                device_facts(jax.devices()[0]))
    chunk = min(chunk, x_host.shape[0])
    args.stream_chunk_used = chunk
    t0 = time.perf_counter()
    bridge.stream_forward(ours, x_host[:chunk], mask_host[:chunk], batch_chunk=chunk, progress=False)
    first_call_s = time.perf_counter() - t0
    progress.start(f"ttj streamed from host ({x_host.numel() * 4 / GB:.1f} GB)", 1)
    t0 = time.perf_counter()
    out = bridge.stream_forward(ours, x_host, mask_host, batch_chunk=chunk, progress=False)
    samples = [(time.perf_counter() - t0) * 1e3]
    progress.advance(f"{samples[0] / 1e3:.1f} s")
    memory = _jax_memory(x.device) or {}
    peak = memory.get("peak_bytes_in_use")
    return samples, first_call_s, out, {"peak_extra_gb": None if peak is None else peak / GB,
                                        "torch_peak_extra_gb": None,
                                        "jax_peak_extra_gb": None if peak is None else peak / GB}


def check_sequences(out, x, mask, rows: int, count: int, reference, progress, name: str):
    """Compares out[b, :rows] with reference(x[b:b+1, :rows], mask[b:b+1, :rows]) for b < count."""
    failed, worst = 0, 0.0
    progress.start(name, count)
    for b in range(count):
        ref = reference(x[b:b + 1, :rows], mask[b:b + 1, :rows])
        f, w = check_close(out[b:b + 1, :rows], ref)
        failed, worst = failed + f, max(worst, w)
        del ref
        progress.advance(f"failed {failed}, worst err/tol {worst:.3f}")
    return failed, worst


def chunked_reference(params, config, chunk: int):
    def reference(x, mask):
        # Cloned (at most one sequence: 0.4 GB at shape 14): a prefix view x[b:b+1, :K] keeps the full
        # sequence's batch stride, which a DLPack import need not accept as dense.
        jx, jm = to_jax_array(x.clone()), to_jax_array(mask.clone())
        return torch.from_dlpack(jax.block_until_ready(chunked_reference_forward(
            params, jx, jm, config=config, query_chunk=chunk, key_chunk=chunk)))
    return reference


def time_peer(baseline, harness_config, x, mask, args, device, progress, power=None, gpu_states=None):
    """Optional: the torch peer called per chunk of 4 sequences into one preallocated output."""
    from bench.torch_peer import build_peer
    peer = build_peer(baseline, harness_config, device=device)
    out = torch.empty_like(x)

    def run():
        for c in range(0, x.shape[0], PEER_BATCH_CHUNK):
            out[c:c + PEER_BATCH_CHUNK] = peer(x[c:c + PEER_BATCH_CHUNK], mask[c:c + PEER_BATCH_CHUNK])
        return out

    with torch.inference_mode():
        samples, _, _ = timed_calls(run, args.timing_calls, device, progress, "torch peer", power, gpu_states)
    return statistics.median(samples)


def multi_device(ours, x, mask, args, device, progress) -> dict | None:
    """With several devices visible: the same call split over all of them (JAX SPMD, parallel.py) against
    one device, on this input and on a second config (official shape 6 by default). None with one device.

    Each split variant is a chunk count C (bridge.forward's split_chunks) and a count R of rows computed
    on x's own device alone (split_home_rows). This input's calls take seconds: each is timed apart, a sync
    after every call (timed_calls). The second config's take milliseconds: there the one-device call and
    every variant are timed together with the harness's own protocol (bench.timing.time_contenders:
    warm-up, alternating rounds of back-to-back calls, CUDA events per call), in which a call's host work
    is hidden behind the previous call's GPU work exactly as far as it is in the harness."""
    n = len(jax.devices())
    if n < 2 or args.no_multi:
        return None
    from bench.timing import time_contenders
    result = {"devices": n}
    second = config_from_spec(args.multi_second)
    _, second_model = harness_models(TransformerConfig(**vars(second)), bridge.TTJTransformer, device=device)
    x2, mask2 = make_inputs(second, 4321, device=device)
    diffs, failed = [], 0
    home_rows = [int(r) for r in args.split_home_rows.split(",")]
    for name, model, xs, ms, calls, specs in (
            ("shape14", ours, x, mask, args.timing_calls, args.split_chunks_first or args.split_chunks),
            ("shape6", second_model, x2, mask2, max(args.timing_calls, 20), args.split_chunks)):
        # Both device counts are timed explicitly: with several devices visible the planner's default call
        # (the one time_bridge timed) is already split over them, so it is no one-device figure.
        variants = {"one": lambda m=model, a=xs, b=ms: bridge.forward(m, a, b, data_parallel=1)}
        for (spec, home), fn in split_variants(model, xs, ms, n, specs.split(","), home_rows).items():
            variants[f"chunks{spec}" + (f"_home{home}" if home else "")] = fn
        with torch.inference_mode():
            if name == "shape14":
                result[f"{name}_timing_protocol"] = "one call at a time, synced (timed_calls)"
                times, outputs = {}, {}
                for key, fn in variants.items():
                    label = "1 device" if key == "one" else f"{n} devices, {key}"
                    times[key], _, outputs[key] = timed_calls(fn, calls, device, progress, f"{name} on {label}")
                    if key != "one":   # compared now, so that only two full outputs coexist
                        outputs[key] = _compare(outputs[key], outputs["one"])
            else:
                result[f"{name}_timing_protocol"] = (f"harness: time_contenders, 3 rounds of {calls} calls, "
                                                     "all variants interleaved")
                progress.start(f"{name}: 1 device and {len(variants) - 1} split variant(s)", 3)
                timed = time_contenders(variants, warmup=5, rounds=3, calls=calls, device=device, keep_samples=True,
                                        progress=lambda done, total: progress.advance(f"round {done}/{total}"))
                times = {key: v["samples_ms"] for key, v in timed.items()}
                one = variants["one"]()
                outputs = {key: _compare(fn(), one) for key, fn in variants.items() if key != "one"}
                del one
        result[f"{name}_ms_one"] = statistics.median(times["one"])
        result[f"{name}_timing_ms_one"] = times["one"]
        for key in variants:
            if key == "one":
                continue
            diff, f, w = outputs[key]
            diffs.append(diff)
            failed += f
            ms = statistics.median(times[key])
            result[f"{name}_ms_many_{key}"] = ms
            result[f"{name}_timing_ms_many_{key}"] = times[key]
            result[f"{name}_max_abs_diff_{key}"] = diff
            result[f"{name}_worst_err_over_tol_vs_one_{key}"] = w
            if f"{name}_ms_many" not in result or result[f"{name}_ms_many"] > ms:
                result[f"{name}_ms_many"], result[f"{name}_split"] = ms, key
        result[f"{name}_speedup"] = result[f"{name}_ms_one"] / result[f"{name}_ms_many"]
        del outputs
    result["max_abs_diff_vs_one_gpu"] = max(diffs)
    result["harness_failed_vs_one_gpu"] = failed
    return result


def split_variants(model, x, mask, devices: int, chunk_specs: list[str], home_rows: list[int]) -> dict:
    """{(chunk spec, home rows): a call of bridge.forward split over `devices`} for each combination that
    x's batch takes (the others are left out). A chunk spec is one --split-chunks entry: "4" (four equal
    chunks) or "1-4-4-1" (chunk weights); home rows: bridge.forward's split_home_rows."""
    variants = {}
    for spec in chunk_specs:
        chunks = tuple(int(w) for w in spec.split("-")) if "-" in spec else int(spec)
        for home in home_rows:
            if home < x.shape[0] and _splits(x.shape[0] - home, devices, chunks):
                variants[(spec, home)] = (lambda c=chunks, h=home: bridge.forward(
                    model, x, mask, data_parallel=devices, split_chunks=c, split_home_rows=h))
    return variants


def _splits(rows: int, devices: int, chunks) -> bool:
    from ttj_jax.parallel import split_chunk_rows
    try:
        split_chunk_rows(rows, devices, chunks)
        return True
    except ValueError:
        return False


def _compare(many: torch.Tensor, single: torch.Tensor) -> tuple[float, int, float]:
    """(max |diff|, harness-rule failures, worst err/tol) of a split call's output against one device's,
    in row slices of CHECK_ROWS so the temporaries stay bounded."""
    diff = float(max((single[:, i:i + CHECK_ROWS] - many[:, i:i + CHECK_ROWS]).abs().max()
                     for i in range(0, single.shape[1], CHECK_ROWS)))
    failed, worst = check_close(many, single)
    return diff, failed, worst


def print_table(rows: list[tuple[str, str]], title: str):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for name, value in rows:
            print(f"  {name:<28} {value}")
        return
    table = Table(title=title)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    for row in rows:
        table.add_row(*row)
    Console(width=120).print(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as e:
        print(f"bench.scale: {e}", file=sys.stderr)
        return 2
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        # jax's GPU start-up leaves the last GPU current on this thread (seen with two H200s: torch then
        # put x on cuda:1 while the module sat on cuda:0, and refused DLPack exports of cuda:0 tensors).
        # Start jax first, then make GPU 0 current and name it everywhere.
        jax.devices()
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    if on_cuda:   # what the harness sets; the prefix reference turns TF32 off for itself
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = True
    device_name = torch.cuda.get_device_name(device) if on_cuda else f"cpu ({platform.machine()})"
    date = datetime.date.today().isoformat()
    stem = args.tag or f"scale-{date}-{slug(device_name.removeprefix('NVIDIA ')) if on_cuda else 'cpu'}"
    B, S, H = config.batch_size, config.seq_len, config.num_heads
    K = min(args.prefix_k, S)
    n_full = min(args.full_ref, B)
    use_torch = args.prefix_ref == "torch" or (
        args.prefix_ref == "auto" and K * K * H * 4 < TORCH_PREFIX_SCORES_LIMIT_BYTES)

    harness_config = TransformerConfig(**vars(config))
    baseline, ours = harness_models(harness_config, bridge.TTJTransformer, device=device)
    # Through host copies, then onto jax's first device: with two GPUs visible, jax.dlpack.from_dlpack refused
    # these cuda:0 tensors (on two H200s; see the current-device note in main).
    params = jax.device_put(T.params_from_state_dict(
        {k: v.detach().cpu().clone() for k, v in baseline.state_dict().items()}, config), jax.devices()[0])
    chunked = chunked_reference(params, config, args.ref_chunk)

    def write(peer_ms, multi, pending=None):
        """The JSON, written before the peer's timing too (pending names what is still to come), so a run
        stopped during the peer's long compile still leaves its measurements."""
        ttj_ms = statistics.median(samples)
        result = {
            "ttj_bridge_ms": ttj_ms, "peer_ms": peer_ms, **memory,
            "prefix_failed": prefix_failed, "prefix_k": K, "full_ref_failed": full_failed, "full_ref_sequences": n_full,
            "worst_err_over_tol": max(prefix_worst, full_worst), "plan": plan,
            "mode": "streamed from host memory" if args.stream else "in device memory",
            "prefix_worst_err_over_tol": prefix_worst, "full_ref_worst_err_over_tol": full_worst,
            "prefix_reference": "torch-baseline-fp32-no-tf32" if use_torch else "chunked-jax-fp32",
            "ref_chunk": args.ref_chunk, "stream_chunk": getattr(args, "stream_chunk_used", None),
            "timing_ms": samples, "first_call_s": first_call_s,
            "ttj_bridge_tflops": forward_flop(config, B, S) / (ttj_ms * 1e-3) / 1e12, "step_seconds": steps,
            # per timed contender, the SM clock and power while its calls ran (empty without nvidia-smi)
            "gpu_state": gpu_states,
        }
        document = {"gpu": device_name if on_cuda else None, "device": device_name, "jax": jax.__version__,
                    "torch": torch.__version__, "date": date,
                    "command": "python -m bench.scale " + " ".join(sys.argv[1:] if argv is None else argv),
                    "visible_devices": len(jax.devices()), "config": vars(config), "shape14": result,
                    "multi_gpu": multi}
        if pending:
            document["pending"] = pending
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{stem}.json")
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
        return path, result

    progress = Progress()
    steps = {}
    gpu_states = {}
    running = contextlib.ExitStack()   # the clock/power sampler, running until the end of the run
    try:
        power = running.enter_context(sampling(on_cuda))
        t = time.perf_counter()
        x, mask = make_input(config, device)
        _sync(device)
        steps["input_s"] = time.perf_counter() - t
        plan = bridge.explain(ours, x, mask)

        t = time.perf_counter()
        samples, first_call_s, out, memory = (time_stream(ours, x, mask, args, progress) if args.stream
                                              else time_bridge(ours, x, mask, args, device, progress, power,
                                                               gpu_states))
        steps["timing_s"] = time.perf_counter() - t
        if on_cuda:
            torch.cuda.empty_cache()

        t = time.perf_counter()
        with exact_fp32_matmuls(), torch.inference_mode():
            prefix_failed, prefix_worst = check_sequences(
                out, x, mask, K, B, baseline if use_torch else chunked, progress,
                f"prefix check, K={K}, {'torch fp32' if use_torch else 'chunked'} reference")
        steps["prefix_check_s"] = time.perf_counter() - t
        if on_cuda:
            torch.cuda.empty_cache()

        t = time.perf_counter()
        full_failed, full_worst = check_sequences(out, x, mask, S, n_full, chunked, progress,
                                                  f"full check, S={S}, chunked reference")
        steps["full_check_s"] = time.perf_counter() - t

        t = time.perf_counter()
        multi = None if args.stream else multi_device(ours, x, mask, args, device, progress)
        if multi is not None:
            steps["multi_device_s"] = time.perf_counter() - t

        peer_ms = None
        if args.peer:
            write(None, multi, pending="torch peer timing")
            del out   # the peer writes its own full-size output
            t = time.perf_counter()
            peer_ms = time_peer(baseline, harness_config, x, mask, args, device, progress, power, gpu_states)
            steps["peer_s"] = time.perf_counter() - t
    finally:
        progress.close()
        running.close()

    ttj_ms = statistics.median(samples)
    path, result = write(peer_ms, multi)
    gb = {k: "-" if v is None else f"{v:.2f}" for k, v in memory.items()}
    print_table([
        ("config", f"B={B} S={S} d={config.d_model} H={H} ffn={config.ffn_dim} L={config.num_layers}"),
        ("ttj via bridge, median ms", f"{ttj_ms:.3f} ({result['ttj_bridge_tflops']:.3g} TFLOP/s)"),
        ("torch peer, median ms", "-" if peer_ms is None else f"{peer_ms:.3f}"),
        ("peak extra GB (torch + jax)",
         f"{gb['peak_extra_gb']} ({gb['torch_peak_extra_gb']} + {gb['jax_peak_extra_gb']})"),
        (f"prefix check, K={K}, {B} seqs", f"failed {prefix_failed}, worst {prefix_worst:.3f}"),
        (f"full check, {n_full} seqs", f"failed {full_failed}, worst {full_worst:.3f}"),
    ], f"bench.scale on {device_name}")
    if multi is not None:
        print(f"{multi['devices']} devices: shape-14 input {multi['shape14_speedup']:.2f}x, second config "
              f"{multi['shape6_speedup']:.2f}x faster than one; max |diff| {multi['max_abs_diff_vs_one_gpu']:.2e}, "
              f"harness-rule failures {multi['harness_failed_vs_one_gpu']}")
    print(f"plan: {plan}")
    print(f"wrote {path}")
    multi_failed = multi is not None and multi["harness_failed_vs_one_gpu"] > 0
    return 1 if prefix_failed or full_failed or multi_failed else 0


if __name__ == "__main__":
    sys.exit(main())
