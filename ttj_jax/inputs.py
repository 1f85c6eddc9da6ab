"""Input checks shared by the JAX entry point and the torch bridge, and the mask's kind per jax array."""

from __future__ import annotations

import weakref
from typing import Any

from ttj_jax.config import Config
from ttj_jax.masks import MaskKind, classify_mask

FLOATING_DTYPES = ("float32", "float16", "bfloat16", "float64")


def validate_inputs(x_shape, x_dtype: str, mask_shape, mask_dtype: str | None, config: Config) -> None:
    """Clear errors for bad input, naming the argument and the shapes. Takes shapes and dtype names
    (numpy spelling) so that the JAX entry point and the torch bridge share one set of checks."""
    x_shape = tuple(x_shape)
    if len(x_shape) != 3:
        raise ValueError(f"x must have rank 3 [batch, seq_len, d_model]; got shape {x_shape}")
    if x_shape[-1] != config.d_model:
        raise ValueError(f"x has d_model {x_shape[-1]} (shape {x_shape}) but the config has "
                         f"d_model={config.d_model}")
    if x_shape[0] < 1 or x_shape[1] < 1:
        raise ValueError(f"x must have batch >= 1 and seq_len >= 1; got shape {x_shape}")
    if x_dtype not in FLOATING_DTYPES:
        raise TypeError(f"x must be floating point ({', '.join(FLOATING_DTYPES)}); got dtype {x_dtype}")
    if mask_shape is not None:
        if tuple(mask_shape) != x_shape[:2]:
            raise ValueError(f"valid_token_mask must have shape [batch, seq_len] = {x_shape[:2]} "
                             f"(x has shape {x_shape}); got {tuple(mask_shape)}")
        if mask_dtype != "bool":
            raise TypeError(f"valid_token_mask must be bool; got dtype {mask_dtype}")


_MASK_KINDS: dict[int, tuple[Any, MaskKind]] = {}


def cached_mask_kind(mask) -> MaskKind:
    """classify_mask, once per jax array: jax arrays are immutable, so an array's kind never changes.
    Keyed by id with a weak reference, so a new array reusing an id is never mistaken for the old one."""
    if mask is None:
        return MaskKind.NONE
    cached = _MASK_KINDS.get(id(mask))
    if cached is not None and cached[0]() is mask:
        return cached[1]
    kind = classify_mask(mask)
    key = id(mask)
    try:
        _MASK_KINDS[key] = (weakref.ref(mask, lambda _, key=key: _MASK_KINDS.pop(key, None)), kind)
    except TypeError:   # not weak-referenceable: classify every call
        pass
    return kind
