"""What the benchmark scripts write besides numbers: result-file names, error summaries, the per-shape loop."""

import json
import pathlib
import re
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
