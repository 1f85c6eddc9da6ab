"""`ttj-bench`: the main job. Per shape, every contender in one process and one run:

  baseline     the reference model (docs/spec.md) in eager PyTorch (bench/baseline.py), TF32 on CUDA as the harness sets
  peer         the best PyTorch-only design (bench/torch_peer.py); on CUDA only unless --peer
  ttj_bridge   ttj-jax through the PyTorch bridge: what a harness user gets
  ttj_jax      ttj-jax called from JAX directly: prepared weights, jax arrays in and out

Suites (ttj_jax/shapes.py): 'small' (CPU-sized), 'official' (the harness's shapes 1-13) and 'general'
(real-model-shaped configs: encoders and decoders, padded masks, float16). A shape's padding and dtype are
the harness's --padding-ratio and --dtype: every contender gets that input, checked against the baseline
in that dtype.

Accuracy: the harness's seeds (1234..1238) plus --extra-seeds more, every element checked with the
harness rule against the baseline. Timing: the harness protocol (bench/timing.py) for the torch-facing
contenders; ttj_jax, whose work runs on JAX's own stream that torch's events cannot see, is timed as
JAX users see it in a loop: back-to-back calls, one block_until_ready per round, time / calls.
Results: a table, JSON and (with matplotlib) a PNG of the speedups under --out (default: the git-ignored
results/ at the repository root; `--out bench/results` for a run meant to be committed).
`ttj-bench --report FILE.json [--markdown]` prints a saved run's table (as GitHub markdown: the README's).
`--force-device sm_80` plans as that GPU would (TTJ_FORCE_DEVICE) and files the results under the default
file's "forced_device" section, keeping the rest of the file.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import bridge  # noqa: E402  (sets up jax's allocator before jax touches the GPU)
import ttj_jax as T  # noqa: E402
from bench import switches  # noqa: E402
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.gpu_power import PowerSampler, sampling  # noqa: E402
from bench.paths import default_out_dir, settings_environment  # noqa: E402
from bench.report import by_shape_id, geomean, markdown_table, peer_over_bridge, slug  # noqa: E402
from bench.timing import interleaved_host_overhead_us, time_contenders  # noqa: E402
from bridge import settings  # noqa: E402

HARNESS_SEEDS = tuple(range(1234, 1239))
TIMING_SEED_OFFSET = 100000
# Read by ttj_jax/device.py: the GPU generation the planner plans for.
FORCE_DEVICE_ENV = "TTJ_FORCE_DEVICE"
FORCE_DEVICE_CHOICES = ("sm_80", "sm_89")
# What a forced-device run keeps per shape, under document["forced_device"][<sm>][<shape id>].
FORCED_FIELDS = ("ttj_bridge_ms", "peer_ms", "failed_elements", "worst_err_over_tol", "plan")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="ttj-bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(T.SUITES), default=None,
                   help="shape table: 'small' (CPU-sized, the default without a GPU), 'official' "
                        "(the fourteen harness shapes, the default with one) or 'general' (real-model-shaped configs); "
                        "'--suite train' first on the line runs the training benchmark (bench/train.py)")
    p.add_argument("--shapes", default=None,
                   help="comma-separated shape ids from the suite (default: all the harness can run), each "
                        "optionally with harness options after '@': a dtype, pad<ratio>, scale<input scale> "
                        "(2@float16, 7@pad0.3, 8@scale0.1)")
    p.add_argument("--device", default="auto", help="'auto', 'cpu' or 'cuda'")
    p.add_argument("--extra-seeds", type=int, default=None,
                   help="accuracy seeds beyond the harness's five (default 20 on CUDA, 0 on the CPU)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=None, help="calls per round (default 100, 10 on the CPU)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                   help="include the torch peer (default: on CUDA only)")
    p.add_argument("--out", default=None,
                   help="folder for the JSON and the PNG (default: results/ at the repository root, "
                        "git-ignored; bench/results for a run to commit)")
    p.add_argument("--tag", default=None, help="file name stem (default: <suite>-<date>-<device>)")
    p.add_argument("--merge", action="store_true",
                   help="keep the other shapes already in the output file (runs split over several calls)")
    p.add_argument("--force-device", choices=FORCE_DEVICE_CHOICES, default=None,
                   help=f"plan as that GPU generation would ({FORCE_DEVICE_ENV}); results go to the default file's "
                        "'forced_device' section, the rest of the file kept")
    p.add_argument("--warm", action="store_true",
                   help="run nothing else: let the measured planner decide each shape's plan ahead of time (for the "
                        "bridge, x in the shape's dtype and mask) and keep the decisions in the plan cache")
    p.add_argument("--switch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set a module switch for this run (bench/switches.py), e.g. "
                        "ttj_jax.kernels.flash_attention.UNPADDED_SEQUENCE=true; repeatable; recorded in the JSON")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="run nothing: print the table of a saved result file and write its PNG beside it")
    p.add_argument("--markdown", action="store_true",
                   help="with --report: print the table as GitHub markdown only (no PNG written)")
    args = p.parse_args(argv)
    if args.markdown and not args.report:
        p.error("--markdown needs --report FILE.json")
    return args


def report(json_path: str, *, write_plot: bool = True, markdown: bool = False) -> int:
    """--report: the table and chart of a saved run (e.g. one made on a GPU machine with --no-plot);
    with markdown=True only the markdown table, printed as the README holds it."""
    with open(json_path) as f:
        document = json.load(f)
    suite_name = document.get("suite")
    order = list(T.SUITES.get(suite_name, ()))
    if markdown:
        print(markdown_table(document, order), end="")
        return 0
    ordered = by_shape_id(document["shapes"], order)
    device_name = document.get("device") or document.get("gpu") or "unknown device"
    print_table(ordered, device_name)
    for sm, forced in document.get("forced_device", {}).items():
        print_table(by_shape_id(forced, order), f"{device_name} planned as {sm}")
    if write_plot:
        _plot_beside(ordered, json_path, device_name, suite_name)
    return 0


def _plot_beside(ordered: dict, json_path: str, device_name: str, suite_name: str | None = None) -> None:
    """The chart as a PNG next to the run's JSON (nothing without matplotlib): speedups over the baseline per
    shape; for the general suite, peer/ttj bridge per config."""
    png = json_path.removesuffix(".json") + ".png"
    title = f"ttj-bench: {device_name}"
    if suite_name == "general" and any(peer_over_bridge(r) for r in ordered.values()):
        wrote = plot_peer_ratio(ordered, png, f"ttj-bench --suite general: {device_name}")
    else:
        wrote = plot(ordered, png, title)
    if wrote:
        print(f"wrote {png}")


class Progress:
    """A rich progress bar when rich is installed, plain lines otherwise."""

    def __init__(self, total: int):
        self.total = total
        try:
            from rich.progress import Progress as RichProgress
            self._rich = RichProgress(transient=False)
            self._task = self._rich.add_task("shapes", total=total)
            self._rich.start()
        except ImportError:
            self._rich = None

    def step(self, message: str, advance: int = 0):
        if self._rich is not None:
            self._rich.update(self._task, description=message, advance=advance)
        else:
            print(message, flush=True)

    def close(self):
        if self._rich is not None:
            self._rich.stop()


def ttj_jax_contender(module, config: T.Config, x: torch.Tensor, mask: torch.Tensor | None = None):
    """ttj-jax as a JAX user calls it: prepared weights and jax inputs, no torch in the loop. Planned as
    T.forward plans: for the mask's kind (classified once, on the host), the mask passed where the plan
    masks."""
    params = T.params_from_state_dict({k: v.detach().clone() for k, v in module.state_dict().items()}, config)
    jx = jax.dlpack.from_dlpack(x.detach().clone())
    host_mask = None if mask is None else np.asarray(mask.detach().cpu())
    plan = T.model.plan_for(config, jx, T.classify_mask(host_mask))
    jmask = None
    if host_mask is not None and plan.mask_mode != "none":
        jmask = jax.device_put(host_mask, next(iter(jx.devices())))
    prepared = jax.block_until_ready(T.prepare_weights(params, T.get_policy(plan.policy)))
    # a whole-stack kernel's own weight layout, built once (as T.forward does)
    prepared = jax.block_until_ready(T.model.kernel_weights(prepared, T.model_key(config), plan))
    run = T.executable(plan, T.model_key(config))
    return (lambda: run(prepared, jx, jmask)), plan


def time_jax_loop(fn, *, warmup: int, rounds: int, calls: int) -> dict:
    for _ in range(warmup):
        fn()
    jax.block_until_ready(fn())
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        jax.block_until_ready(fn())
        per_call.append((time.perf_counter() - start) * 1e3 / calls)
    return {"median_ms": statistics.median(per_call), "rounds_ms": per_call, "calls": rounds * calls}


def run_shape(shape: T.Shape, args, device: torch.device, progress: Progress,
              power: PowerSampler | None = None) -> dict:
    config = shape.config
    harness_config = TransformerConfig(**vars(config))
    dtype = getattr(torch, shape.dtype)
    baseline, ours = harness_models(harness_config, bridge.TTJTransformer, device=device, dtype=dtype)
    # the harness's input for this shape: its padding ratio and dtype, for every contender
    inputs = lambda seed: make_inputs(harness_config, seed, padding_ratio=shape.padding, input_scale=shape.input_scale,
                                      device=device, dtype=dtype)
    result = {"config": vars(config), "regime": shape.regime, "padding": shape.padding, "dtype": shape.dtype,
              "input_scale": shape.input_scale}

    contenders = {"baseline": baseline, "ttj_bridge": ours}
    if args.peer:
        from bench.torch_peer import build_peer
        progress.step(f"shape {shape.id}: building the torch peer")
        t0 = time.perf_counter()
        contenders["peer"] = build_peer(baseline, harness_config, device=device)
        result["peer_build_s"] = time.perf_counter() - t0

    # Accuracy: every element of every seed, against the baseline as the harness computes it. Inputs made
    # outside inference mode (as the timing input is) and inside it alternate: the bridge plans a mask it
    # can version (classified once) and an inference-tensor mask (decided on the device) differently, and
    # both plans must pass.
    seeds = HARNESS_SEEDS + tuple(range(2000, 2000 + args.extra_seeds))
    accuracy = {name: [0, 0.0] for name in contenders if name != "baseline"}
    first_call_s = {}
    with torch.inference_mode():
        for i, seed in enumerate(seeds):
            progress.step(f"shape {shape.id}: accuracy seed {i + 1}/{len(seeds)}")
            with torch.inference_mode(i % 2 == 1):
                x, mask = inputs(seed)
            ref = baseline(x, mask)
            for name, fn in contenders.items():
                if name == "baseline":
                    continue
                t0 = time.perf_counter()
                out = fn(x, mask)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                first_call_s.setdefault(name, time.perf_counter() - t0)
                failed, worst = check_close(out, ref)
                accuracy[name][0] += failed
                accuracy[name][1] = max(accuracy[name][1], worst)
                del out
            del ref

    result["first_call_s"] = first_call_s["ttj_bridge"]
    result["first_call_s_by_contender"] = first_call_s
    result["plan"] = bridge.explain(ours, *inputs(HARNESS_SEEDS[0]))
    result["failed_elements"] = accuracy["ttj_bridge"][0]
    result["worst_err_over_tol"] = accuracy["ttj_bridge"][1]
    result["accuracy"] = {name: {"failed_elements": f, "worst_err_over_tol": w}
                          for name, (f, w) in accuracy.items()}
    result["seeds"] = len(seeds)

    # Timing: one fixed input, the harness protocol.
    x, mask = inputs(HARNESS_SEEDS[0] + TIMING_SEED_OFFSET)
    calls = args.calls or (100 if device.type == "cuda" else 10)
    with torch.inference_mode():
        timed = {name: (lambda fn=fn: fn(x, mask)) for name, fn in contenders.items()}
        rounds_done = lambda r, n: progress.step(f"shape {shape.id}: timing round {r}/{n}")
        started = time.perf_counter()
        timings = time_contenders(timed, warmup=args.warmup, rounds=args.rounds, calls=calls, device=device,
                                  progress=rounds_done)
        # the SM clock and power while the contenders' rounds ran (bench/gpu_power.py: the H200's power cap
        # sets its clock); None without nvidia-smi
        result["gpu_state"] = power.window(started, time.perf_counter()) if power is not None else None

    progress.step(f"shape {shape.id}: ttj-jax from JAX")
    jax_fn, jax_plan = ttj_jax_contender(ours, config, x, mask)
    out = torch.from_dlpack(jax.block_until_ready(jax_fn()))
    with torch.inference_mode():
        failed, worst = check_close(out, baseline(x, mask))
    result["ttj_jax_accuracy"] = {"failed_elements": failed, "worst_err_over_tol": worst}
    result["ttj_jax_timing"] = time_jax_loop(jax_fn, warmup=args.warmup, rounds=args.rounds, calls=calls)
    # Host time of one call issued on an idle GPU, every contender sampled in turn (measured apart, minutes
    # apart, the host's pace drifts by more than the differences). The host-cost target compares the
    # bridge's with its GPU time per call (docs/decisions.md); where the torch peer replays a CUDA graph
    # (small shapes), its host time is what a graph-replayed bridge call would cost.
    host_timed = {"ttj_bridge": timed["ttj_bridge"], "ttj_jax": jax_fn}
    if "peer" in timed:
        host_timed["peer"] = timed["peer"]
    with torch.inference_mode():
        host = interleaved_host_overhead_us(host_timed, 100 if device.type == "cuda" else 5, device=device)
    result["bridge_host_us"] = host["ttj_bridge"]["median_us"]
    result["jax_host_us"] = host["ttj_jax"]["median_us"]
    if "peer" in host:
        result["peer_host_us"] = host["peer"]["median_us"]

    result["timing"] = timings
    for name in contenders:
        result[f"{name}_ms"] = timings[name]["median_ms"]
    result["ttj_jax_ms"] = result["ttj_jax_timing"]["median_ms"]
    base_ms = result["baseline_ms"]
    result["speedup"] = {name: base_ms / result[f"{name}_ms"]
                         for name in ("peer", "ttj_bridge", "ttj_jax") if f"{name}_ms" in result}
    del contenders, timed
    return result


def print_table(results: dict, device_name: str):
    """The results table; rows may lack the baseline (forced-device records): shown as '-'.
    peer/ttj: peer_ms / ttj_bridge_ms (above 1: the bridge is faster). Returns the geomean speedups."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    headers = ["shape", "baseline ms", "peer ms", "ttj bridge ms", "ttj jax ms", "bridge x", "jax x",
               "peer/ttj", "failed", "worst err/tol"]
    rows = []
    fmt = lambda v: "-" if v is None else f"{v:.4g}"
    for sid, r in results.items():
        speedup = r.get("speedup", {})
        rows.append([sid, fmt(r.get("baseline_ms")), fmt(r.get("peer_ms")), fmt(r.get("ttj_bridge_ms")),
                     fmt(r.get("ttj_jax_ms")), fmt(speedup.get("ttj_bridge")), fmt(speedup.get("ttj_jax")),
                     fmt(peer_over_bridge(r)), str(r["failed_elements"]), f"{r['worst_err_over_tol']:.3f}"])
    geo = {k: geomean([r.get("speedup", {}).get(k) for r in results.values()]) for k in ("peer", "ttj_bridge", "ttj_jax")}
    footer = "geomean speedup over baseline: " + ", ".join(
        f"{k} {v:.2f}x" for k, v in geo.items() if v is not None)
    ratio = geomean([peer_over_bridge(r) for r in results.values()])
    if ratio is not None:
        footer += f"; geomean peer/ttj bridge: {ratio:.2f}"
    if Console is not None:
        table = Table(title=f"ttj-bench on {device_name}")
        for h in headers:
            table.add_column(h, justify="right")
        for row in rows:
            table.add_row(*row)
        Console(width=160).print(table)
    else:
        print(" | ".join(headers))
        for row in rows:
            print(" | ".join(row))
    print(footer, flush=True)
    return geo


def plot(results: dict, path: str, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ids = list(results)
    series = [("peer", "torch peer"), ("ttj_bridge", "ttj-jax via bridge"), ("ttj_jax", "ttj-jax from JAX")]
    fig, ax = plt.subplots(figsize=(max(6, len(ids) * 0.9), 4))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        values = [results[s]["speedup"].get(key, 0) or 0 for s in ids]
        if any(values):
            ax.bar([j + i * width for j in range(len(ids))], values, width, label=label)
    ax.set_xticks([j + width for j in range(len(ids))], ids)
    ax.set_yscale("log")
    ax.set_ylabel("speedup over baseline (log)")
    ax.set_xlabel("shape")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(series), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_peer_ratio(results: dict, path: str, title: str) -> bool:
    """peer_ms / ttj_bridge_ms per config, one bar each, a line at 1.0 (above it the bridge is faster)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ids = [sid for sid in results if peer_over_bridge(results[sid])]
    values = [peer_over_bridge(results[sid]) for sid in ids]
    fig, ax = plt.subplots(figsize=(max(6, len(ids) * 0.55), 4.5))
    ax.bar(range(len(ids)), values, 0.7, color=["tab:green" if v >= 1 else "tab:red" for v in values])
    ax.set_xticks(range(len(ids)), ids, rotation=60, ha="right", fontsize=8)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel("torch peer ms / ttj bridge ms")
    ax.set_title(title + (f" (geomean {geomean(values):.2f})" if values else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _chosen_shapes(args, *, on_gpu: bool):
    """(suite name, suite, shape ids) that --suite and --shapes choose (default: the official shapes the
    harness can run on a GPU, the small suite elsewhere); None, said on stderr, for an unknown id."""
    suite_name = args.suite or ("official" if on_gpu else "small")
    suite = T.SUITES[suite_name]
    ids = args.shapes.split(",") if args.shapes else [
        s for s in suite if suite_name != "official" or s in T.shapes.HARNESS_IDS]
    unknown = [s for s in ids if s.partition("@")[0] not in suite]
    if unknown:
        print(f"unknown shape id(s) {unknown} for suite {suite_name}; known: {list(suite)} (each optionally with "
              "harness options: 2@float16, 2@pad0.3, 2@scale0.1)", file=sys.stderr)
        return None
    chosen = {}
    for sid in ids:   # "2@pad0.3": shape 2 at the harness's --padding-ratio 0.3 (shapes.with_options)
        name, _, options = sid.partition("@")
        try:
            chosen[sid] = T.shapes.with_options(suite[name], options)
        except ValueError as e:
            print(f"shape {sid}: {e}", file=sys.stderr)
            return None
    return suite_name, chosen, ids


def warm(args) -> int:
    """--warm: the measured planner's decisions for the chosen shapes, made now and kept in the plan cache
    (ttj_jax/plan_cache.py), so that the first real call of each neither measures nor, with jax's
    compilation cache beside it, compiles; on a GPU, the bridge's native lane built too (bridge/native)."""
    from ttj_jax import autotune
    if args.force_device:
        os.environ[FORCE_DEVICE_ENV] = args.force_device
    chosen_shapes = _chosen_shapes(args, on_gpu=jax.default_backend() == "gpu")
    if chosen_shapes is None:
        return 2
    _, suite, ids = chosen_shapes
    if jax.default_backend() == "gpu":   # the bridge's native lane, built (or found built) now
        from bridge import native
        try:
            native.build()
        except RuntimeError as e:
            print(f"the bridge's native lane cannot be built here ({e}); the bridge keeps its Python path", flush=True)
    launched = None
    if jax.default_backend() == "gpu":   # decided as the bridge's calls on this GPU look them up
        import torch

        from bridge import direct
        launched = functools.partial(direct.self_launched_stacks, device=torch.device("cuda"))
    for sid in ids:
        shape = suite[sid]
        kind = T.MaskKind.PREFIX if shape.padding else T.MaskKind.ALL_TRUE
        c = shape.config
        [chosen] = autotune.warm([(c, c.batch_size, c.seq_len, shape.dtype, kind)], self_launched=launched)
        print(f"{sid}: {chosen.explain()}", flush=True)
    return 0


def _load(json_path: str) -> dict | None:
    if not os.path.exists(json_path):
        return None
    with open(json_path) as f:
        return json.load(f)


def _commands(previous: dict | None, command: str) -> list[str]:
    """Every command that wrote into one file, oldest first (a file filled by --merge or --force-device runs)."""
    if previous is None:
        return [command]
    before = previous.get("commands") or ([previous["command"]] if previous.get("command") else [])
    return [*before, command]


def main(argv=None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:2] == ["--suite", "train"] or "--suite=train" in given:   # the training benchmark: bench/train.py
        from bench import train
        return train.main([a for a in given if a not in ("--suite=train",)][2 if given[:2] == ["--suite", "train"] else 0:])
    args = parse_args(argv)
    if args.report:
        return report(args.report, write_plot=not args.no_plot, markdown=args.markdown)
    try:
        switched = switches.apply(args.switch)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.warm:
        return warm(args)
    forced = args.force_device
    if forced:   # before any planning: ttj_jax reads it when it plans
        os.environ[FORCE_DEVICE_ENV] = forced
    elif os.environ.get(FORCE_DEVICE_ENV):
        print(f"{FORCE_DEVICE_ENV}={os.environ[FORCE_DEVICE_ENV]} is set: plans are not this GPU's own; "
              "use --force-device to file the results as such", file=sys.stderr)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    chosen_shapes = _chosen_shapes(args, on_gpu=on_cuda)
    if chosen_shapes is None:
        return 2
    suite_name, suite, ids = chosen_shapes
    order = list(T.SUITES[suite_name]) + [sid for sid in ids if sid not in T.SUITES[suite_name]]
    if any(sid.partition("@")[0] == "14" for sid in ids):
        print("shape 14 cannot run through the harness protocol (its baseline cannot exist); "
              "see the scale tooling", file=sys.stderr)
        return 2
    args.peer = on_cuda if args.peer is None else args.peer
    args.extra_seeds = (20 if on_cuda else 0) if args.extra_seeds is None else args.extra_seeds
    if on_cuda:   # what the harness sets: the baseline runs its matmuls in TF32
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device_name = torch.cuda.get_device_name(device) if on_cuda else f"cpu ({platform.machine()})"

    date = datetime.date.today().isoformat()
    tag = args.tag or f"{suite_name}-{date}-{slug(device_name.removeprefix('NVIDIA '))}"
    out_dir = args.out or default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{tag}.json")
    command = "ttj-bench " + " ".join(sys.argv[1:] if argv is None else argv)
    document = {"gpu": device_name if on_cuda else None, "device": device_name, "jax": jax.__version__,
                "torch": torch.__version__, "date": date, "suite": suite_name, "command": command,
                "bridge_keep_x_import": settings.keep_x_import(),
                "environment": settings_environment(),
                "switches": switched, "shapes": {}}
    previous = _load(json_path) if (args.merge or forced) else None
    if forced:
        # a forced-device run adds its records to the file's "forced_device" section; the rest is kept
        if previous is not None:
            document = {**previous, "command": command}
        document["commands"] = _commands(previous, command)
        section = document.setdefault("forced_device", {}).setdefault(forced, {})
    elif previous is not None:   # --merge: runs split over several calls fill one file
        if previous.get("device") == device_name:
            document["shapes"] = previous.get("shapes", {})
            if "forced_device" in previous:
                document["forced_device"] = previous["forced_device"]
        document["commands"] = _commands(previous, command)

    progress = Progress(len(ids))
    results = {}
    try:
        with sampling(on_cuda) as power:
            for sid in ids:
                shape = suite[sid]
                progress.step(f"shape {sid}: {shape.describe()}")
                results[sid] = run_shape(shape, args, device, progress, power)
                if forced:
                    section[sid] = {key: results[sid].get(key) for key in FORCED_FIELDS}
                else:
                    document["shapes"][sid] = results[sid]
                progress.step(f"shape {sid}: done", advance=1)
                with open(json_path, "w") as f:
                    json.dump(document, f, indent=1)
                if on_cuda:
                    torch.cuda.empty_cache()
    finally:
        progress.close()
    if forced:   # the rows of this run, planned as the forced GPU; the file's main table is left as it was
        print_table(by_shape_id(results, order), f"{device_name} planned as {forced}")
        with open(json_path, "w") as f:
            json.dump(document, f, indent=1)
        print(f"wrote {json_path} (forced_device/{forced})")
    else:
        ordered = by_shape_id(document["shapes"], order)
        document["geomean_speedup"] = print_table(ordered, device_name)
        with open(json_path, "w") as f:
            json.dump(document, f, indent=1)
        print(f"wrote {json_path}")
        if not args.no_plot:
            _plot_beside(ordered, json_path, device_name, suite_name)
    checked = results if forced else document["shapes"]
    failed = sum(r["failed_elements"] + r["ttj_jax_accuracy"]["failed_elements"] for r in checked.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
