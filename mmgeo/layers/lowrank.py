"""Optional low-rank mapping of the attention space: ``x <- x · (U V)``, U: d_a×r, V: r×d_a.

From the framework's paper: it bounds the rank of the q·kᵀ interaction and, with r = 8 on top of
d_a = 32, cut memory further. U starts orthonormal and V = Uᵀ, so ``U V`` starts as a projection.
"""

from __future__ import annotations

import torch
from torch import nn


class LowRankMapping(nn.Module):
    """(..., d_a) -> (..., d_a) through rank r."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        if not 0 < rank <= dim:
            raise ValueError(f"low-rank rank must be in (0, d_a={dim}], got {rank}")
        u = torch.linalg.qr(torch.randn(dim, rank)).Q  # (d_a, r) orthonormal columns
        self.U = nn.Parameter(u)
        self.V = nn.Parameter(u.T.clone())  # (r, d_a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.U) @ self.V
