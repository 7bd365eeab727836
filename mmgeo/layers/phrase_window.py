"""Phrase window: each token's state next to the states of its neighbours (docs/design.md §9, binding).

``window(h)_t = [h_{t-w} ; … ; h_t ; … ; h_{t+w}]`` over the real tokens of the caption (zeros past
either end and on padding). Feeding it to the query MLP and the text value gives each word's query
and value the identities of the words around it, in order: in "a purple circle in the top left" the
value of "circle" can say *purple circle* and the query of "purple" can look where the circle is, so
a caption whose colours were swapped between objects no longer scores like the true one. A token's
own contextual state (from the text encoder) carries this only implicitly; trained contrastively, a
model falls back on looking up each attribute by itself (a bag of attributes). Limits: a fixed window
of ±w tokens, so a phrase longer than the window is seen only in part.
"""

from __future__ import annotations

import torch
from torch import nn


class PhraseWindow(nn.Module):
    """(B, T, C) token states and (B, T) mask -> (B, T, (2w+1)·C) windows; the identity for w = 0."""

    def __init__(self, radius: int):
        super().__init__()
        if radius < 0:
            raise ValueError(f"phrase window radius must be >= 0, got {radius}")
        self.radius = radius

    def out_dim(self, in_dim: int) -> int:
        return (2 * self.radius + 1) * in_dim

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.radius == 0:
            return h
        w = self.radius
        h = h * mask[..., None].to(h.dtype)  # padding contributes zeros
        padded = nn.functional.pad(h, (0, 0, w, w))  # (B, T + 2w, C)
        T = h.shape[1]
        return torch.cat([padded[:, o:o + T] for o in range(2 * w + 1)], dim=-1)  # (B, T, (2w+1)·C)
