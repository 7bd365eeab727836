"""Retrieval metrics under CLIP_benchmark's protocol (docs/design.md §6).

Text->image: one query per caption, its hit is its own image. Image->text: one query per image,
a hit if any of its captions is retrieved. Ties count against the model: an item scored equal to
the true one is ranked before it, so a constant scorer gets the worst rank, not a lucky one.
Non-finite scores (NaN, +inf, -inf) are refused (NonFiniteScores): a NaN compares false with everything, so
it would otherwise rank the true item first.
"""

from __future__ import annotations

import numpy as np
import torch

DEFAULT_KS = (1, 5, 10)
SHOWN = 5  # caption rows / image columns named in the error


class NonFiniteScores(ValueError):
    """A score matrix holds NaN or infinite scores; the message counts them and says where."""


def _first(idx: torch.Tensor) -> str:
    shown = ", ".join(str(i) for i in idx[:SHOWN].tolist())
    return f"[{shown}{' …' if len(idx) > SHOWN else ''}]"


def check_finite(scores: torch.Tensor) -> None:
    """Raise NonFiniteScores if any score of the (N_t, N_i) matrix is NaN, +inf or -inf."""
    bad = ~torch.isfinite(scores)
    if not bool(bad.any()):
        return
    nan, pos = int(torch.isnan(scores).sum()), int((scores == float("inf")).sum())
    neg = int(bad.sum()) - nan - pos
    kinds = ", ".join(f"{name} {n}" for name, n in (("NaN", nan), ("+inf", pos), ("-inf", neg)) if n)
    rows, cols = bad.any(dim=1).nonzero().flatten(), bad.any(dim=0).nonzero().flatten()
    raise NonFiniteScores(
        f"{int(bad.sum())} of {scores.numel()} scores are not finite ({kinds}): captions {_first(rows)}, "
        f"images {_first(cols)}; the model produced non-finite scores — check the checkpoint (eval.py prints "
        "attention diagnostics) or train with fewer steps / a lower lr")


def text_to_image_ranks(scores: torch.Tensor, text_to_image: torch.Tensor) -> torch.Tensor:
    """1-based rank of each caption's image. scores (N_t, N_i); text_to_image (N_t,) image index.
    NonFiniteScores if a score is not finite."""
    check_finite(scores)
    true = scores.gather(1, text_to_image[:, None])  # (N_t, 1)
    ahead = (scores >= true).sum(dim=1) - 1  # every other image scored >= the true one
    return ahead + 1


def image_to_text_ranks(scores: torch.Tensor, text_to_image: torch.Tensor) -> torch.Tensor:
    """1-based rank of each image's best caption. scores (N_t, N_i) as above; NonFiniteScores if one is not
    finite."""
    check_finite(scores)
    n_t, n_i = scores.shape
    own = text_to_image[:, None] == torch.arange(n_i, device=scores.device)[None]  # (N_t, N_i)
    if not bool(own.any(0).all()):
        raise ValueError("every image needs at least one caption for image->text ranks")
    best = scores.masked_fill(~own, float("-inf")).amax(dim=0)  # (N_i,) best own caption
    ahead = ((scores >= best[None]) & ~own).sum(dim=0)  # other images' captions scored >= it
    return ahead + 1


def _summary(prefix: str, ranks: torch.Tensor, ks) -> dict[str, float]:
    r = ranks.double()
    out = {f"{prefix}_R@{k}": float((r <= k).double().mean()) for k in ks}
    out[f"{prefix}_mean_rank"] = float(r.mean())
    out[f"{prefix}_median_rank"] = float(np.median(r.numpy()))
    return out


def retrieval_metrics(scores: torch.Tensor, text_to_image: torch.Tensor, scores_i2t: torch.Tensor | None = None,
                      ks=DEFAULT_KS) -> dict[str, float]:
    """R@K, mean and median rank in both directions.

    scores: (N_t, N_i) used for text->image; ``scores_i2t`` (same shape) for image->text when the two
    directions were scored differently (two-stage retrieval re-ranks each direction's own candidates).
    NonFiniteScores (a ValueError) if a score is NaN or infinite.
    """
    scores, text_to_image = scores.float().cpu(), text_to_image.long().cpu()
    if scores.dim() != 2 or text_to_image.shape != (scores.shape[0],):
        raise ValueError(f"scores must be (N_text, N_image) and text_to_image (N_text,); got "
                         f"{tuple(scores.shape)} and {tuple(text_to_image.shape)}")
    i2t = scores if scores_i2t is None else scores_i2t.float().cpu()
    return {**_summary("image_to_text", image_to_text_ranks(i2t, text_to_image), ks),
            **_summary("text_to_image", text_to_image_ranks(scores, text_to_image), ks)}
