"""What the benchmark scripts write besides numbers: result-file names, error summaries, the per-shape loop,
and a saved run's results table as GitHub markdown (the README's table is this output, never hand-edited)."""

import json
import pathlib
import re
import statistics
import time
import traceback


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': lower case, runs of other characters as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def write_json(document: dict, out_dir, stem: str) -> pathlib.Path:
    """Writes `document` as `<out_dir>/<stem>.json` (folders made as needed, indent 1, values JSON cannot
    hold written as their str) and returns the path: every bench script's result file goes this way."""
    path = pathlib.Path(out_dir) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1, default=str) + "\n")
    return path


def describe_error(exc: BaseException) -> str:
    """One line for a result file: the error (cut at 2000 characters) and its last three frames."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return text + " | at " + " <- ".join(
        f"{frame.name}:{frame.lineno}" for frame in reversed(traceback.extract_tb(exc.__traceback__)[-3:]))


def run_shapes(result: dict, path: str, shape_ids, run_one, summary) -> bool:
    """The per-shape loop of the GPU check scripts: for each id, `run_one(sid)` gives its record (None:
    the script skips that shape); an exception becomes {"error": ...}; the wall time is added, the
    record stored in result["shapes"], and the JSON at `path` rewritten (so a timeout keeps what was
    done); `summary(record)` is printed. Returns True if any record holds an error or failed elements."""
    bad = False
    for sid in shape_ids:
        start = time.perf_counter()
        try:
            record = run_one(sid)
        except Exception as e:   # one shape's failure is recorded, the others still run
            record = {"error": describe_error(e)}
        if record is None:
            continue
        record["wall_s"] = round(time.perf_counter() - start, 1)
        result["shapes"][sid] = record
        bad |= "error" in record or any(a["failed_elements"] for a in record.get("accuracy", {}).values())
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"shape {sid} ({record['wall_s']} s): {summary(record)}", flush=True)
    return bad


def _natural_key(sid: str) -> tuple:
    """'cpu-2' before 'cpu-11', '2' before '10'; names compare as text between their numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", sid) if part)


def by_shape_id(shapes: dict, order=None) -> dict:
    """Results in shape order (1, 2, ..., 10, not 1, 10, 2). With `order` (a suite's ids, as its table lists
    them), those ids come first in that order, any others after them in natural order."""
    rank = {sid: i for i, sid in enumerate(order or ())}
    return dict(sorted(shapes.items(), key=lambda kv: (rank.get(kv[0], len(rank)), _natural_key(kv[0]))))


def peer_over_bridge(result: dict) -> float | None:
    """peer_ms / ttj_bridge_ms of one shape's result (above 1: the bridge is faster), None without both."""
    peer_ms, bridge_ms = result.get("peer_ms"), result.get("ttj_bridge_ms")
    return peer_ms / bridge_ms if peer_ms and bridge_ms else None


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return float(statistics.geometric_mean(values)) if values else None


def _id_list(ids: list[str]) -> str:
    """'1-13' for consecutive numeric ids, else the ids joined by commas."""
    if len(ids) > 2 and all(i.isdigit() for i in ids) and [int(i) for i in ids] == list(
            range(int(ids[0]), int(ids[0]) + len(ids))):
        return f"{ids[0]}-{ids[-1]}"
    return ", ".join(ids)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.4g}"


def markdown_table(document: dict, order=None) -> str:
    """A saved `ttj-bench` run as GitHub markdown: one line naming the machine, the table, the geometric means
    (for the general suite also of peer/bridge). `order`: the suite's ids, as by_shape_id takes them.

    failed: elements outside the harness rule, through the bridge and from JAX together; worst err/tol: the
    larger of the two. host us: the bridge's host time per call issued on an idle GPU; host/GPU: that over
    the bridge's median time per call."""
    shapes = by_shape_id(document["shapes"], order)
    seeds = sorted({r.get("seeds") for r in shapes.values()} - {None})
    machine = document.get("device") or document.get("gpu") or "unknown device"
    about = [machine, f"jax {document.get('jax', '?')}", f"torch {document.get('torch', '?')}",
             document.get("date", "undated")]
    if len(seeds) == 1:
        about.append(f"{seeds[0]} accuracy seeds per shape")
    lines = ["; ".join(about) + ".", "",
             "| shape | plan | baseline ms | torch peer ms | ttj bridge ms | ttj JAX ms | bridge speedup "
             "| peer/bridge | failed | worst err/tol | host us | host/GPU |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for sid, r in shapes.items():
        bridge_ms, peer_ms = r.get("ttj_bridge_ms"), r.get("peer_ms")
        jax_accuracy = r.get("ttj_jax_accuracy", {})
        failed = r["failed_elements"] + jax_accuracy.get("failed_elements", 0)
        worst = max(r["worst_err_over_tol"], jax_accuracy.get("worst_err_over_tol", 0.0))
        host_us = r.get("bridge_host_us")
        plan = r.get("plan", "").split(":")[0]
        speedup = r["speedup"].get("ttj_bridge")
        lines.append("| " + " | ".join([
            sid, f"`{plan}`" if plan else "-", _ms(r.get("baseline_ms")), _ms(peer_ms), _ms(bridge_ms),
            _ms(r.get("ttj_jax_ms")), "-" if speedup is None else f"{speedup:.1f}x",
            "-" if peer_ms is None or not bridge_ms else f"{peer_ms / bridge_ms:.2f}",
            str(failed), f"{worst:.2f}", "-" if host_us is None else f"{host_us:.0f}",
            "-" if host_us is None or not bridge_ms else f"{host_us / (bridge_ms * 1e3):.2f}"]) + " |")
    means = {label: geomean([r["speedup"].get(key) for r in shapes.values()])
             for key, label in (("peer", "torch peer"), ("ttj_bridge", "ttj via the bridge"),
                                ("ttj_jax", "ttj from JAX"))}
    lines += ["", f"Geometric mean speedup over the baseline, shapes {_id_list(list(shapes))}: " + ", ".join(
        f"{label} {value:.2f}x" for label, value in means.items() if value is not None) + "."]
    ratio = geomean([peer_over_bridge(r) for r in shapes.values()])
    if document.get("suite") == "general" and ratio is not None:
        lines.append(f"Geometric mean of peer/bridge: {ratio:.2f}.")
    return "\n".join(lines) + "\n"
