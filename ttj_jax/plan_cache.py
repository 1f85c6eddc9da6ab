"""The on-disk plan cache: the measured planner's decisions (autotune.py), kept across processes.

One small JSON file per decision under `<dir>/plans/`, named by a hash of its key and holding the key
itself, so that:
- a key collision or a file from another version reads as a miss (the stored key must equal the asked one);
- concurrent processes never write the same file in part: each writes a temporary file beside it and
  renames it into place (atomic on POSIX and Windows), and decisions for different keys are different files;
- a corrupt, stale or unreadable file, or an unwritable directory, costs one warning per directory and
  process and is otherwise ignored: the caller measures again (or plans by the rules). Never an error.

The directory: the `directory` argument, else $TTJ_CACHE_DIR, else $XDG_CACHE_HOME/ttj-jax, else
~/.cache/ttj-jax. jax's persistent compilation cache goes beside it (`<dir>/xla`), unless the user has
set one, so that a second process neither measures nor compiles again (`enable_compilation_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

CACHE_DIR_ENV = "TTJ_CACHE_DIR"
# "0": leave jax's persistent compilation cache off (it is process-wide: every program is cached once on).
COMPILATION_CACHE_ENV = "TTJ_COMPILATION_CACHE"
# Bumped when a record's meaning changes: older files then read as misses.
FORMAT = 1


class PlanCacheWarning(UserWarning):
    """The plan cache could not be read or written; the call went on without it."""


def default_dir() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ttj-jax"


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


class PlanCache:
    """get(key) -> record or None; put(key, record) -> whether it was stored. Keys and records are
    JSON-serialisable dicts."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_dir()
        self._warned = False

    @property
    def plans_dir(self) -> Path:
        return self.directory / "plans"

    def path_for(self, key: dict) -> Path:
        return self.plans_dir / f"{key_digest(key)}.json"

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"ttj-jax plan cache {self.directory}: {message}; going on without it",
                          PlanCacheWarning, stacklevel=3)

    def get(self, key: dict) -> dict | None:
        path = self.path_for(key)
        try:
            with open(path, encoding="utf-8") as f:
                stored = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:   # unreadable or not JSON (ValueError covers JSONDecodeError)
            self._warn(f"cannot read {path.name} ({type(e).__name__}: {e})")
            return None
        if not isinstance(stored, dict) or stored.get("format") != FORMAT or not isinstance(stored.get("record"), dict):
            self._warn(f"{path.name} is not a format-{FORMAT} record")
            return None
        if stored.get("key") != json.loads(json.dumps(key, default=str)):
            return None   # another key with the same digest, or a stale file: a miss
        return stored["record"]

    def put(self, key: dict, record: dict) -> bool:
        path = self.path_for(key)
        text = json.dumps({"format": FORMAT, "key": key, "record": record}, indent=1, sort_keys=True, default=str)
        tmp = None
        try:
            self.plans_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.plans_dir, prefix=f".{path.stem}.", suffix=".tmp",
                                             delete=False, encoding="utf-8") as f:
                tmp = f.name
                f.write(text)
            os.replace(tmp, path)
            return True
        except OSError as e:
            self._warn(f"cannot write {path.name} ({type(e).__name__}: {e})")
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            return False


def enable_compilation_cache(directory: str | os.PathLike) -> str | None:
    """Turns jax's persistent compilation cache on in `<directory>/xla`, for every program however quick
    to compile (the measured candidates compile in well under jax's 1 s default threshold). Leaves a
    cache the user configured alone, and does nothing with TTJ_COMPILATION_CACHE=0. Returns the cache
    directory in use, or None when none is set."""
    import jax
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if os.environ.get(COMPILATION_CACHE_ENV, "1").strip() in ("0", "false", "off", "no"):
        return None
    path = Path(directory).expanduser() / "xla"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        warnings.warn(f"ttj-jax: no persistent compilation cache ({type(e).__name__}: {e})", PlanCacheWarning,
                      stacklevel=2)
        return None
    from jax.experimental.compilation_cache import compilation_cache
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()   # a program compiled before this call had found the cache off
    return str(path)
