"""P_V: the value projection, which decides what flows back from each token (docs/design.md §2).

Linear ``v = W_v p`` or gated ``v = σ(W_g p) ⊙ W_v p`` (a GLU-style gate, Dauphin et al. 2017).
Acts per token, so image values can be precomputed once per image and stored in an index.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueProjection(nn.Module):
    """(B, N, C) -> (B, H, N, d_e)."""

    def __init__(self, in_dim: int, num_heads: int, d_e: int, gated: bool = False):
        super().__init__()
        self.num_heads, self.d_e = num_heads, d_e
        self.proj = nn.Linear(in_dim, num_heads * d_e)
        self.gate = nn.Linear(in_dim, num_heads * d_e) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        v = self.proj(x)  # (B, N, H*d_e)
        if self.gate is not None:
            v = torch.sigmoid(self.gate(x)) * v
        return v.view(B, N, self.num_heads, self.d_e).transpose(1, 2)  # (B, H, N, d_e)
