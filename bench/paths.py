"""Where the benchmark tools write by default: results/ at the repository root (git-ignored), or under
the working directory for an installed copy. `--out bench/results` commits a run."""

from __future__ import annotations

import pathlib


def default_out_dir() -> str:
    root = pathlib.Path(__file__).resolve().parent.parent
    return str(root / "results") if (root / "pyproject.toml").is_file() else "results"
