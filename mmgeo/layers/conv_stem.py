"""Convolutional stem for a ViT: stride-2 3×3 convolutions in place of the one patchify convolution.

Xiao et al., "Early Convolutions Help Transformers See Better" (NeurIPS 2021): a few stride-2
convolutions before the transformer make ViTs train faster and more stably, most of all from
scratch on little data. Same output grid as the patchify conv it replaces (total stride = patch).
"""

from __future__ import annotations

import math

from torch import nn


class ConvStem(nn.Sequential):
    """(B, 3, H, W) -> (B, C, H/p, W/p) through log2(p) stride-2 3×3 conv + BN + ReLU, then a 1×1 conv."""

    def __init__(self, in_chans: int, embed_dim: int, patch_size: int):
        if patch_size < 2 or patch_size & (patch_size - 1):
            raise ValueError(f"a conv stem needs a power-of-two patch size >= 2, got {patch_size}")
        layers, c_in = [], in_chans
        n = int(math.log2(patch_size))
        for i in range(n):
            c_out = max(embed_dim // 2 ** (n - i), 16)
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out),
                       nn.ReLU(inplace=True)]
            c_in = c_out
        layers.append(nn.Conv2d(c_in, embed_dim, 1))
        super().__init__(*layers)
