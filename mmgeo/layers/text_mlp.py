"""M_Q: the position-aware text MLP (docs/design.md §2).

``q_t = W2 · GELU(W1 · [h_t ; PE(r_t)])`` where ``r_t = t / (n - 1)`` is the relative position of
real token t in its caption of n real tokens ([CLS] has r = 0, the "global overview" query) and PE
is a sinusoidal encoding of that scalar. Padding tokens get q = 0 (not computed) and are masked downstream.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def relative_positions(mask: torch.Tensor) -> torch.Tensor:
    """r_t = t/(n-1) over the real tokens of each row; 0 on padding and for one-token captions.

    mask: (B, T) bool, True on real tokens, real tokens first (right padding). Returns (B, T) float.
    """
    n = mask.sum(dim=1, keepdim=True).clamp(min=2)  # (B, 1)
    t = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)  # (1, T)
    return torch.where(mask, t / (n - 1), torch.zeros((), device=mask.device))


def sinusoidal_features(r: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of a scalar in [0, 1]: (..., ) -> (..., dim), frequencies π·2^i."""
    if dim % 2:
        raise ValueError(f"position feature dim must be even, got {dim}")
    freqs = math.pi * 2.0 ** torch.arange(dim // 2, device=r.device, dtype=r.dtype)  # (dim/2,)
    angles = r.unsqueeze(-1) * freqs  # (..., dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class PositionAwareTextMLP(nn.Module):
    """Maps token states (B, T, C) and their mask to queries (B, H, T, d_a)."""

    def __init__(self, in_dim: int, num_heads: int, d_a: int, hidden_dim: int | None = None, pos_dim: int = 16):
        super().__init__()
        self.num_heads, self.d_a, self.pos_dim = num_heads, d_a, pos_dim
        hidden_dim = hidden_dim or 2 * in_dim
        self.fc1 = nn.Linear(in_dim + pos_dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, num_heads * d_a)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Queries of the real tokens; padding rows are 0 (computed only where ``mask`` is True)."""
        B, T, _ = h.shape
        pe = sinusoidal_features(relative_positions(mask).to(h.dtype), self.pos_dim)  # (B, T, pos_dim)
        x = torch.cat([h, pe], dim=-1)[mask]  # (N, C + pos_dim): real tokens only
        q_real = self.fc2(self.act(self.fc1(x)))  # (N, H*d_a)
        q = q_real.new_zeros(B, T, self.num_heads * self.d_a)  # (B, T, H*d_a)
        q[mask] = q_real
        return q.view(B, T, self.num_heads, self.d_a).transpose(1, 2)  # (B, H, T, d_a)
