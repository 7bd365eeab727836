"""PatchSalience: how much each image patch holds something a caption may have to explain (docs/design.md §9)."""

from __future__ import annotations

import torch
from torch import nn


class PatchSalience(nn.Module):
    """o_j = σ(w · k_j + b) from a patch's keys over all heads: (B, H, S, d_a) -> (B, S) in (0, 1).

    Starts at o_j = 0.5 everywhere (zero init): coverage begins as a plain mean over patches and learns which
    patches count from the loss alone (no labels).
    """

    def __init__(self, num_heads: int, d_a: int):
        super().__init__()
        self.proj = nn.Linear(num_heads * d_a, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.proj(k.transpose(1, 2).flatten(2)))[..., 0]  # (B, S)
