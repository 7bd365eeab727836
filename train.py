"""Train a retrieval model contrastively with Lightning.

    python train.py --config configs/synthetic.yaml [--trainer.max_steps 300 --model_args.d_a 64 ...]

Writes under runs/<name>/: config.yaml (the resolved config), metrics.csv (losses, temperatures,
validation R@K), checkpoints/ (Lightning, for resuming), model.pt (for eval.py / load_model).
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
from mmgeo.diagnostics import diagnose, orthogonality_penalty, qk_weights, scalars
from mmgeo.losses import retrieval_loss
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
    hard_negatives: bool = True  # pair each image with a one-change variant in the batch (synthetic only)


@dataclass
class OptimConfig:
    lr: float = 1e-3  # peak AdamW learning rate
    weight_decay: float = 0.05  # AdamW weight decay (not on biases, norms, temperatures)
    betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas (CLIP's)
    warmup_steps: int = 50  # linear warm-up, then cosine decay to 0 at max_steps


@dataclass
class LossConfig:
    global_weight: float = 1.0  # λ: weight of the global InfoNCE next to the geometric one


@dataclass
class TrainerConfig:
    max_steps: int = 1000  # optimiser steps
    batch_size: int = 128  # image–caption pairs per step (one random caption of five per image)
    accelerator: str = "auto"  # Lightning accelerator: cpu, gpu, auto
    devices: int = 1  # devices to train on
    precision: str = "32-true"  # Lightning precision, e.g. bf16-mixed on GPU
    val_every_n_steps: int = 250  # validation R@K interval (0 = only at the end)
    log_every_n_steps: int = 10  # metrics logging interval
    checkpoint_every_n_steps: int = 500  # Lightning checkpoint interval
    seed: int = 0  # seed of weights, caption choice and data order
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
            print(f"\nepoch {trainer.current_epoch}: {split} skipped {dict(ds.skipped) or 'nothing'} "
                  f"({len(ds)} images used)")
            if trainer.logger is not None and ds.skipped:
                trainer.logger.log_metrics({f"data/{split}_skipped_{k}": v for k, v in ds.skipped.items()},
                                           step=trainer.global_step)


class CaptionPairs(Dataset):
    """(pixels, caption) pairs of one image; the caption is one of the image's five, drawn from
    (seed, epoch, index) so that every epoch sees a fresh but reproducible choice. With
    ``hard_negatives`` the image's one-change variant (``dataset.variant(i)``) comes along, so the
    two sit in the same batch as each other's hardest negative."""

    def __init__(self, dataset, transform, seed: int, hard_negatives: bool = False):
        if hard_negatives and not hasattr(dataset, "variant"):
            raise ValueError(f"{type(dataset).__name__} cannot make hard-negative variants (only the synthetic "
                             "shapes world can); set data.hard_negatives: false")
        self.dataset, self.transform, self.seed, self.epoch = dataset, transform, seed, 0
        self.hard_negatives = hard_negatives

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> list[tuple[torch.Tensor, str]]:
        rng = np.random.default_rng([self.seed, self.epoch, i])
        samples = [self.dataset[i]] + ([self.dataset.variant(i)] if self.hard_negatives else [])
        return [(self.transform(image), captions[rng.integers(len(captions))]) for image, captions in samples]


class Collate:
    def __init__(self, tokenize):
        self.tokenize = tokenize

    def __call__(self, batch):
        pairs = [pair for item in batch for pair in item]
        pixels = torch.stack([p for p, _ in pairs])  # (B, 3, H, W)
        return {**self.tokenize([c for _, c in pairs]), "pixels": pixels}


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
        if self.cfg.aids.freeze_value_fraction > 0:
            frozen = self.value_frozen(self.global_step)
            for p in self.groups["value"]:  # no grad -> AdamW skips them: no update, no decay, state untouched
                p.requires_grad_(not frozen)
                if frozen:
                    p.grad = None

    def training_step(self, batch, batch_idx):
        text, image = self.model(batch["input_ids"], batch["attention_mask"], batch["pixels"])
        losses = retrieval_loss(self.model.logits(text, image), self.cfg.loss.global_weight)
        if self.cfg.aids.ortho_weight > 0 and self.model.geometric:
            losses["ortho"] = sum(orthogonality_penalty(w) for w in qk_weights(self.model).values())
            losses["loss"] = losses["loss"] + self.cfg.aids.ortho_weight * losses["ortho"]
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, prog_bar=True, batch_size=len(batch["pixels"]))
        scales = {"train/temp_global": 1 / self.model.logit_scale_global.exp()}
        if self.model.geometric:
            scales["train/temp_geo"] = 1 / self.model.logit_scale_geo.exp()
        self.log_dict(scales, batch_size=len(batch["pixels"]))
        return losses["loss"]

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

    def on_train_epoch_start(self):
        self.trainer.train_dataloader.dataset.epoch = self.current_epoch

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
        print(f"\nstep {trainer.global_step}: val {key.split('/', 2)[2]} ({model.default_mode}) = {metrics[key]:.3f}")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.every and step % self.every == 0 and step < trainer.max_steps:
            self._run(trainer, module)

    def on_train_end(self, trainer, module):
        self._run(trainer, module)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(TrainConfig, args.config, overrides)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    L.seed_everything(cfg.trainer.seed, workers=True, verbose=False)
    run_dir = Path(cfg.out_dir) / cfg.name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(f"# python train.py --config {run_dir / 'config.yaml'}\n"
                                         + yaml.safe_dump(to_dict(cfg), sort_keys=False))

    module = RetrievalModule(cfg)
    d = cfg.data
    train = open_split(d, "train", d.train_size)
    pairs = CaptionPairs(train, module.model.preprocess, cfg.trainer.seed, d.hard_negatives)
    per_item = 2 if d.hard_negatives else 1
    if cfg.trainer.batch_size % per_item:
        raise SystemExit(f"trainer.batch_size={cfg.trainer.batch_size} must be even with data.hard_negatives")
    loader = DataLoader(pairs, batch_size=cfg.trainer.batch_size // per_item, shuffle=True, drop_last=True,
                        num_workers=d.num_workers, collate_fn=Collate(module.model.tokenize))
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True,
                                                     every_n_train_steps=cfg.trainer.checkpoint_every_n_steps),
                 L.pytorch.callbacks.LearningRateMonitor("step")]
    splits = {"train": train}
    if d.val_size:
        val = splits["val"] = open_split(d, "val", d.val_size)
        callbacks.append(ValidationRecall(val, cfg.trainer.val_every_n_steps))
    callbacks.append(SkippedReport(splits))
    if cfg.aids.diagnostics_every_n_steps and module.model.geometric:
        diag_set = open_split(d, "val", cfg.aids.diagnostics_images)
        callbacks.append(AttentionDiagnostics(diag_set, cfg.aids.diagnostics_every_n_steps,
                                              grace_steps=cfg.trainer.max_steps // 10))  # warn past 10%
    t = cfg.trainer
    trainer = L.Trainer(max_steps=t.max_steps, accelerator=t.accelerator, devices=t.devices, precision=t.precision,
                        logger=L.pytorch.loggers.CSVLogger(cfg.out_dir, name=cfg.name, version=""),
                        callbacks=callbacks, log_every_n_steps=t.log_every_n_steps, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    start = time.time()
    trainer.fit(module, loader)
    out = save_model(module.model, run_dir / "model.pt")
    print(f"trained {t.max_steps} steps in {time.time() - start:.0f} s; model written to {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
