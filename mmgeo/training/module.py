"""The LightningModule that trains a retrieval model: contrastive loss, training aids, non-finite step skipping.

Every random draw of a step depends on (seed, step, rank) only, so a resumed or multi-process run draws what
one uninterrupted process would (docs/training.md, "Resume" and "Many processes").
"""

from __future__ import annotations

import math
import sys

import lightning as L
import numpy as np
import torch

from mmgeo.data.sampler import SampleLog
from mmgeo.eval.diagnostics import nonfinite_cause, orthogonality_penalty
from mmgeo.models import create_model
from mmgeo.models.checkpoint import model_record
from mmgeo.training.config import TrainConfig
from mmgeo.training.distributed import all_gather_no_grad, all_reduce_any, rank_and_world
from mmgeo.training.losses import EditQueries, contrastive_loss
from mmgeo.training.muon import MuonAdamW, muon_parameters


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one (step, rank): dropout depends on nothing else, so a resumed run draws the same."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


class NonFiniteTraining(RuntimeError):
    """``trainer.max_nonfinite_steps`` non-finite steps in a row; the message names the likely cause."""


class RetrievalModule(L.LightningModule):
    """The model of ``cfg.model`` (with ``cfg.model_args``) trained contrastively, with the training aids of
    ``cfg.aids``, per-step dropout seeds and the skipping of non-finite steps."""

    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.cfg = cfg
        self.model = create_model(cfg.model, **{**cfg.model_args, **plural_vocabulary(cfg),
                                                "extra": {"dataset": cfg.data.name}})
        self.groups = self.model.parameter_groups()  # "qk", "value", "rest": what the aids act on
        self.nonfinite_streak, self.skipped_steps = 0, []  # non-finite steps skipped: in a row, all (global steps)
        self._loss_nonfinite, self._batch = False, None
        self._norm_stats_before: list[torch.Tensor] = []  # BatchNorm statistics before this step's forward
        self.samples_log: SampleLog | None = None  # set by the training loop with trainer.log_samples

    def _norm_stats(self) -> list[torch.Tensor]:
        """BatchNorm's running statistics (the conv stem's). A forward pass updates them, so a skipped step puts
        back those from before its forward: a non-finite batch would otherwise leave NaN in the saved model."""
        return [b for m in self.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                for b in m.buffers()]

    def value_frozen(self, step: int) -> bool:
        """Two-stage warm-up: value projections frozen for the first ``freeze_value_fraction`` of steps."""
        return step < int(self.cfg.aids.freeze_value_fraction * self.cfg.trainer.max_steps)

    def on_train_batch_start(self, batch, batch_idx):
        torch.manual_seed(step_seed(self.cfg.trainer.seed, self.global_step, self.global_rank))  # dropout

    def training_step(self, batch, batch_idx):
        if int(batch["step"]) != self.global_step:
            raise RuntimeError(f"data order out of step: batch of step {int(batch['step'])} at global step "
                               f"{self.global_step}; a sample would be repeated or skipped")
        self._batch = batch
        self._norm_stats_before = [b.detach().clone() for b in self._norm_stats()]
        text, image = self.model(batch["input_ids"], batch["attention_mask"], batch["pixels"])
        losses = self.loss_terms(text, image, batch)
        self._loss_nonfinite = all_reduce_any(not bool(torch.isfinite(losses["loss"])), self.device)
        n, distributed = len(batch["pixels"]), rank_and_world()[1] > 1
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, prog_bar=True, batch_size=n, sync_dist=distributed)
        scales = {"train/temp_global": 1 / self.model.logit_scale_global.exp()}
        if self.model.geometric:
            scales["train/temp_geo"] = 1 / self.model.logit_scale_geo.exp()
        self.log_dict(scales, batch_size=n)
        if self.samples_log is not None:
            self.samples_log.write(self.global_step, int(batch["epoch"]),
                                   all_gather_no_grad(batch["index"]) if distributed else batch["index"])
        return losses["loss"]

    def loss_terms(self, text, image, batch) -> dict[str, torch.Tensor]:
        """Every term of a step's loss from the towers' outputs on ``batch`` ("loss": their weighted sum): the
        contrastive terms of ``cfg.loss`` over the captions, their edits and the images, and the aids' penalty."""
        B = int(batch["num_captions"])
        negatives = text[B:] if len(text) > B else None  # rule-based caption edits (data.caption_negatives)
        losses = contrastive_loss(self.model, text[:B], image, self.cfg.loss.global_weight, self.cfg.loss.local_loss,
                                  negatives, self.cfg.loss.distill_weight,
                                  true_captions(batch, self.cfg.data),
                                  edit_queries(batch, self.cfg.loss))
        if self.cfg.aids.ortho_weight > 0 and self.model.geometric:
            losses["ortho"] = sum(orthogonality_penalty(w) for w in self.model.qk_maps().values())
            losses["loss"] = losses["loss"] + self.cfg.aids.ortho_weight * losses["ortho"]
        return losses

    def on_before_optimizer_step(self, optimizer):
        """Before clipping and the update: the warm-up freeze, and skipping a non-finite step.

        Frozen value projections and every parameter of a non-finite step lose their gradient (None):
        AdamW then leaves them untouched (no update, no decay, state kept). The decision is the same on
        every rank (gradients are synchronised, the loss flag is all-reduced), so no rank hangs.
        """
        if self.cfg.aids.freeze_value_fraction > 0 and self.value_frozen(self.global_step):
            for p in self.groups["value"]:
                p.grad = None
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        bad_grad = bool(grads) and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all())  # one pass
        bad = all_reduce_any(self._loss_nonfinite or bad_grad, self.device)
        if bad:
            for p in self.model.parameters():
                p.grad = None
            with torch.no_grad():
                for b, before in zip(self._norm_stats(), self._norm_stats_before):
                    b.copy_(before)
            self.skipped_steps.append(self.global_step)
        self.nonfinite_streak = self.nonfinite_streak + 1 if bad else 0
        self.log("train/skipped_nonfinite", float(len(self.skipped_steps)), batch_size=1)  # running total
        if not bad:
            return
        what = "loss" if self._loss_nonfinite else "gradient"
        if self.global_rank == 0:
            print(f"\nstep {self.global_step}: non-finite {what} — step skipped (no update); "
                  f"{self.nonfinite_streak} in a row, {len(self.skipped_steps)} in total", file=sys.stderr)
        limit = self.cfg.trainer.max_nonfinite_steps
        if limit and self.nonfinite_streak >= limit:
            raise NonFiniteTraining(self._stop_message(what, limit))

    def _stop_message(self, what: str, limit: int) -> str:
        b = self._batch
        cause = nonfinite_cause(self.model, b["input_ids"], b["attention_mask"], b["pixels"])
        causes = [cause]
        if rank_and_world()[1] > 1:  # each rank looked at its own slice: report the most specific finding
            causes = [None] * rank_and_world()[1]
            torch.distributed.all_gather_object(causes, cause)
        specific = [c for c in causes if not c.startswith("inputs, weights")] or causes
        return (f"training stopped at step {self.global_step}: non-finite {what} {limit} steps in a row "
                f"(steps {self.skipped_steps[-limit:]}). Likely cause: {specific[0]}")

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Layered clipping (docs/design.md §8): Q/K maps, value projections and the rest each to its own max norm."""
        a = self.cfg.aids
        if a.clip_qk is None:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        limits = {"qk": a.clip_qk, "value": a.clip_value, "rest": a.clip_rest}
        norms = {f"grad_norm/{g}": torch.nn.utils.clip_grad_norm_([p for p in ps if p.grad is not None], limits[g])
                 for g, ps in self.groups.items()}  # norms before clipping
        self.log_dict(norms, batch_size=self.cfg.trainer.batch_size)

    def configure_optimizers(self):
        o = self.cfg.optim
        muon = muon_parameters(self.model) if o.name == "muon" else set()
        matrices, decay, no_decay = [], [], []
        for name, p in self.model.named_parameters():
            (matrices if id(p) in muon else no_decay if p.dim() < 2 or "logit_scale" in name else decay).append(p)
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if o.name == "muon":
            groups.append({"params": matrices, "weight_decay": o.weight_decay, "muon": True})
            opt = MuonAdamW(groups, lr=o.lr, betas=tuple(o.betas), momentum=o.muon_momentum)
        else:
            opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas))
        total, warm = self.cfg.trainer.max_steps, o.warmup_steps

        def schedule(step):
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["mmgeo"] = model_record(self.model)


def plural_vocabulary(cfg: TrainConfig) -> dict:
    """``{"text_vocab": ...}`` with the plurals of its nouns when the data types plural counts
    (``data.typed_plurals``) and the model reads a word-level vocabulary, else {}: otherwise "circles" would be
    the unknown token in every caption that says it."""
    from mmgeo.data.caption_parts import with_plurals
    from mmgeo.models.registry import model_config

    if not cfg.data.typed_plurals:
        return {}
    vocab = model_config(cfg.model, **cfg.model_args).text_vocab
    return {"text_vocab": with_plurals(vocab)} if vocab else {}


def true_captions(batch: dict, data) -> torch.Tensor | None:
    """(B, B) bool: caption i true of image j, i ≠ j, left out of the negatives (``data.mask_true_captions``; with
    ``data.mask_true_of: sub_captions`` only the rows of sub-captions); None when off."""
    if not data.mask_true_captions:
        return None
    return batch["positives"] & batch["partial"][:, None] if data.mask_true_of == "sub_captions" else \
        batch["positives"]


def edit_queries(batch: dict, loss) -> EditQueries | None:
    """The batch's caption edits as text->image queries, as the loss config ``loss`` weighs them (None when off);
    ``loss.negative_query_rows`` picks the edits ``negative_query`` takes: all, those of sub-captions, or those
    the text rules find true of another image of the batch; ``loss.edit_truth`` whether an edit must also match the
    count it states, or (of a whole caption) name all of an image's objects, to be true of it. A caption with a phrase
    left out (``negative_fewer``) is true of its source: neither term takes it."""
    if not (loss.negative_query_weight or loss.edit_query_weight) or "negative_source" not in batch:
        return None
    truth, which = batch.get("negative_truth"), loss.negative_query_rows
    partial = batch["partial"][batch["negative_source"]] if "partial" in batch else None  # (N_neg,) of sub-captions
    if truth is not None and loss.edit_truth == "counts":
        truth = truth & batch["negative_counted"]  # (N_neg, B)
    if truth is not None and loss.edit_truth == "whole":
        truth = truth & (partial[:, None] | batch["negative_whole"])  # (N_neg, B)
    rows = {"all": None, "sub_captions": partial,
            "true_of_another": None if truth is None else truth.any(1)}[which]
    fewer = batch.get("negative_fewer")  # (N_neg,) captions with a phrase left out: true of their source
    if fewer is not None and bool(fewer.any()):
        truth = None if truth is None else truth & ~fewer[:, None]
        rows = ~fewer if rows is None else rows & ~fewer
    if (loss.negative_query_weight and which != "all" and rows is None) or (loss.edit_query_weight and truth is None):
        raise RuntimeError(f"the edit terms need what the batch does not say (negative_query_rows={which}, "
                           f"edit_query_weight={loss.edit_query_weight}): CaptionPairs(caption_truth=True) gives "
                           "negative_truth")
    return EditQueries(batch["negative_source"], loss.negative_query_weight, loss.edit_query_weight, truth, rows)
