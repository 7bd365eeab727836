"""Train a retrieval model contrastively with Lightning, on one process or many (DDP / FSDP).

    python train.py --config configs/synthetic.yaml [--trainer.max_steps 300 --model_args.d_a 64 ...]
    python train.py --config configs/synthetic.yaml --resume          # continue from the last step checkpoint

Writes under runs/<name>/: config.yaml (the resolved config), metrics.csv (losses, temperatures,
validation R@K), checkpoints/ (step checkpoints, written atomically, for --resume), model.pt (for
eval.py / load_model), samples.tsv (with trainer.log_samples: the items of every step).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader, Dataset

from mmgeo.checkpoint import model_record, save_model
from mmgeo.config import load_config, to_dict
from mmgeo.data import MAX_PIXELS, build_dataset
from mmgeo.data.caption_edits import EDIT_KINDS, caption_negatives
from mmgeo.data.sampler import ResumableBatchSampler, SampleLog
from mmgeo.diagnostics import diagnose, nonfinite_cause, orthogonality_penalty, scalars
from mmgeo.distributed import all_gather_no_grad, all_reduce_any, rank_and_world
from mmgeo.io import atomic_path
from mmgeo.losses import contrastive_loss
from mmgeo.metrics import retrieval_metrics
from mmgeo.models import create_model
from mmgeo.retrieval import encode_split, exact_scores

QK_MODULES = ("query_mlp", "key_head", "lowrank")  # the Q/K maps (M_Q, M_K, low-rank U V)
VALUE_MODULES = ("value_proj", "text_value")  # the value projections (P_V, W_u)


@dataclass
class DataConfig:
    name: str = "synthetic"  # dataset: "synthetic" = the embedded shapes world, "flickr30k" = Karpathy split at root
    root: str | None = None  # flickr30k: folder / file / HF dataset id (data/README.md); unused for synthetic
    format: str | None = None  # flickr30k layout: hf | karpathy | csv (None = detect from root)
    max_pixels: int = MAX_PIXELS  # flickr30k: images with more pixels are skipped (decompression-bomb guard)
    seed: int = 0  # dataset seed (scenes and captions)
    image_size: int = 64  # side of the generated images in pixels (synthetic only)
    train_size: int | None = None  # images of the train split to use (None = all)
    val_size: int = 200  # val images scored for R@K during training (0 = no validation)
    num_workers: int = 1  # DataLoader worker processes
    hard_negatives: bool = False  # pair each image with a one-change variant in the batch (synthetic only: the
    # scene graph makes it, so no real dataset can give this signal; kept for comparison)
    caption_negatives: int = 0  # rule-based text hard negatives per caption (NegCLIP-style word swaps / replacements /
    # relation flips of the caption itself, mmgeo.data.caption_edits; any dataset), extra negatives of image->text
    negative_kinds: list[str] = field(default_factory=lambda: list(EDIT_KINDS))  # caption edit kinds to draw from


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak AdamW learning rate
    weight_decay: float = 0.05  # AdamW weight decay (not on biases, norms, temperatures)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas (CLIP's)
    warmup_steps: int = 50  # linear warm-up, then cosine decay to 0 at max_steps


@dataclass
class LossConfig:
    global_weight: float = 1.0  # λ: weight of the global InfoNCE next to the geometric one
    local_loss: bool = False  # several ranks: score local captions/images against all (2·B·W·B pairs, not (W·B)²)


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # optimiser steps
    batch_size: int = 128  # image–caption pairs per step over ALL devices (each gets batch_size / world)
    accelerator: str = "auto"  # Lightning accelerator: cpu, gpu, auto
    devices: int = 1  # devices (processes) per node
    num_nodes: int = 1  # nodes (SLURM / torchrun); world size = devices × num_nodes
    strategy: str = "auto"  # Lightning strategy: auto, ddp, fsdp (loss gathered across ranks either way)
    precision: str = "32-true"  # Lightning precision, e.g. bf16-mixed on GPU
    val_every_n_steps: int = 250  # validation R@K interval (0 = only at the end)
    log_every_n_steps: int = 10  # metrics logging interval
    checkpoint_every_n_steps: int = 500  # step checkpoints (atomic) for --resume; 0 = only at the end
    max_nonfinite_steps: int = 5  # a non-finite loss/gradient skips its step; stop after this many in a row
    log_samples: bool = False  # append each step's item indices to samples.tsv (audits the data order)
    seed: int = 0  # seed of weights, caption choice, data order and per-step dropout
    threads: int = 0  # torch CPU threads (0 = torch's default)


@dataclass
class AidsConfig:
    """Training aids from the paper (DESIGN §3, §8); all off by default."""

    qk_init_gain: float | None = None  # orthogonal Q/K init gain (paper 0.1); sets model_args.qk_init_gain
    clip_qk: float | None = None  # layered clipping: max grad norm of the Q/K maps (paper 0.5); None = off
    clip_value: float = 1.0  # layered clipping: max grad norm of the value projections (paper 1.0)
    clip_rest: float = 1.0  # layered clipping: max grad norm of all other parameters together
    freeze_value_fraction: float = 0.0  # two-stage warm-up: value projections frozen this fraction of steps (paper 0.1)
    ortho_weight: float = 0.0  # orthogonality regulariser: loss += weight · Σ ||W Wᵀ − I||²_F over Q/K maps
    diagnostics_every_n_steps: int = 100  # log attention diagnostics on a fixed val batch (0 = off); training unchanged
    diagnostics_images: int = 16  # val images (with all their captions) in that batch

    def __post_init__(self):
        if not 0 <= self.freeze_value_fraction < 1:
            raise ValueError(f"aids.freeze_value_fraction must be in [0, 1), got {self.freeze_value_fraction}; "
                             "the paper freezes the value projections for 0.1 of the steps")
        limits = {"clip_qk": self.clip_qk, "clip_value": self.clip_value, "clip_rest": self.clip_rest}
        bad = {k: v for k, v in limits.items() if v is not None and v <= 0}
        if bad:
            raise ValueError(f"aids clipping limits must be positive max-norms, got {bad} (paper: 0.5 Q/K, 1.0 value)")


@dataclass
class TrainConfig:
    name: str = "synthetic"  # run name: outputs go to <out_dir>/<name>/
    out_dir: str = "runs"  # root of run folders
    model: str = "geo-tiny"  # registered model variant (mmgeo.list_models())
    model_args: dict = field(default_factory=dict)  # ModelConfig overrides, e.g. {d_a: 64}
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    aids: AidsConfig = field(default_factory=AidsConfig)


def open_split(d: DataConfig, split: str, size: int | None):
    """The dataset of ``split`` described by the data config (synthetic or flickr30k)."""
    return build_dataset(d.name, split, seed=d.seed, image_size=d.image_size, size=size, root=d.root,
                         data_format=d.format, max_pixels=d.max_pixels)


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


class CaptionPairs(Dataset):
    """(pixels, caption, negatives) of one image, keyed by ``(i, epoch, step)`` from ResumableBatchSampler; the
    caption is one of the image's five, drawn from (seed, epoch, i): a fresh but reproducible choice each
    epoch. ``negatives``: up to ``caption_negatives`` rule-based edits of that caption (NegCLIP-style,
    ``mmgeo.data.caption_edits``; ``vocabulary`` keeps a word-level tokenizer's words). With
    ``hard_negatives`` the image's one-change variant (``dataset.variant(i)``) comes along, so the two
    sit in the same batch as each other's hardest negative."""

    def __init__(self, dataset, transform, seed: int, hard_negatives: bool = False, caption_negatives: int = 0,
                 negative_kinds=EDIT_KINDS, vocabulary=None):
        if hard_negatives and not hasattr(dataset, "variant"):
            raise ValueError(f"{type(dataset).__name__} cannot make hard-negative variants (only the synthetic "
                             "shapes world can); set data.hard_negatives: false")
        self.dataset, self.transform, self.seed = dataset, transform, seed
        self.hard_negatives, self.caption_negatives = hard_negatives, caption_negatives
        self.negative_kinds, self.vocabulary = tuple(negative_kinds), vocabulary

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, int]) -> dict:
        i, epoch, step = key
        rng = np.random.default_rng([self.seed, epoch, i])
        samples = [self.dataset[i]] + ([self.dataset.variant(i)] if self.hard_negatives else [])
        pairs = []
        for image, captions in samples:
            caption = captions[rng.integers(len(captions))]
            negatives = caption_negatives(caption, rng, self.caption_negatives, self.negative_kinds,
                                          self.vocabulary) if self.caption_negatives else []
            pairs.append((self.transform(image), caption, negatives))
        return {"pairs": pairs, "index": i, "epoch": epoch, "step": step}


class Collate:
    """Items -> one batch: pixels (B, 3, H, W), the B captions then every negative caption tokenised together
    (``input_ids`` / ``attention_mask`` (B + N_neg, T)); ``num_captions`` = B."""

    def __init__(self, tokenize):
        self.tokenize = tokenize

    def __call__(self, batch):
        pairs = [pair for item in batch for pair in item["pairs"]]
        pixels = torch.stack([p for p, _, _ in pairs])  # (B, 3, H, W)
        steps = {(item["epoch"], item["step"]) for item in batch}
        if len(steps) != 1:
            raise RuntimeError(f"one batch mixes (epoch, step) {sorted(steps)}: the batch sampler is broken")
        epoch, step = steps.pop()
        texts = [c for _, c, _ in pairs] + [n for _, _, negs in pairs for n in negs]
        return {**self.tokenize(texts), "pixels": pixels, "num_captions": torch.tensor(len(pairs)),
                "index": torch.tensor([item["index"] for item in batch]),  # (B_items,) dataset indices
                "epoch": torch.tensor(epoch), "step": torch.tensor(step)}


class ResumableLoader(DataLoader):
    """A DataLoader Lightning saves and restores with the checkpoint (its ``_Stateful`` protocol): the
    state is the data position after ``progress()`` consumed global batches (the trainer's global step)."""

    def __init__(self, *args, progress=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.progress = progress

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict(self.progress())

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)


class AtomicCheckpointIO(L.pytorch.plugins.TorchCheckpointIO):
    """Checkpoints written to a temp file, fsynced, then renamed: a kill mid-write leaves the previous
    file intact, never a truncated one. Read back with ``weights_only=True`` (no code is unpickled)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with atomic_path(path) as tmp:
            torch.save(checkpoint, tmp)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


class RunCSVLogger(L.pytorch.loggers.CSVLogger):
    """Lightning's CSVLogger, except that a resumed run keeps the rows logged before its checkpoint's step
    (Lightning's writer deletes metrics.csv when it starts); rows of steps the crash threw away are dropped."""

    def __init__(self, *args, resume_step: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    def experiment(self):
        if self._experiment is not None or L.pytorch.utilities.rank_zero_only.rank != 0:
            return super().experiment  # other ranks get Lightning's no-op stand-in
        old, rows = Path(self.log_dir) / "metrics.csv", []
        if old.is_file() and self.resume_step is not None:
            import csv

            with open(old, newline="") as f:
                rows = [{k: v for k, v in r.items() if v != ""} for r in csv.DictReader(f)
                        if r.get("step", "") != "" and int(float(r["step"])) < self.resume_step]
        elif old.is_file():
            warnings.warn(f"{old} of an earlier run is replaced by this run's (pass --resume to continue that "
                          "run instead)", stacklevel=1)
        with warnings.catch_warnings():  # Lightning's "log files ... will be deleted": said above, or not true
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = super().experiment  # removes the old file
        writer.metrics[:0] = rows
        return writer


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of one (step, rank): dropout depends on nothing else, so a resumed run draws the same."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


class NonFiniteTraining(RuntimeError):
    """``trainer.max_nonfinite_steps`` non-finite steps in a row; the message names the likely cause."""


class RetrievalModule(L.LightningModule):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.cfg = cfg
        model_args = dict(cfg.model_args)
        gain = cfg.aids.qk_init_gain
        if gain is not None:
            if model_args.get("qk_init_gain", gain) != gain:
                raise ValueError(f"aids.qk_init_gain={gain} and model_args.qk_init_gain={model_args['qk_init_gain']} "
                                 "disagree; set only one")
            model_args["qk_init_gain"] = gain
        self.model = create_model(cfg.model, **{**model_args, "extra": {"dataset": cfg.data.name}})
        self.groups = self._param_groups()
        self.nonfinite_streak, self.skipped_steps = 0, []  # non-finite steps skipped: in a row, all (global steps)
        self._loss_nonfinite, self._batch = False, None
        self.samples_log: SampleLog | None = None  # set by main() with trainer.log_samples

    def _param_groups(self) -> dict[str, list[torch.nn.Parameter]]:
        """Parameters by aid group: "qk" (Q/K maps), "value" (value projections), "rest"."""
        groups = {"qk": [], "value": [], "rest": []}
        for name, p in self.model.named_parameters():
            top = name.split(".", 1)[0]
            groups["qk" if top in QK_MODULES else "value" if top in VALUE_MODULES else "rest"].append(p)
        return groups

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
        text, image = self.model(batch["input_ids"], batch["attention_mask"], batch["pixels"])
        B = int(batch["num_captions"])
        negatives = text[B:] if len(text) > B else None  # rule-based caption edits (data.caption_negatives)
        losses = contrastive_loss(self.model, text[:B], image, self.cfg.loss.global_weight, self.cfg.loss.local_loss,
                                  negatives)
        if self.cfg.aids.ortho_weight > 0 and self.model.geometric:
            losses["ortho"] = sum(orthogonality_penalty(w) for w in self.model.qk_maps().values())
            losses["loss"] = losses["loss"] + self.cfg.aids.ortho_weight * losses["ortho"]
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
        """Layered clipping (DESIGN §8): Q/K maps, value projections and the rest each to their own max norm."""
        a = self.cfg.aids
        if a.clip_qk is None:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        limits = {"qk": a.clip_qk, "value": a.clip_value, "rest": a.clip_rest}
        norms = {f"grad_norm/{g}": torch.nn.utils.clip_grad_norm_([p for p in ps if p.grad is not None], limits[g])
                 for g, ps in self.groups.items()}  # norms before clipping
        self.log_dict(norms, batch_size=self.cfg.trainer.batch_size)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.dim() < 2 or "logit_scale" in name else decay).append(p)
        o = self.cfg.optim
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=tuple(o.betas))
        total, warm = self.cfg.trainer.max_steps, o.warmup_steps

        def schedule(step):
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint):
        checkpoint["mmgeo"] = model_record(self.model)


class AttentionDiagnostics(L.Callback):
    """Attention entropy, Q/K spectra, head redundancy and logit range (``mmgeo.diagnostics``) on a fixed val
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
    """Text->image and image->text R@K on a val subset every N steps and at the end."""

    def __init__(self, dataset, every_n_steps: int):
        self.dataset, self.every = dataset, every_n_steps

    def _run(self, trainer, module):
        model = module.model
        was_training = model.training
        model.eval()
        split = encode_split(model, self.dataset, progress=False)
        metrics = {}
        for mode in ("global", "geometric") if model.geometric else ("global",):
            m = retrieval_metrics(exact_scores(model, split.texts, split.images, mode, progress=False),
                                  split.text_to_image)
            metrics.update({f"val/{mode}/{k}": v for k, v in m.items() if "R@" in k})
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


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete step checkpoint of a run (temp files of an interrupted write are ignored)."""
    found = sorted((run_dir / "checkpoints").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    if not found:
        raise SystemExit(f"--resume: no step checkpoint in {run_dir / 'checkpoints'}; train with "
                         "trainer.checkpoint_every_n_steps > 0 first, or pass --resume PATH")
    return found[-1]


def build_loader(cfg: TrainConfig, module: RetrievalModule, train) -> ResumableLoader:
    """The training loader: ResumableBatchSampler (same order on any number of ranks, resumable)."""
    t, per_item = cfg.trainer, 2 if cfg.data.hard_negatives else 1
    world = t.devices * t.num_nodes
    if t.batch_size % (per_item * world):
        raise SystemExit(f"trainer.batch_size={t.batch_size} must split into {world} device(s) × "
                         f"{per_item} pair(s) per image{' (data.hard_negatives)' if per_item == 2 else ''}")
    vocabulary = module.model.cfg.text_vocab  # a word-level tokenizer: negatives must not bring unknown words
    pairs = CaptionPairs(train, module.model.preprocess, t.seed, cfg.data.hard_negatives, cfg.data.caption_negatives,
                         cfg.data.negative_kinds, vocabulary)
    sampler = ResumableBatchSampler(len(pairs), t.batch_size // per_item, seed=t.seed)
    return ResumableLoader(pairs, batch_sampler=sampler, num_workers=cfg.data.num_workers,
                           collate_fn=Collate(module.model.tokenize))


def main(argv: list[str] | None = None, callbacks: list | None = None) -> Path:
    """Train as the command line says; ``callbacks``: extra Lightning callbacks (e.g. to observe steps)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    parser.add_argument("--resume", nargs="?", const="last", default=None, metavar="CKPT",
                        help="continue from a step checkpoint (default: the run's newest) — same config")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(TrainConfig, args.config, overrides)
    t, d = cfg.trainer, cfg.data
    if t.threads:
        torch.set_num_threads(t.threads)
    L.seed_everything(t.seed, workers=True, verbose=False)
    run_dir = Path(cfg.out_dir) / cfg.name
    ckpt = None if args.resume is None else latest_checkpoint(run_dir) if args.resume == "last" else Path(args.resume)
    if ckpt is not None and not ckpt.is_file():
        raise SystemExit(f"--resume: checkpoint {ckpt} does not exist")
    resume_step = None if ckpt is None else torch.load(ckpt, "cpu", weights_only=True, mmap=True)["global_step"]

    module = RetrievalModule(cfg)
    train = open_split(d, "train", d.train_size)
    loader = build_loader(cfg, module, train)
    callbacks = [L.pytorch.callbacks.LearningRateMonitor("step"), L.pytorch.callbacks.TQDMProgressBar(refresh_rate=10),
                 *(callbacks or [])]
    if t.checkpoint_every_n_steps:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=run_dir / "checkpoints", filename="step={step:06d}", auto_insert_metric_name=False,
            every_n_train_steps=t.checkpoint_every_n_steps, save_top_k=2, monitor="step", mode="max"))
    splits = {"train": train}
    if d.val_size:
        val = splits["val"] = open_split(d, "val", d.val_size)
        callbacks.append(ValidationRecall(val, t.val_every_n_steps))
    callbacks.append(SkippedReport(splits))
    if cfg.aids.diagnostics_every_n_steps and module.model.geometric:
        diag_set = open_split(d, "val", cfg.aids.diagnostics_images)
        callbacks.append(AttentionDiagnostics(diag_set, cfg.aids.diagnostics_every_n_steps,
                                              grace_steps=t.max_steps // 10))  # warn past 10%
    trainer = L.Trainer(max_steps=t.max_steps, accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
                        strategy=t.strategy, precision=t.precision, use_distributed_sampler=False,
                        plugins=[AtomicCheckpointIO()], enable_checkpointing=bool(t.checkpoint_every_n_steps),
                        logger=RunCSVLogger(cfg.out_dir, name=cfg.name, version="", resume_step=resume_step),
                        callbacks=callbacks, log_every_n_steps=t.log_every_n_steps, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    loader.progress = lambda: trainer.global_step
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(f"# python train.py --config {run_dir / 'config.yaml'}\n"
                                             + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if t.log_samples:
        module.samples_log = SampleLog(run_dir / "samples.tsv")
    start = time.time()
    try:
        trainer.fit(module, loader, ckpt_path=ckpt)
    except NonFiniteTraining as err:
        raise SystemExit(str(err)) from err
    out = run_dir / "model.pt"
    state = trainer.strategy.lightning_module_state_dict()  # every rank takes part (FSDP gathers its shards)
    if trainer.is_global_zero:
        save_model(module.model, out, {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
        print(f"trained {t.max_steps} steps in {time.time() - start:.0f} s"
              f"{f' (resumed from {ckpt.name})' if ckpt else ''}; model written to {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
