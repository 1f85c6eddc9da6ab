"""Where the benchmark tools write by default: results/ at the repository root (git-ignored), or under
the working directory for an installed copy. `--out bench/results` commits a run."""

from __future__ import annotations

import pathlib


def default_out_dir() -> str:
    root = pathlib.Path(__file__).resolve().parent.parent
    return str(root / "results") if (root / "pyproject.toml").is_file() else "results"


def result_file(kind: str, device_name: str, out: str | None = None) -> str:
    """`<out>/<kind>-<date>-<device slug>.json` (out: default_out_dir()), the folder made."""
    import datetime
    import os

    from bench.report import slug
    out_dir = out or default_out_dir()
    os.makedirs(out_dir, exist_ok=True)
    date = datetime.date.today().isoformat()
    return os.path.join(out_dir, f"{kind}-{date}-{slug(device_name.removeprefix('NVIDIA '))}.json")


def run_header(command: str) -> dict:
    """What every result file records about its run: the date, the jax, jaxlib and torch versions (those
    importable) and the command that made it. The caller adds the GPU under its own key."""
    import datetime
    import importlib

    header = {"date": datetime.date.today().isoformat()}
    for name in ("jax", "jaxlib", "torch"):
        try:
            header[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return {**header, "command": command}


def settings_environment(*names: str) -> dict[str, str]:
    """The environment settings a result file records because its command line does not show them: every
    non-empty TTJ_* variable (bridge/settings.py, ttj_jax's autotune and cache) and the other `names`
    that are set (XLA_FLAGS, say)."""
    import os
    return {k: v for k, v in sorted(os.environ.items()) if (k.startswith("TTJ_") and v) or k in names}


def find_configs(ids: list[str]) -> dict | None:
    """{id: Shape} for config ids of any suite (ttj_jax.shapes.find), or None after one line on stderr
    naming the first unknown id (the caller then exits 2)."""
    import sys

    from ttj_jax.shapes import find
    try:
        return {config_id: find(config_id) for config_id in ids}
    except KeyError as e:
        print(f"unknown config id: {e}", file=sys.stderr)
        return None
