"""The one scale of the attention space: logits are <q, k> / sqrt(d_a) (docs/design.md, "The score")."""

from __future__ import annotations

import math


def attention_scale(d_a: int, scale: float | None = None) -> float:
    """``scale`` if given, else 1 / sqrt(d_a): the softmax temperature of every attention over the space."""
    if scale is not None:
        return float(scale)
    if d_a <= 0:
        raise ValueError(f"d_a must be positive, got {d_a}")
    return 1.0 / math.sqrt(d_a)
