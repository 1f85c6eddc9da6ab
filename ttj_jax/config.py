"""The model's configuration: the seven fields of docs/spec.md's model, validated once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FIELDS = ("batch_size", "seq_len", "d_model", "num_heads", "ffn_dim", "num_layers", "causal")


@dataclasses.dataclass(frozen=True)
class Config:
    batch_size: int   # B the harness builds inputs with; forward accepts any B
    seq_len: int      # S the harness builds inputs with; forward accepts any S
    d_model: int      # d, the residual width
    num_heads: int    # H; head_dim = d_model // num_heads
    ffn_dim: int      # width of the MLP's hidden layer
    num_layers: int   # L pre-LN blocks
    causal: bool = True

    def __post_init__(self):
        for name in FIELDS[:-1]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config.{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"Config.{name} must be >= 1, got {value}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"Config.causal must be a bool, got {type(self.causal).__name__} {self.causal!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_object(cls, obj: Any) -> Config:
        """Builds a Config from a Config, a mapping, or any object with the seven attributes
        (such as the harness's own frozen `TransformerConfig`)."""
        if isinstance(obj, cls):
            return obj
        get = obj.get if isinstance(obj, Mapping) else (lambda k, default: getattr(obj, k, default))
        missing = [k for k in FIELDS if get(k, None) is None]
        if missing:
            raise ValueError(f"config object {type(obj).__name__} lacks field(s) {missing}; "
                             f"a config needs {list(FIELDS)}")
        return cls(**{k: get(k, None) for k in FIELDS})

    def with_input(self, batch_size: int, seq_len: int) -> Config:
        return dataclasses.replace(self, batch_size=batch_size, seq_len=seq_len)
