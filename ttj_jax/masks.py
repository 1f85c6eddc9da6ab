"""What kind of `valid_token_mask` a call carries, which decides how much masking work the plan does.

- NONE: no mask was given.
- ALL_TRUE: every token valid (the harness's default input): no masking work at all.
- PREFIX: valid = positions < length, per sequence. Under causal attention the key mask changes nothing
  for valid queries (each sees only earlier, valid keys), so it collapses to zeroing invalid rows.
- GENERAL: anything else: true key masking plus zeroed rows.
- UNKNOWN: not classified on the host (a mask whose contents may change unseen, such as a torch
  inference tensor, which keeps no version counter): the compiled program decides per sequence, on the
  device, whether key masking is needed. Always correct, no host sync, a little more device work.
Classifying reads the mask on the host (one device-to-host copy); callers on a hot path classify once
per mask object and pass the kind (the bridge caches it per tensor and version).
"""

from __future__ import annotations

import enum

import numpy as np


class MaskKind(str, enum.Enum):
    NONE = "none"
    ALL_TRUE = "all_true"
    PREFIX = "prefix"
    GENERAL = "general"
    UNKNOWN = "unknown"


def classify_mask(valid_token_mask) -> MaskKind:
    if valid_token_mask is None:
        return MaskKind.NONE
    mask = np.asarray(valid_token_mask)
    if mask.all():
        return MaskKind.ALL_TRUE
    # A prefix mask never turns from False back to True along the sequence.
    if mask.ndim == 2 and not (~mask[:, :-1] & mask[:, 1:]).any():
        return MaskKind.PREFIX
    return MaskKind.GENERAL
