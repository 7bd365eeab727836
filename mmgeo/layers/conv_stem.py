"""Convolutional stem for a ViT: stride-2 3×3 convolutions in place of the one patchify convolution.

Xiao et al., "Early Convolutions Help Transformers See Better" (NeurIPS 2021): a few stride-2
convolutions before the transformer make ViTs train faster and more stably, most of all from
scratch on little data. Same output grid as the patchify conv it replaces (total stride = patch).
``full_res`` adds one stride-1 3×3 convolution at the input resolution first, so edges a few pixels long are
seen before the first downsampling (the shapes world's small objects are 6–8 px; docs/design.md §9).
"""

from __future__ import annotations

import math

from torch import nn


class ConvStem(nn.Sequential):
    """(B, 3, H, W) -> (B, C, H/p, W/p) through [a stride-1 3×3 conv + BN + ReLU when ``full_res``,] log2(p)
    stride-2 3×3 conv + BN + ReLU, then a 1×1 conv."""

    def __init__(self, in_chans: int, embed_dim: int, patch_size: int, full_res: bool = False):
        if patch_size < 2 or patch_size & (patch_size - 1):
            raise ValueError(f"a conv stem needs a power-of-two patch size >= 2, got {patch_size}")
        layers, c_in = [], in_chans
        n = int(math.log2(patch_size))
        if full_res:
            c_out = max(embed_dim // 2 ** n, 16)
            layers += [nn.Conv2d(c_in, c_out, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(c_out),
                       nn.ReLU(inplace=True)]
            c_in = c_out
        for i in range(n):
            c_out = max(embed_dim // 2 ** (n - i), 16)
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c_out),
                       nn.ReLU(inplace=True)]
            c_in = c_out
        layers.append(nn.Conv2d(c_in, embed_dim, 1))
        super().__init__(*layers)
