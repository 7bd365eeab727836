"""M_K's head: ViT patch tokens -> keys through a conv / channel-attention head (docs/design.md §2).

tokens (B, S, C) -> grid (B, C, h, w) -> 3×3 conv -> GELU -> squeeze-excite channel gate
[-> optional spatial gate] -> 1×1 conv -> keys (B, H, S, d_a). The 3×3 conv lets each key see its
neighbourhood; the channel gate (Hu et al., "Squeeze-and-Excitation Networks", 2018) lets the
image as a whole decide which features the keys carry.
"""

from __future__ import annotations

import torch
from torch import nn


class ChannelGate(nn.Module):
    """Squeeze-excite: global average pool -> bottleneck MLP -> sigmoid gate per channel."""

    def __init__(self, channels: int, reduction: int = 4):
        super().__init__()
        hidden = max(channels // reduction, 8)
        self.fc1, self.fc2 = nn.Conv2d(channels, hidden, 1), nn.Conv2d(hidden, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, h, w)
        g = self.fc2(torch.relu(self.fc1(x.mean(dim=(2, 3), keepdim=True))))  # (B, C, 1, 1)
        return x * torch.sigmoid(g)


class SpatialGate(nn.Module):
    """One sigmoid weight per grid cell from a 7×7 conv over channel mean and max (CBAM-style)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 7, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, h, w)
        stats = torch.cat([x.mean(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)], dim=1)  # (B, 2, h, w)
        return x * torch.sigmoid(self.conv(stats))


class ConvChannelAttentionKeyHead(nn.Module):
    """Patch tokens (B, S, C) on an (h, w) grid -> keys (B, H, S, d_a)."""

    def __init__(self, in_dim: int, grid: tuple[int, int], num_heads: int, d_a: int,
                 hidden_dim: int | None = None, spatial_gate: bool = False):
        super().__init__()
        self.grid, self.num_heads, self.d_a = tuple(grid), num_heads, d_a
        hidden_dim = hidden_dim or in_dim
        self.conv = nn.Conv2d(in_dim, hidden_dim, 3, padding=1)
        self.act = nn.GELU()
        self.channel_gate = ChannelGate(hidden_dim)
        self.spatial_gate = SpatialGate() if spatial_gate else nn.Identity()
        self.proj = nn.Conv2d(hidden_dim, num_heads * d_a, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, S, C = tokens.shape
        h, w = self.grid
        if S != h * w:
            raise ValueError(f"key head expects {h}×{w}={h * w} patch tokens, got {S}; "
                             "build the head with the backbone's patch grid")
        x = tokens.transpose(1, 2).reshape(B, C, h, w)  # (B, C, h, w)
        x = self.spatial_gate(self.channel_gate(self.act(self.conv(x))))
        k = self.proj(x).flatten(2)  # (B, H*d_a, S)
        return k.view(B, self.num_heads, self.d_a, S).transpose(2, 3)  # (B, H, S, d_a)
