"""Embedding (what the towers produce and the scores consume) and the check every caption input passes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Embedding:
    """Encoded captions or images. ``attn``/``value``/``mask`` are None for global-only models.

    pooled (N, d_global) L2-normalised; attn (N, H, L, d_a) queries or keys; value (N, H, L, d_e)
    L2-normalised û or v̂; mask (N, L) bool, True on real tokens / patches.
    """

    pooled: torch.Tensor
    attn: torch.Tensor | None = None
    value: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.pooled.shape[0]

    def _map(self, fn) -> Embedding:
        return Embedding(*(None if x is None else fn(x) for x in (self.pooled, self.attn, self.value, self.mask)))

    def __getitem__(self, idx) -> Embedding:
        return self._map(lambda x: x[idx])

    def to(self, device) -> Embedding:
        return self._map(lambda x: x.to(device))

    @staticmethod
    def cat(parts: list[Embedding]) -> Embedding:
        """Concatenate along N, right-padding token dims to the longest part."""
        def join(xs, dim_len):
            if xs[0] is None:
                return None
            L = max(x.shape[dim_len] for x in xs)
            pad = [F.pad(x, (0, 0, 0, L - x.shape[dim_len])) if x.dim() == 4 else F.pad(x, (0, L - x.shape[-1]))
                   for x in xs]
            return torch.cat(pad, dim=0)

        return Embedding(torch.cat([p.pooled for p in parts]), join([p.attn for p in parts], 2),
                         join([p.value for p in parts], 2), join([p.mask for p in parts], 1))


def check_texts(texts) -> None:
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a list of strings, e.g. ['a red circle on the left']")
    bad = [i for i, t in enumerate(texts) if not t.strip()]
    if bad:
        raise ValueError(f"empty caption at position(s) {bad[:5]}: every text needs at least one word")
