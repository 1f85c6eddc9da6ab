"""What the benchmark scripts write besides numbers: result-file names and error summaries."""

import re
import traceback


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200': lower case, runs of other characters as one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def describe_error(exc: BaseException) -> str:
    """One line for a result file: the error (cut at 2000 characters) and its last three frames."""
    text = f"{type(exc).__name__}: {exc}"
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return text + " | at " + " <- ".join(
        f"{frame.name}:{frame.lineno}" for frame in reversed(traceback.extract_tb(exc.__traceback__)[-3:]))
