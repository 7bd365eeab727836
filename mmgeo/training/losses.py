"""Contrastive losses: symmetric InfoNCE (CLIP; van den Oord et al. 2018) on each score, on one or many ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def infonce(text_logits: torch.Tensor, image_logits: torch.Tensor, offset: int = 0,
            positives: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of text->image and image->text cross-entropy over B local pairs.

    text_logits (B, N): the B captions against N images; image_logits (B, N'): the B images against N'
    captions; the positive of pair i sits in column ``offset + i`` of both. ``positives`` (B, B) bool, caption i
    true of image j (i ≠ j, ``mmgeo.data.caption_groups``): those pairs are left out of both sides' negatives.
    """
    if positives is not None and bool(positives.any()):
        B = len(positives)
        text_logits, image_logits = text_logits.clone(), image_logits.clone()
        text_logits[:, offset:offset + B] = text_logits[:, offset:offset + B].masked_fill(positives, float("-inf"))
        image_logits[:, offset:offset + B] = image_logits[:, offset:offset + B].masked_fill(positives.T, float("-inf"))
    target = torch.arange(text_logits.shape[0], device=text_logits.device) + offset
    return 0.5 * (F.cross_entropy(text_logits, target) + F.cross_entropy(image_logits, target))


def symmetric_infonce(logits: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE of a square (B, B) matrix, rows = texts, columns = images, pair i = (text i, image i)."""
    if logits.dim() != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(f"symmetric InfoNCE needs a square (B, B) logit matrix, got {tuple(logits.shape)}")
    return infonce(logits, logits.T)


def distillation(text_side: dict[str, torch.Tensor], image_side: dict[str, torch.Tensor]) -> torch.Tensor:
    """KL from the geometric score's in-batch distribution to the global score's, rows of both directions, the
    teacher (geometric) detached: the global vector — the service's first stage — learns which images the
    geometric score ranks high, not only the one positive (Hinton et al. 2015; docs/design.md §2).

    ``text_side`` (B, N) texts against images, ``image_side`` (B, N') images against texts, each a dict with
    "geometric" and "global" logits (temperatures already applied)."""
    kl = [F.kl_div(F.log_softmax(side["global"], 1), F.log_softmax(side["geometric"].detach(), 1),
                   log_target=True, reduction="batchmean") for side in (text_side, image_side)]
    return 0.5 * (kl[0] + kl[1])


def negative_query(negative_logits: dict[str, torch.Tensor], source: torch.Tensor,
                   global_weight: float) -> torch.Tensor:
    """Caption edits as text->image queries: -log(1 - p), p = the in-batch softmax probability of the image each
    edit was made from — an image known to be false of it (unlikelihood; Welleck et al., ICLR 2020). "a small red
    square" made from an image's "a small red circle" must rank that image below the rest; the image->text side
    (``retrieval_loss``) only asks the image to prefer its own caption. Other images are not known to be false of
    an edit, so they are not pushed up or down one by one, only relative to its source.

    ``negative_logits`` (N_neg, B) per score; ``source`` (N_neg,) the column of each edit's image. Geometric term
    + ``global_weight`` · global term, as the InfoNCE terms combine. With one image there is nothing to rank it
    below: the term is zero."""
    if next(iter(negative_logits.values())).shape[1] < 2:
        return sum(v.sum() * 0.0 for v in negative_logits.values())
    rows = torch.arange(len(source), device=source.device)
    terms = {}
    for k, logits in negative_logits.items():
        logits = logits.float()
        others = logits.clone()
        others[rows, source] = float("-inf")
        terms[k] = (torch.logsumexp(logits, 1) - torch.logsumexp(others, 1)).mean()  # -log(1 - p_source)
    return combine(terms, global_weight)


def edit_query(negative_logits: dict[str, torch.Tensor], truth: torch.Tensor,
               global_weight: float) -> torch.Tensor:
    """Caption edits as text->image queries of the batch images they are true of: -log Σ_{j true} p_j over the
    edit's in-batch softmax, for each edit true of some image (``truth``, by text rules; never its own source,
    ``mmgeo.data.pairs.Collate``). "a small red square" made from an image's "a small red circle" and true of
    another image of the batch must rank that image first, above its source, one word away: the ranking a
    one-object search needs, on pairs the rules know to be right. Edits true of no image (most full-caption
    edits; any pair the training images never hold, e.g. cogent's held-out ones) add nothing.

    ``negative_logits`` (N_neg, B) per score; ``truth`` (N_neg, B) bool. Geometric term + ``global_weight`` ·
    global term. Zero when no edit is true of an image."""
    rows = truth.any(1)  # (N_neg,)
    if not bool(rows.any()):
        return sum(v.sum() * 0.0 for v in negative_logits.values())
    terms = {}
    for k, logits in negative_logits.items():
        logits = logits.float()[rows]  # (N_true, B)
        terms[k] = (torch.logsumexp(logits, 1) - torch.logsumexp(logits.masked_fill(~truth[rows], float("-inf")), 1)
                    ).mean()
    return combine(terms, global_weight)


def combine(terms: dict[str, torch.Tensor], global_weight: float) -> torch.Tensor:
    """Per-score terms into one: geometric + ``global_weight`` · global; a global-only model's global term alone."""
    return terms["geometric"] + global_weight * terms["global"] if "geometric" in terms else terms["global"]


def _loss(text_side: dict[str, torch.Tensor], image_side: dict[str, torch.Tensor], global_weight: float,
          distill_weight: float = 0.0, offset: int = 0,
          positives: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """InfoNCE per score on (texts against images, images against texts), combined; plus distillation (over
    every pair: the teacher ranking another true image high is right)."""
    terms = {k: infonce(text_side[k], image_side[k], offset, positives) for k in text_side}
    out = {"loss_global": terms["global"], "loss": combine(terms, global_weight)}
    if "geometric" not in terms:
        return out
    out["loss_geometric"] = terms["geometric"]
    if distill_weight:
        out["loss_distill"] = distillation(text_side, image_side)
        out["loss"] = out["loss"] + distill_weight * out["loss_distill"]
    return out


def retrieval_loss(logits: dict[str, torch.Tensor], global_weight: float = 1.0,
                   negative_logits: dict[str, torch.Tensor] | None = None,
                   distill_weight: float = 0.0, positives: torch.Tensor | None = None,
                   negative_source: torch.Tensor | None = None,
                   negative_query_weight: float = 0.0, negative_truth: torch.Tensor | None = None,
                   edit_query_weight: float = 0.0) -> dict[str, torch.Tensor]:
    """docs/design.md §2: InfoNCE on the geometric score + λ · InfoNCE on the global score (+ distillation).

    ``logits`` from ``GeoRetriever.logits`` (B, B); returns {"loss", "loss_geometric"?, "loss_global",
    "loss_distill"?}. ``negative_logits`` (N_neg, B): extra captions (hard negatives) against the B images; they
    join the image->text side only, as NegCLIP does (Yuksekgonul et al., ICLR 2023). A global-only model (CLIP
    baseline) trains on the global term alone, at weight 1. ``distill_weight``: weight of ``distillation``.
    ``positives`` (B, B) bool: caption i true of image j, left out of the negatives (``infonce``).
    ``negative_query_weight``: weight of ``negative_query`` on ``negative_logits``, whose rows were made from the
    images ``negative_source`` (N_neg,) names; ``edit_query_weight``: weight of ``edit_query`` on them, true of
    the images ``negative_truth`` (N_neg, B) marks.
    """
    for v in logits.values():
        if v.dim() != 2 or v.shape[0] != v.shape[1]:
            raise ValueError(f"the retrieval loss needs square (B, B) logit matrices, got {tuple(v.shape)}")
    image_side = {k: (v if negative_logits is None else torch.cat([v, negative_logits[k]])).T
                  for k, v in logits.items()}
    out = _loss(logits, image_side, global_weight, distill_weight, positives=positives)
    return with_negative_query(out, negative_logits, negative_source, negative_query_weight, global_weight,
                               negative_truth, edit_query_weight)


def with_negative_query(out: dict, negative_logits, source, weight: float, global_weight: float,
                        truth: torch.Tensor | None = None, edit_weight: float = 0.0) -> dict:
    """``out`` with the edits-as-queries terms added and weighted into "loss" where weighted and negatives exist:
    ``loss_negative_query`` (``negative_query``, of ``source``) and ``loss_edit_query`` (``edit_query``, of
    ``truth``)."""
    if negative_logits is None:
        return out
    if weight and source is not None and len(source):
        out["loss_negative_query"] = negative_query(negative_logits, source, global_weight)
        out["loss"] = out["loss"] + weight * out["loss_negative_query"]
    if edit_weight and truth is not None and len(truth):
        out["loss_edit_query"] = edit_query(negative_logits, truth, global_weight)
        out["loss"] = out["loss"] + edit_weight * out["loss_edit_query"]
    return out


def contrastive_loss(model, text, image, global_weight: float = 1.0, local_loss: bool = False,
                     negatives=None, distill_weight: float = 0.0, positives: torch.Tensor | None = None,
                     negative_source: torch.Tensor | None = None, negative_query_weight: float = 0.0,
                     negative_truth: torch.Tensor | None = None, edit_query_weight: float = 0.0) -> dict:
    """The retrieval loss over the *global* batch when training on several ranks (open_clip's ClipLoss).

    ``text``/``image``: this rank's Embeddings (B local pairs). On one process it is ``retrieval_loss``.
    On W ranks the features are gathered with gradients (``mmgeo.training.distributed.gather_embedding``):

    - ``local_loss=False``: every rank scores the full (W·B, W·B) matrix; loss L on each rank. The gather's
      backward sums W copies of dL/d(own features), DDP's gradient average divides by W: exactly dL/dθ of
      one process on the concatenated batch.
    - ``local_loss=True``: rank r scores its B captions against all W·B images and its B images against
      all W·B captions (2·B·W·B pairs instead of (W·B)², which is what makes the geometric score
      affordable at scale); its loss L_r averages over its B pairs and L = mean_r L_r, so the same
      argument gives dL/dθ again. The returned loss is L_r: average it over ranks to log L.

    ``distill_weight``: the weight of ``distillation`` (global score taught by the geometric one).

    ``negatives``: this rank's hard-negative captions (Embedding, any number), added to the image->text side
    (``retrieval_loss``). On several ranks they are gathered like the captions (``gather_ragged``: ranks may
    hold different numbers), so every image meets every negative of the global batch, as on one process.

    ``positives`` (B, B) bool: this rank's captions true of this rank's other images (``infonce``); on several
    ranks pairs across ranks are not known and stay negatives (caption groups never span ranks).

    ``negative_query_weight``: the weight of ``negative_query`` — this rank's negatives (made from the local pairs
    ``negative_source`` names) against this rank's images; on several ranks an extra (N_neg, B) scoring.
    ``edit_query_weight``: the weight of ``edit_query`` on the same scores (true of ``negative_truth``).

    Limits: equal local batch sizes; dropout draws differ from a single process (each rank its own masks).
    """
    from mmgeo.training.distributed import rank_and_world

    if rank_and_world()[1] == 1:
        neg = None if negatives is None or len(negatives) == 0 else model.logits(negatives, image)  # (N_neg, B)
        return retrieval_loss(model.logits(text, image), global_weight, neg, distill_weight, positives,
                              negative_source, negative_query_weight, negative_truth, edit_query_weight)
    out = _distributed_loss(model, text, image, global_weight, local_loss, negatives, distill_weight, positives)
    local_neg = model.logits(negatives, image) if (negative_query_weight or edit_query_weight) \
        and negatives is not None and len(negatives) else None  # (N_neg, B) this rank's edits vs its images
    return with_negative_query(out, local_neg, negative_source, negative_query_weight, global_weight,
                               negative_truth, edit_query_weight)


def _distributed_loss(model, text, image, global_weight, local_loss, negatives, distill_weight, positives) -> dict:
    """``contrastive_loss`` on several ranks, without the edits-as-queries terms."""
    from mmgeo.training.distributed import (
        all_gather_no_grad,
        check_equal_batches,
        gather_embedding,
        gather_ragged,
        global_max,
        rank_and_world,
    )

    rank = rank_and_world()[0]
    B = len(text)
    check_equal_batches(B, text.pooled.device)
    all_text, all_image = gather_embedding(text), gather_embedding(image)  # (W·B, ...)
    has_neg = negatives is not None and global_max(len(negatives), text.pooled.device) > 0  # same on every rank
    all_neg = gather_ragged(negatives) if has_neg else None  # (Σ N_neg, ...) every rank's negatives
    if not local_loss:
        neg = model.logits(all_neg, all_image) if has_neg else None  # (Σ N_neg, W·B)
        blocks = None if positives is None else torch.block_diag(
            *all_gather_no_grad(positives.unsqueeze(0).to(torch.uint8)).bool())  # (W·B, W·B): pairs within a rank
        return retrieval_loss(model.logits(all_text, all_image), global_weight, neg, distill_weight, blocks)
    text_side = model.logits(text, all_image)  # each (B, W·B): local captions vs all images
    image_side = model.logits(all_text, image)  # each (W·B, B): all captions vs local images
    if has_neg:
        neg = model.logits(all_neg, image)  # (Σ N_neg, B): every negative vs local images
        image_side = {k: torch.cat([v, neg[k]]) for k, v in image_side.items()}
    return _loss(text_side, {k: v.T for k, v in image_side.items()}, global_weight, distill_weight, offset=rank * B,
                 positives=positives)
