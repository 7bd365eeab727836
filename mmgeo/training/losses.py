"""Contrastive losses: symmetric InfoNCE (CLIP; van den Oord et al. 2018) on each score, on one or many ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class EditQueries:
    """Caption edits as text->image queries (``with_edit_queries``): what the batch says of each edit, and the
    weights of the two terms."""

    source: torch.Tensor  # (N_neg,) the pair (image column) each edit was made from
    negative_weight: float = 0.0  # weight of negative_query (-log(1 - p) of the source)
    edit_weight: float = 0.0  # weight of edit_query (-log p of the images the edit is true of)
    truth: torch.Tensor | None = None  # (N_neg, B) bool: edit n true of image j by text rules (Collate)
    rows: torch.Tensor | None = None  # (N_neg,) bool: the edits negative_query takes (None = all)


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
                   global_weight: float, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Caption edits as text->image queries: -log(1 - p), p = the in-batch softmax probability of the image each
    edit was made from — an image known to be false of it (unlikelihood; Welleck et al., ICLR 2020). "a small red
    square" made from an image's "a small red circle" must rank that image below the rest; the image->text side
    (``retrieval_loss``) only asks the image to prefer its own caption. Other images are not known to be false of
    an edit, so they are not pushed up or down one by one, only relative to its source.

    ``negative_logits`` (N_neg, B) per score; ``source`` (N_neg,) the column of each edit's image. Geometric term
    + ``global_weight`` · global term, as the InfoNCE terms combine. ``rows`` (N_neg,) bool: only those edits
    (``with_edit_queries``). With one image there is nothing to rank it below, with no row nothing to rank: the
    term is zero."""
    if rows is not None:
        negative_logits, source = {k: v[rows] for k, v in negative_logits.items()}, source[rows]
    if next(iter(negative_logits.values())).shape[1] < 2 or not len(source):
        return sum(v.sum() * 0.0 for v in negative_logits.values())
    at = torch.arange(len(source), device=source.device)
    terms = {}
    for k, logits in negative_logits.items():
        logits = logits.float()
        others = logits.clone()
        others[at, source] = float("-inf")
        terms[k] = (torch.logsumexp(logits, 1) - torch.logsumexp(others, 1)).mean()  # -log(1 - p_source)
    return combine(terms, global_weight)


def edit_query(negative_logits: dict[str, torch.Tensor], truth: torch.Tensor) -> torch.Tensor:
    """Caption edits as text->image queries of the batch images they are true of: -log Σ_{j true} p_j over the
    edit's in-batch softmax, for each edit true of some image (``truth``, by text rules; never its own source,
    ``mmgeo.data.pairs.Collate``). "a small red square" made from an image's "a small red circle" and true of
    another image of the batch must rank that image first, above its source, one word away: the ranking a
    one-object search needs, on pairs the rules know to be right. Edits true of no image (most full-caption
    edits; any pair the training images never hold, e.g. cogent's held-out ones) add nothing.

    ``negative_logits`` (N_neg, B) per score; ``truth`` (N_neg, B) bool. On the geometric score only (the global
    one for a global-only model): the first stage has only to keep the true images among its K' candidates, the
    re-rank orders them, and asking the one global vector for this order kept it at chance in training
    (docs/measurements/retrieval.md). Zero when no edit is true of an image."""
    logits = negative_logits.get("geometric", negative_logits["global"]).float()  # (N_neg, B)
    rows = truth.any(1)  # (N_neg,)
    if not bool(rows.any()):
        return logits.sum() * 0.0
    logits, truth = logits[rows], truth[rows]  # (N_true, B)
    return (torch.logsumexp(logits, 1) - torch.logsumexp(logits.masked_fill(~truth, float("-inf")), 1)).mean()


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
                   edits: EditQueries | None = None) -> dict[str, torch.Tensor]:
    """docs/design.md §2: InfoNCE on the geometric score + λ · InfoNCE on the global score (+ distillation).

    ``logits`` from ``GeoRetriever.logits`` (B, B); returns {"loss", "loss_geometric"?, "loss_global",
    "loss_distill"?}. ``negative_logits`` (N_neg, B): extra captions (hard negatives) against the B images; they
    join the image->text side only, as NegCLIP does (Yuksekgonul et al., ICLR 2023). A global-only model (CLIP
    baseline) trains on the global term alone, at weight 1. ``distill_weight``: weight of ``distillation``.
    ``positives`` (B, B) bool: caption i true of image j, left out of the negatives (``infonce``).
    ``edits``: ``negative_logits`` as text->image queries too (``with_edit_queries``).
    """
    for v in logits.values():
        if v.dim() != 2 or v.shape[0] != v.shape[1]:
            raise ValueError(f"the retrieval loss needs square (B, B) logit matrices, got {tuple(v.shape)}")
    image_side = {k: (v if negative_logits is None else torch.cat([v, negative_logits[k]])).T
                  for k, v in logits.items()}
    out = _loss(logits, image_side, global_weight, distill_weight, positives=positives)
    return with_edit_queries(out, negative_logits, edits, global_weight)


def with_edit_queries(out: dict, negative_logits, edits: EditQueries | None, global_weight: float) -> dict:
    """``out`` with the edits-as-queries terms added and weighted into "loss" where weighted and edits exist:
    ``loss_negative_query`` (``negative_query`` over the ``edits.rows``) and ``loss_edit_query``
    (``edit_query`` of ``edits.truth``)."""
    if negative_logits is None or edits is None or not len(edits.source):
        return out
    if edits.negative_weight:
        out["loss_negative_query"] = negative_query(negative_logits, edits.source, global_weight, edits.rows)
        out["loss"] = out["loss"] + edits.negative_weight * out["loss_negative_query"]
    if edits.edit_weight and edits.truth is not None:
        out["loss_edit_query"] = edit_query(negative_logits, edits.truth)
        out["loss"] = out["loss"] + edits.edit_weight * out["loss_edit_query"]
    return out


def contrastive_loss(model, text, image, global_weight: float = 1.0, local_loss: bool = False,
                     negatives=None, distill_weight: float = 0.0, positives: torch.Tensor | None = None,
                     edits: EditQueries | None = None) -> dict:
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

    ``edits``: this rank's negatives as text->image queries against this rank's images (``with_edit_queries``);
    on several ranks an extra (N_neg, B) scoring.

    Limits: equal local batch sizes; dropout draws differ from a single process (each rank its own masks).
    """
    from mmgeo.training.distributed import rank_and_world

    if rank_and_world()[1] == 1:
        neg = None if negatives is None or len(negatives) == 0 else model.logits(negatives, image)  # (N_neg, B)
        return retrieval_loss(model.logits(text, image), global_weight, neg, distill_weight, positives, edits)
    out = _distributed_loss(model, text, image, global_weight, local_loss, negatives, distill_weight, positives)
    local_neg = model.logits(negatives, image) if edits is not None and (edits.negative_weight or edits.edit_weight) \
        and negatives is not None and len(negatives) else None  # (N_neg, B) this rank's edits vs its images
    return with_edit_queries(out, local_neg, edits, global_weight)


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
