"""Contrastive losses: symmetric InfoNCE (CLIP; van den Oord et al. 2018) on each score."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def symmetric_infonce(logits: torch.Tensor) -> torch.Tensor:
    """Mean of text->image and image->text cross-entropy; pair i of the batch is (text i, image i).

    logits: (B, B) temperature-scaled scores, rows = texts, columns = images.
    """
    if logits.dim() != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(f"symmetric InfoNCE needs a square (B, B) logit matrix, got {tuple(logits.shape)}")
    target = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def retrieval_loss(logits: dict[str, torch.Tensor], global_weight: float = 1.0) -> dict[str, torch.Tensor]:
    """DESIGN §2: InfoNCE on the geometric score + λ · InfoNCE on the global score.

    ``logits`` from ``GeoRetriever.logits``; returns {"loss", "loss_geometric"?, "loss_global"}.
    A global-only model (CLIP baseline) trains on the global term alone, at weight 1.
    """
    out = {"loss_global": symmetric_infonce(logits["global"])}
    if "geometric" in logits:
        out["loss_geometric"] = symmetric_infonce(logits["geometric"])
        out["loss"] = out["loss_geometric"] + global_weight * out["loss_global"]
    else:
        out["loss"] = out["loss_global"]
    return out
