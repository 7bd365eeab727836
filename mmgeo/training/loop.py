"""A training run end to end: the resumable data loader, the callbacks, the Lightning Trainer, the run folder.

    train(["--config", "configs/synthetic.yaml", "--trainer.max_steps", "300"])  # what train.py runs
    fit(load_train_config("configs/synthetic.yaml"), resume="last")            # the same from a config

Writes under <out_dir>/<name>/: config.yaml (the resolved config), metrics.csv, checkpoints/ (atomic step
checkpoints, for resume), model.pt (for eval.py / load_model), samples.tsv (with trainer.log_samples) — the
RUN_OUTPUTS. A folder that already holds a run is refused unless the run is resumed or ``overwrite`` is given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import threading
import time
import zipfile
from pathlib import Path

import lightning as L
import torch
import yaml
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from mmgeo.config import CliParser, Stopped, to_dict
from mmgeo.data.caption_groups import dataset_neighbours
from mmgeo.data.pairs import CaptionPairs, Collate, open_split
from mmgeo.data.sampler import ResumableBatchSampler, SampleLog
from mmgeo.data.shard_stream import ShardLoader, ShardPairs, ShardSource
from mmgeo.models.checkpoint import load_model, load_weights, save_model
from mmgeo.training.callbacks import AttentionDiagnostics, ShardProgress, SkippedReport, ValidationRecall
from mmgeo.training.config import TrainConfig, load_train_config
from mmgeo.training.io import AtomicCheckpointIO, RunCSVLogger, checkpoint_step, latest_checkpoint, quiet_lightning
from mmgeo.training.module import NonFiniteTraining, RetrievalModule

# What a training run writes in its folder (hparams.yaml: Lightning's CSV logger, when hyperparameters are logged);
# --overwrite removes these and nothing else.
RUN_OUTPUTS = ("model.pt", "config.yaml", "metrics.csv", "checkpoints", "samples.tsv", "hparams.yaml")


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


def build_loader(cfg: TrainConfig, module: RetrievalModule, train) -> ResumableLoader:
    """The training loader: ResumableBatchSampler (same order on any number of ranks, resumable), or for shards a
    ShardLoader (``mmgeo.data.shard_stream``)."""
    t, per_item = cfg.trainer, 2 if cfg.data.hard_negatives else 1
    world = t.devices * t.num_nodes
    if t.batch_size % (per_item * world):
        raise SystemExit(f"trainer.batch_size={t.batch_size} must split into {world} device(s) × "
                         f"{per_item} pair(s) per image{' (data.hard_negatives)' if per_item == 2 else ''}")
    vocabulary = module.model.cfg.text_vocab  # a word-level tokenizer: negatives must not bring unknown words
    groups = cfg.data.caption_groups
    if groups and (isinstance(train, ShardSource) or (t.batch_size // (per_item * world)) % groups):
        raise SystemExit(f"data.caption_groups={groups} needs map-style data (not shards) and must divide the "
                         f"{t.batch_size // (per_item * world)} images per device of a batch; set it to 0 or a divisor")
    loss = cfg.loss  # the edit terms that read which edits are true of which images need the caption truth
    truth = cfg.data.mask_true_captions or bool(loss.edit_query_weight) or (
        bool(loss.negative_query_weight) and loss.negative_query_rows == "true_of_another")
    pairs = CaptionPairs(train, module.model.preprocess, t.seed, cfg.data.hard_negatives, cfg.data.caption_negatives,
                         cfg.data.negative_kinds, vocabulary, cfg.data.partial_captions, cfg.data.negative_weights,
                         caption_truth=truth, fewer_phrase_negatives=cfg.data.fewer_phrase_negatives,
                         colorless_sub_captions=cfg.data.colorless_sub_captions,
                         typed_captions=cfg.data.typed_captions, typed_relations=cfg.data.typed_relations,
                         typed_plurals=cfg.data.typed_plurals)
    if isinstance(train, ShardSource):
        stream = ShardPairs(train, pairs, Collate(module.model.tokenize), t.batch_size // world, t.seed)
        return ShardLoader(stream, t.batch_size, cfg.data.num_workers)
    neighbours = dataset_neighbours(train, 4 * groups, by=cfg.data.caption_groups_by) \
        if groups else None  # (N, 4·group) nearest captions, or images a whole caption is true of
    sampler = ResumableBatchSampler(len(pairs), t.batch_size // per_item, seed=t.seed, neighbours=neighbours,
                                    group=groups or 1)
    return ResumableLoader(pairs, batch_sampler=sampler, num_workers=cfg.data.num_workers,
                           collate_fn=Collate(module.model.tokenize))


def build_callbacks(cfg: TrainConfig, module: RetrievalModule, train, run_dir: Path, extra=()) -> list:
    """Learning-rate monitor, progress bar, ``extra``, step checkpoints, validation R@K, skipped-sample report
    and attention diagnostics, as the config asks; val sets are drawn at the model's input size."""
    t, d, image_size = cfg.trainer, cfg.data, module.model.cfg.image_size
    callbacks = [L.pytorch.callbacks.LearningRateMonitor("step"), L.pytorch.callbacks.TQDMProgressBar(refresh_rate=10),
                 *extra]
    if t.checkpoint_every_n_steps:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=run_dir / "checkpoints", filename="step={step:06d}", auto_insert_metric_name=False,
            every_n_train_steps=t.checkpoint_every_n_steps, save_top_k=2, monitor="step", mode="max"))
    splits = {"train": train}
    if d.val_size:
        val = splits["val"] = open_split(d, "val", d.val_size, image_size)
        callbacks.append(ValidationRecall(val, t.val_every_n_steps))
    callbacks.append(SkippedReport(splits))
    if isinstance(train, ShardSource):
        callbacks.append(ShardProgress(train))
    if cfg.aids.diagnostics_every_n_steps and module.model.geometric:
        diag_set = open_split(d, "val", cfg.aids.diagnostics_images, image_size)
        callbacks.append(AttentionDiagnostics(diag_set, cfg.aids.diagnostics_every_n_steps,
                                              grace_steps=t.max_steps // 10))  # warn past 10%
    return callbacks


def build_trainer(cfg: TrainConfig, callbacks: list, resume_step: int | None = None) -> L.Trainer:
    """The Lightning Trainer of the config: our data order (no distributed sampler), atomic checkpoints, and a
    metrics log that keeps the rows before ``resume_step``."""
    t = cfg.trainer
    quiet_lightning()
    return L.Trainer(max_steps=t.max_steps, accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes,
                     strategy=t.strategy, precision=t.precision, use_distributed_sampler=False,
                     plugins=[AtomicCheckpointIO()], enable_checkpointing=bool(t.checkpoint_every_n_steps),
                     logger=RunCSVLogger(cfg.out_dir, name=cfg.name, version="", resume_step=resume_step),
                     callbacks=callbacks, log_every_n_steps=t.log_every_n_steps, enable_model_summary=False,
                     limit_val_batches=0, num_sanity_val_steps=0)


def resume_checkpoint(run_dir: Path, resume: str | None) -> Path | None:
    """The checkpoint to resume from: None, the run's newest (``"last"``) or the path given."""
    ckpt = None if resume is None else latest_checkpoint(run_dir) if resume == "last" else Path(resume)
    if ckpt is not None and not ckpt.is_file():
        raise SystemExit(f"--resume: checkpoint {ckpt} does not exist")
    if ckpt is not None and not zipfile.is_zipfile(ckpt):  # torch.save's archive: its directory is at the end
        raise SystemExit(f"--resume: {ckpt} is not a step checkpoint (not a torch archive: damaged, truncated, or "
                         "another kind of file); resume from one of the run's checkpoints/step=*.ckpt")
    return ckpt


def existing_run(run_dir: Path) -> list[str]:
    """What of an earlier run ``run_dir`` holds: model.pt, step checkpoints, metrics.csv (empty: no run)."""
    held = ["model.pt"] if (run_dir / "model.pt").is_file() else []
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step=*.ckpt"))
    if steps:
        held.append(f"checkpoints/ ({len(steps)} step checkpoint{'s' if len(steps) > 1 else ''}, newest {steps[-1]})")
    return held + (["metrics.csv"] if (run_dir / "metrics.csv").is_file() else [])


def prepare_run_dir(run_dir: Path, resume: str | None = None, overwrite: bool = False) -> None:
    """Refuse a run folder that already holds a run unless it is resumed or ``overwrite``; with ``overwrite``,
    remove its RUN_OUTPUTS (never other files). Every rank checks — nothing a run writes that counts as a run
    exists before all ranks have started — and only rank 0 removes."""
    if resume is not None and overwrite:
        raise SystemExit("--resume continues the run in the folder, --overwrite replaces it: give one, not both")
    held = existing_run(run_dir)
    if not held or resume is not None:
        return
    if not overwrite:
        raise SystemExit(f"run folder {run_dir} already holds a run ({', '.join(held)}); train under another name "
                         "(--name OTHER), continue it (--resume), or replace it (--overwrite: removes "
                         f"{', '.join(RUN_OUTPUTS)} and keeps any other file)")
    # the launcher's environment says the rank before any process group exists (RANK / LOCAL_RANK / SLURM_PROCID;
    # NODE_RANK: Lightning's own launcher on several nodes sets only the local rank)
    if L.pytorch.utilities.rank_zero_only.rank == 0 and os.environ.get("NODE_RANK", "0") == "0":
        for name in RUN_OUTPUTS:
            path = run_dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        print(f"--overwrite: removed the earlier run ({', '.join(held)}) from {run_dir}")


def _quiet_workers_on_sigterm(signum, frame) -> None:
    """A SIGTERM to the process group kills the data loader workers too; torch's SIGCHLD handler would then raise
    again while Lightning shuts the loader down (a traceback after the one-line report). The run is stopping, so a
    dying worker is expected from here on: back to the default SIGCHLD handling."""
    if hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def fit(cfg: TrainConfig, resume: str | None = None, callbacks: list | None = None, overwrite: bool = False) -> Path:
    """Train as ``cfg`` says and return the written model.pt; ``resume``: None, "last" or a checkpoint path;
    ``callbacks``: extra Lightning callbacks (e.g. to observe steps); ``overwrite``: replace a run already in
    the run folder (refused otherwise, unless resumed)."""
    t, d = cfg.trainer, cfg.data
    if t.threads:
        torch.set_num_threads(t.threads)
    L.seed_everything(t.seed, workers=True, verbose=False)
    run_dir = Path(cfg.out_dir) / cfg.name
    prepare_run_dir(run_dir, resume, overwrite)
    ckpt = resume_checkpoint(run_dir, resume)
    resume_step = None if ckpt is None else checkpoint_step(ckpt)

    module = RetrievalModule(cfg)
    if cfg.coverage.weight and not module.model.geometric:
        raise ValueError(f"coverage.weight: the coverage fit needs a geometric model ({cfg.model} has only the "
                         "global score); set coverage.weight: 0")
    if t.init_from and ckpt is None:
        load_weights(module.model, t.init_from)
    train = open_split(d, "train", d.train_size, module.model.cfg.image_size)
    loader = build_loader(cfg, module, train)
    trainer = build_trainer(cfg, build_callbacks(cfg, module, train, run_dir, callbacks or ()), resume_step)
    loader.progress = lambda: trainer.global_step
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(f"# python train.py --config {run_dir / 'config.yaml'}\n"
                                             + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if t.log_samples:
        module.samples_log = SampleLog(run_dir / "samples.tsv")
    start = time.time()
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = signal.signal(signal.SIGTERM, _quiet_workers_on_sigterm) if main_thread else None  # Lightning adds to it
    try:
        trainer.fit(module, loader, ckpt_path=ckpt)
    except NonFiniteTraining as err:
        raise SystemExit(str(err)) from err
    except (SIGTERMException, RuntimeError) as err:
        cause = "SIGTERM" if isinstance(err, SIGTERMException) else str(err).splitlines()[0].strip().rstrip(".")
        if isinstance(err, RuntimeError) and not ("DataLoader worker" in cause and "signal" in cause):
            raise
        last = latest_checkpoint(run_dir)
        raise Stopped(f"training stopped at step {trainer.global_step} ({cause}); continue it from "
                      f"{last.name if last else 'the start (no step checkpoint yet)'} with: python train.py "
                      f"--config {run_dir / 'config.yaml'} --resume") from err
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    out = run_dir / "model.pt"
    state = trainer.strategy.lightning_module_state_dict()  # every rank takes part (FSDP gathers its shards)
    if trainer.is_global_zero:
        save_model(module.model, out, {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
        print(f"trained {t.max_steps} steps in {time.time() - start:.0f} s"
              f"{f' (resumed from {ckpt.name})' if ckpt else ''}; model written to {out}")
        if cfg.coverage.weight:
            from mmgeo.training.fit_coverage import fit_into

            start = time.time()
            record = fit_into(load_model(out), _coverage_split(d, train, cfg.coverage.images), cfg.coverage, out,
                              log=lambda line: print(f"coverage fit {line}"))
            print(f"coverage fitted on {record['fitted_on']} of {record['captions']} captions in "
                  f"{time.time() - start:.0f} s (own image first among its candidates: "
                  f"{record['own_first_before']:.3f} -> {record['own_first_after_at_fit_weight']:.3f}); "
                  f"model with coverage_weight {cfg.coverage.weight} written to {out}")
    return out


def _coverage_split(d, train, images: int):
    """The training images the coverage fit reads: the train split itself, or for shards (streamed, not indexed)
    their first ``images`` samples in order."""
    if d.name != "webdataset":
        return train
    from mmgeo.data import build_dataset

    return build_dataset("webdataset", "train", size=images, shards=d.shards, max_pixels=d.max_pixels)


def parse_args(argv: list[str] | None = None, description: str | None = None) -> tuple[TrainConfig, str | None, bool]:
    """train.py's command line -> (config, resume, overwrite): ``--config YAML``, ``--resume [CKPT]``,
    ``--overwrite``, dotted overrides."""
    parser = CliParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file (see configs/)")
    again = parser.add_mutually_exclusive_group()
    again.add_argument("--resume", nargs="?", const="last", default=None, metavar="CKPT",
                       help="continue from a step checkpoint (default: the run's newest) — same config")
    again.add_argument("--overwrite", action="store_true",
                       help="replace the run already in <out_dir>/<name>/: removes only what training writes ("
                            + ", ".join(RUN_OUTPUTS) + "), never other files in the folder; without it (or "
                            "--resume) a folder holding a run is refused")
    args, overrides = parser.parse_known_args(argv)
    return load_train_config(args.config, overrides), args.resume, args.overwrite


def train(argv: list[str] | None = None, callbacks: list | None = None, description: str | None = None) -> Path:
    """Train as the command line ``argv`` says (train.py's CLI); returns the written model.pt."""
    cfg, resume, overwrite = parse_args(argv, description)
    return fit(cfg, resume, callbacks, overwrite)
