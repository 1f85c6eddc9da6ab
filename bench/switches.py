"""Module switches set for one benchmark run (`ttj-bench --switch MODULE.NAME=VALUE`): a built-but-off
setting, such as `ttj_jax.kernels.flash_attention.UNPADDED_SEQUENCE`, timed through the harness's whole
path in a run of its own, beside a run without it. Only the switches the project keeps as module constants
may be set: an UPPER_CASE attribute of a `ttj_jax` or `bridge` module whose value is a bool, int, float or
str; the value given is read as that type. The result file records what was set (`"switches"`)."""

from __future__ import annotations

import importlib

PACKAGES = ("ttj_jax", "bridge")
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def parse(text: str):
    """(module, name, value) for 'MODULE.NAME=VALUE'; ValueError naming what is wrong."""
    target, sep, raw = text.partition("=")
    module_name, _, name = target.strip().rpartition(".")
    if not sep or not module_name or not name:
        raise ValueError(f"--switch {text!r}: expected MODULE.NAME=VALUE, "
                         "e.g. ttj_jax.kernels.flash_attention.UNPADDED_SEQUENCE=true")
    if module_name.split(".")[0] not in PACKAGES:
        raise ValueError(f"--switch {text!r}: only switches of {' and '.join(PACKAGES)} modules may be set")
    if not name.isupper() or name.startswith("_"):
        raise ValueError(f"--switch {text!r}: {name} is not a switch (switches are public UPPER_CASE module constants)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--switch {text!r}: no module {module_name} ({e})") from None
    if not hasattr(module, name):
        raise ValueError(f"--switch {text!r}: {module_name} has no {name}")
    current = getattr(module, name)
    return module, name, _as_type_of(current, raw.strip(), text)


def _as_type_of(current, raw: str, text: str):
    if isinstance(current, bool):
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"--switch {text!r}: {raw!r} is not a bool (true/false, 1/0, on/off)")
    if isinstance(current, (int, float, str)):
        try:
            return type(current)(raw)
        except ValueError:
            raise ValueError(f"--switch {text!r}: {raw!r} is not a {type(current).__name__}") from None
    raise ValueError(f"--switch {text!r}: its value is a {type(current).__name__}, which --switch does not set")


def apply(texts: list[str]) -> dict[str, object]:
    """Sets every switch (all parsed first: a bad one sets nothing); returns {MODULE.NAME: value}."""
    parsed = [parse(text) for text in texts]
    for module, name, value in parsed:
        setattr(module, name, value)
    return {f"{module.__name__}.{name}": value for module, name, value in parsed}
