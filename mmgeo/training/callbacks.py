"""Lightning callbacks of a training run: skipped-sample reports, attention diagnostics and validation R@K.

Each only observes the model: training is the same with or without them (every step seeds its own dropout).
"""

from __future__ import annotations

import warnings

import lightning as L

from mmgeo.eval.diagnostics import diagnose, scalars
from mmgeo.eval.metrics import NonFiniteScores, retrieval_metrics
from mmgeo.eval.retrieval import encode_split, exact_scores
from mmgeo.training.module import NonFiniteTraining


class SkippedReport(L.Callback):
    """Bad samples the datasets dropped (``ds.skipped``, by reason), printed and logged at each epoch end."""

    def __init__(self, datasets: dict):
        self.datasets = {k: v for k, v in datasets.items() if getattr(v, "skipped", None) is not None}

    def on_train_epoch_end(self, trainer, module):
        for split, ds in self.datasets.items():
            if trainer.is_global_zero:
                print(f"\nepoch {trainer.current_epoch}: {split} skipped {dict(ds.skipped) or 'nothing'} "
                      f"({len(ds)} images used)")
            if trainer.logger is not None and ds.skipped:
                trainer.logger.log_metrics({f"data/{split}_skipped_{k}": v for k, v in ds.skipped.items()},
                                           step=trainer.global_step)


class ShardProgress(L.Callback):
    """Training from shards: after each step, every rank's reader cursors and skip counts (``batch["reader"]``) are
    gathered and recorded in the ShardSource, so that a checkpoint resumes each reader at its next unopened shard
    and the skipped-sample report counts every rank (``mmgeo.data.shard_stream``)."""

    def __init__(self, source):
        self.source = source

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        from mmgeo.training.distributed import all_gather_no_grad, rank_and_world

        rows = batch["reader"].reshape(1, -1)
        if rank_and_world()[1] > 1:
            rows = all_gather_no_grad(rows)
        self.source.record(rows.tolist())


class AttentionDiagnostics(L.Callback):
    """Attention entropy, Q/K spectra, head redundancy and logit range (``mmgeo.eval.diagnostics``) on a fixed val
    batch every N steps, logged as diag/* scalars; each kind of threshold warning is raised once per run,
    and only after ``grace_steps`` (at initialisation attention is near-uniform by construction)."""

    def __init__(self, dataset, every_n_steps: int, grace_steps: int = 0):
        self.dataset, self.every, self.grace, self.warned = dataset, every_n_steps, grace_steps, set()

    def _run(self, trainer, module):
        model = module.model
        was_training = model.training
        model.eval()
        split = encode_split(model, self.dataset, progress=False)
        model.train(was_training)
        report = diagnose(model, split.texts, split.images, split.text_to_image, warn=False)
        for msg in report["warnings"] if trainer.global_step >= self.grace else []:
            symptom = msg.split(" — ", 1)[-1]
            if symptom not in self.warned:
                self.warned.add(symptom)
                warnings.warn(f"step {trainer.global_step}: {msg}", stacklevel=2)
        if trainer.logger is not None:
            trainer.logger.log_metrics(scalars(report), step=trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if module.model.geometric and (trainer.global_step - 1) % self.every == 0:
            self._run(trainer, module)

    def on_train_end(self, trainer, module):
        if module.model.geometric:
            self._run(trainer, module)
            if trainer.logger is not None:
                trainer.logger.save()


class ValidationRecall(L.Callback):
    """Text->image and image->text R@K on a val subset every N steps and at the end; non-finite val scores stop
    training (NonFiniteTraining) rather than log a recall."""

    def __init__(self, dataset, every_n_steps: int):
        self.dataset, self.every = dataset, every_n_steps

    def _run(self, trainer, module):
        model = module.model
        was_training = model.training
        model.eval()
        split = encode_split(model, self.dataset, progress=False)
        metrics = {}
        try:
            for mode in ("global", "geometric") if model.geometric else ("global",):
                m = retrieval_metrics(exact_scores(model, split.texts, split.images, mode, progress=False),
                                      split.text_to_image)
                metrics.update({f"val/{mode}/{k}": v for k, v in m.items() if "R@" in k})
        except NonFiniteScores as err:  # every rank scores the same val set: all stop together
            raise NonFiniteTraining(f"training stopped at step {trainer.global_step}: validation ({mode} score) "
                                    f"got non-finite scores, no recall logged. {err}") from err
        finally:
            model.train(was_training)
        if trainer.logger is not None:
            trainer.logger.log_metrics(metrics, step=trainer.global_step)
            trainer.logger.save()
        key = f"val/{model.default_mode}/text_to_image_R@1"
        if trainer.is_global_zero:
            print(f"\nstep {trainer.global_step}: val {key.split('/', 2)[2]} ({model.default_mode}) = "
                  f"{metrics[key]:.3f}")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.every and step % self.every == 0 and step < trainer.max_steps:
            self._run(trainer, module)

    def on_train_end(self, trainer, module):
        self._run(trainer, module)
