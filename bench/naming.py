"""File-name pieces shared by the benchmarks' result files."""

import re


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': lower case, runs of other characters as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"
