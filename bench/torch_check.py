"""ttj-jax as a PyTorch user meets it, per official shape, on one GPU: the bridge module's host time per call
against its GPU time per call, the harness's two ways of plugging it in (the user class and the one-line
drop-in), and the module inside a small torch model under torch.compile next to the torch peer there.

    python -m bench.torch_check [--shapes 1,...,13 | all] [--rounds 3] [--calls 50] [--out DIR]
                                [--merge EARLIER.json] [--device cuda | cpu [--compile-on-cpu]]

Per shape (under torch.inference_mode, TF32 baseline GEMMs, as the harness runs):
    host_us           the bridge module's (`bridge.TTJTransformer`) host time per call: issued on an idle GPU,
                      `perf_counter` around the call, no sync inside it; median of rounds * calls samples
                      (bench.timing.interleaved_host_overhead_us, as bench.host_overhead's `bridge`)
    gpu_us            the same module's time per call under the harness's CUDA events, back-to-back calls
                      (bench.timing.time_contenders, the module alone)
    host_over_gpu     host_us / gpu_us (about 1 or more: a host-bound call)
    loop_host_us      the host's time per call in the harness's own loop (bench.timing.loop_host_us: 20
                      calls back to back between their event records, from an idle GPU, no sync inside),
                      the interval at which the host hands the GPU work; loop_host_over_gpu: over gpu_us
    class_ms          the harness's time of `bridge.TTJTransformer` as its user class, and
    dropin_ms         of the one-line drop-in (`bridge.forward(self, x, mask)` in the harness's class,
                      bench.compile_check.DropIn), timed in one time_contenders call, so they alternate
    class_vs_dropin   max(class_ms, dropin_ms) / min(class_ms, dropin_ms)
    native_lane       per plug-in way, whether its calls went through the bridge's native lane (bridge/native)
    compiled_ms       Linear(d, d) -> our module -> Linear(d, d) (Wrapped below) under torch.compile
                      (default mode), and
    compiled_peer_ms  the same wrapper around the torch peer's model (bench.torch_peer.build_peer, its own
                      compile and CUDA graph off, its Python front left out: PeerInner), timed in one call
    accuracy          per contender (class, dropin, compiled) the harness rule (bench.baseline.check_close)
                      against the baseline module (class, drop-in) or the same wrapper around it (compiled),
                      eager; failed_elements is their sum. The compiled peer's: compiled_peer_accuracy.
    graph_breaks      per compiled wrapper, the graph breaks Dynamo took over its first two calls (0 expected:
                      our module is one opaque op, PeerInner leaves the peer's Python front out)
A contender that raises leaves its fields None and its error under "errors"; the other ones still run.

Writes <out>/torch-<date>-<gpu>.json (bench.paths.result_file) after every shape, prints one line per shape
and a table last; exit status 1 if any element failed or any contender raised.
--device cpu is a smoke test of the script (a few calls; times are wall-clock there, gpu_us included) and
leaves the torch.compile contenders out unless --compile-on-cpu.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import bridge  # noqa: E402
import ttj_jax as T  # noqa: E402
from bench.baseline import TransformerConfig, check_close, harness_models, make_inputs  # noqa: E402
from bench.compile_check import DropIn  # noqa: E402
from bench.host_overhead import parse_shapes  # noqa: E402
from bench.paths import result_file  # noqa: E402
from bench.report import describe_error, run_shapes  # noqa: E402
from bench.timing import interleaved_host_overhead_us, loop_host_us, time_contenders  # noqa: E402
from bench.torch_peer import MASK_NONE, build_peer, classify_mask  # noqa: E402
from bridge import runtime  # noqa: E402
from ttj_jax.shapes import HARNESS_IDS  # noqa: E402

# the accuracy and timing input (planner_check's)
INPUT_SEED = 1234
# the seed of the wrapper's two Linears (one pair, copied into every wrapper of a shape)
WRAPPER_SEED = 99
# warmup / rounds / calls where the command line leaves them out
DEFAULTS = {"cuda": {"warmup": 20, "rounds": 3, "calls": 50}, "cpu": {"warmup": 1, "rounds": 2, "calls": 2}}
# the contenders whose failing elements make up failed_elements
ACCURACY_CONTENDERS = ("class", "dropin", "compiled")
FIELDS = ("host_us", "gpu_us", "host_over_gpu", "loop_host_us", "loop_host_over_gpu", "class_ms", "dropin_ms",
          "class_vs_dropin", "compiled_ms",
          "compiled_peer_ms", "failed_elements")


class Wrapped(nn.Module):
    """A small torch model around a transformer stack: Linear(d, d) -> inner(h, mask) -> Linear(d, d)."""

    def __init__(self, inner, before: nn.Linear, after: nn.Linear):
        super().__init__()
        self.before, self.inner, self.after = copy.deepcopy(before), inner, copy.deepcopy(after)

    def forward(self, x, valid_token_mask=None):
        return self.after(self.inner(self.before(x), valid_token_mask))


def _attempt(record: dict, name: str, fn):
    """fn()'s value, or None with the error recorded under record["errors"][name]."""
    try:
        return fn()
    except Exception as e:   # noqa: BLE001 - a contender that fails is a result, recorded with its error
        record["errors"][name] = describe_error(e)
        return None


def _checked(record: dict, where: str, name: str, fn, ref) -> bool:
    """Calls fn once, its output against ref under the harness rule, into record[where][name]; False if
    it raised (the error recorded)."""
    def check():
        failed, worst = check_close(fn(), ref)
        record[where][name] = {"failed_elements": failed, "worst_err_over_tol": round(worst, 4)}
        return True
    return bool(_attempt(record, name, check))


def _timed_ms(record: dict, contenders: dict, timing: dict) -> dict:
    """{name: median ms} of time_contenders over the contenders (alternating); {} with the error recorded
    for each of them if the timing raised."""
    if not contenders:
        return {}
    try:
        return {name: t["median_ms"] for name, t in time_contenders(contenders, **timing).items()}
    except Exception as e:   # noqa: BLE001 - as _attempt, for the whole group
        for name in contenders:
            record["errors"].setdefault(name, describe_error(e))
        return {}


def _ratio(a, b):
    return a / b if a and b else None


def run_shape(sid: str, device: torch.device, *, compiled: bool, warmup: int, rounds: int, calls: int) -> dict:
    shape = T.OFFICIAL[sid]
    config = TransformerConfig(**vars(shape.config))
    dtype = getattr(torch, shape.dtype)
    baseline, ours = harness_models(config, bridge.TTJTransformer, device=device, dtype=dtype)
    _, drop_in = harness_models(config, DropIn, device=device, dtype=dtype)
    x, mask = make_inputs(config, INPUT_SEED, device=device, dtype=dtype, padding_ratio=shape.padding)
    timing = {"warmup": warmup, "rounds": rounds, "calls": calls, "device": device}
    record = {"config": vars(shape.config), "padding": shape.padding, "dtype": shape.dtype,
              **dict.fromkeys(FIELDS), "accuracy": {}, "compiled_peer_accuracy": {}, "graph_breaks": {}, "errors": {}}
    with torch.inference_mode():
        ref = baseline(x, mask)
        eager = {"class": lambda: ours(x, mask), "dropin": lambda: drop_in(x, mask)}
        eager = {name: fn for name, fn in eager.items() if _checked(record, "accuracy", name, fn, ref)}
        del ref
        if "class" in eager:
            host = _attempt(record, "host_us", lambda: interleaved_host_overhead_us(
                {"class": eager["class"]}, rounds * calls, device=device))
            record["host_us"] = host["class"]["median_us"] if host else None
            gpu_ms = _timed_ms(record, {"class": eager["class"]}, timing).get("class")
            record["gpu_us"] = gpu_ms * 1e3 if gpu_ms is not None else None
            record["host_over_gpu"] = _ratio(record["host_us"], record["gpu_us"])
            loop = _attempt(record, "loop_host_us", lambda: loop_host_us(eager["class"], device=device))
            record["loop_host_us"] = loop["median_us"] if loop else None
            record["loop_host_over_gpu"] = _ratio(record["loop_host_us"], record["gpu_us"])
        # whether the timed calls went through the bridge's native lane (bridge/native), per plug-in way
        record["native_lane"] = {name: runtime.fast_forward(module, x, mask) is not None
                                 for name, module in (("class", ours), ("dropin", drop_in))}
        ms = _timed_ms(record, eager, timing)
        record["class_ms"], record["dropin_ms"] = ms.get("class"), ms.get("dropin")
        if record["class_ms"] and record["dropin_ms"]:
            record["class_vs_dropin"] = max(ms.values()) / min(ms.values())
        if compiled:
            record.update(_compiled(record, baseline, ours, config, x, mask, timing))
        else:
            record["skipped"] = "compiled, compiled_peer: torch.compile on the CPU is left out without --compile-on-cpu"
    checked = [record["accuracy"][name]["failed_elements"] for name in ACCURACY_CONTENDERS if name in record["accuracy"]]
    record["failed_elements"] = sum(checked) if checked else None
    return record


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters
    return int(sum(counters["graph_break"].values()))


class PeerInner(nn.Module):
    """The torch peer's model without its Python front (argument checks, a per-mask cache, runners), which
    breaks a surrounding torch.compile's graph ~10 times: the mask's kind is decided once, here, as the
    peer itself does on its first call of a shape, and the model is called as the peer's runner calls it."""

    def __init__(self, peer, mask, causal: bool):
        super().__init__()
        self.model, self.kind = peer.model, classify_mask(mask, causal)

    def forward(self, x, mask=None):
        return self.model(x, mask if self.kind != MASK_NONE else None, self.kind)


def _compiled(record: dict, baseline, ours, config, x, mask, timing: dict) -> dict:
    """compiled_ms and compiled_peer_ms; each wrapper's first call checked against the eager wrapper around
    the baseline, and the graph breaks Dynamo took over its first two calls (tracing, and a recompile the
    first call's side effects cause) recorded in graph_breaks."""
    torch._dynamo.reset()   # one shape's graphs at a time (Wrapped.forward's variants stay few)
    torch.manual_seed(WRAPPER_SEED)
    d = config.d_model
    before, after = (nn.Linear(d, d).to(device=x.device, dtype=x.dtype).eval() for _ in range(2))
    ref = Wrapped(baseline, before, after)(x, mask)
    # the peer's own torch.compile and CUDA graph off: the outer torch.compile is the one measured
    inners = {"compiled": lambda: ours,
              "compiled_peer": lambda: PeerInner(build_peer(baseline, config, device=x.device, compile=False,
                                                            cuda_graph=False), mask, bool(config.causal))}
    contenders, graph_breaks = {}, {}
    for name, inner in inners.items():
        module = _attempt(record, name, lambda: torch.compile(Wrapped(inner(), before, after)))
        if module is None:
            continue
        start = _graph_breaks()
        where = "accuracy" if name in ACCURACY_CONTENDERS else f"{name}_accuracy"
        if (_checked(record, where, name, lambda: module(x, mask), ref)
                and _attempt(record, name, lambda: module(x, mask)) is not None):
            contenders[name] = lambda module=module: module(x, mask)
        graph_breaks[name] = _graph_breaks() - start
    del ref
    ms = _timed_ms(record, contenders, timing)
    return {"compiled_ms": ms.get("compiled"), "compiled_peer_ms": ms.get("compiled_peer"),
            "graph_breaks": graph_breaks}


def _cell(value, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}{spec}}"


def summary(record: dict) -> str:
    if "error" in record:
        return record["error"][:300]
    text = (f"host {_cell(record['host_us'], 0, '.1f')} us, gpu {_cell(record['gpu_us'], 0, '.1f')} us "
            f"(host/gpu {_cell(record['host_over_gpu'], 0, '.3f')}); class {_cell(record['class_ms'], 0, '.4f')} ms, "
            f"drop-in {_cell(record['dropin_ms'], 0, '.4f')}, compiled {_cell(record['compiled_ms'], 0, '.4f')}, "
            f"compiled peer {_cell(record['compiled_peer_ms'], 0, '.4f')}; failing {record['failed_elements']}")
    return text + (f"; errors in {sorted(record['errors'])}" if record["errors"] else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.torch_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=parse_shapes, default=",".join(HARNESS_IDS),
                   help='official shape ids, comma-separated, or "all" (shapes 1-13, the default)')
    p.add_argument("--rounds", type=int, default=None, help="timing rounds (cuda 3, cpu 2)")
    p.add_argument("--calls", type=int, default=None,
                   help="timed calls per round (cuda 50, cpu 2); host_us takes rounds * calls samples")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per contender (cuda 20, cpu 1)")
    p.add_argument("--out", default=None, help="folder for the JSON (default: bench.paths.default_out_dir())")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the measurement) or cpu (a smoke test of the script)")
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="start from this earlier file's shapes (same GPU): a run split over several calls "
                        "ends in one file")
    p.add_argument("--compile-on-cpu", action="store_true",
                   help="with --device cpu, run the torch.compile contenders too (slow: inductor builds C++)")
    args = p.parse_args(argv)
    if set(args.shapes) - set(HARNESS_IDS):   # 14: its baseline cannot exist (bench.scale measures it)
        print(f"shapes {sorted(set(args.shapes) - set(HARNESS_IDS))} cannot run through the harness protocol; "
              f"choose from {list(HARNESS_IDS)}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print("bench.torch_check measures on a CUDA GPU; none is visible (--device cpu runs a smoke test)",
              file=sys.stderr)
        return 2
    counts = {name: getattr(args, name) if getattr(args, name) is not None else default
              for name, default in DEFAULTS[device.type].items()}
    if on_cuda:
        torch.set_float32_matmul_precision("high")   # what the harness sets: TF32 baseline GEMMs
    gpu = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    compiled = on_cuda or args.compile_on_cpu
    path = result_file("torch", gpu, args.out)
    result = {"date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
              "jax": jax.__version__,
              "command": "python -m bench.torch_check " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": device.type, **counts, "host_samples": counts["rounds"] * counts["calls"],
              "compiled": compiled, "shapes": {}}
    if args.merge:
        try:
            with open(args.merge) as f:
                previous = json.load(f)
        except (OSError, ValueError) as e:
            print(f"--merge {args.merge}: cannot read it ({e})", file=sys.stderr)
            return 2
        if previous.get("gpu") != gpu:
            print(f"--merge {args.merge}: measured on {previous.get('gpu')!r}, not {gpu!r}", file=sys.stderr)
            return 2
        result["shapes"] = dict(previous.get("shapes", {}))
        result["commands"] = previous.get("commands", [previous.get("command")]) + [result["command"]]

    def run_one(sid):
        try:
            return run_shape(sid, device, compiled=compiled, **counts)
        finally:
            if on_cuda:
                torch.cuda.empty_cache()

    bad = run_shapes(result, path, args.shapes, run_one, summary)
    bad |= any(r.get("errors") or r.get("failed_elements") for r in result["shapes"].values())
    print(f"\n{'shape':>5} {'host_us':>8} {'loop_us':>8} {'gpu_us':>8} {'host/gpu':>8} {'loop/gpu':>8} "
          f"{'class_ms':>9} {'dropin_ms':>9} {'cls/drop':>8} {'compiled':>9} {'c_peer':>9} {'failed':>6}  errors")
    for sid, r in result["shapes"].items():
        if "error" in r:
            print(f"{sid:>5} error: {r['error'][:120]}")
            continue
        r = {**dict.fromkeys(FIELDS), "errors": {}, **r}   # (a merged record may predate a field)
        print(f"{sid:>5} {_cell(r['host_us'], 8, '.1f')} {_cell(r['loop_host_us'], 8, '.1f')} "
              f"{_cell(r['gpu_us'], 8, '.1f')} {_cell(r['host_over_gpu'], 8, '.3f')} "
              f"{_cell(r['loop_host_over_gpu'], 8, '.3f')} {_cell(r['class_ms'], 9, '.4f')} {_cell(r['dropin_ms'], 9, '.4f')} "
              f"{_cell(r['class_vs_dropin'], 8, '.3f')} {_cell(r['compiled_ms'], 9, '.4f')} "
              f"{_cell(r['compiled_peer_ms'], 9, '.4f')} {_cell(r['failed_elements'], 6, 'd')}  "
              f"{', '.join(sorted(r['errors'])) or '-'}")
    print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
