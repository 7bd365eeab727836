"""What a run writes and reads back: atomic step checkpoints, the metrics log that survives a resume, and the
newest checkpoint of a run folder; and what Lightning prints that says nothing about the run."""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path

import lightning as L
import torch

from mmgeo.io import atomic_path


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


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest complete step checkpoint of a run (temp files of an interrupted write are ignored)."""
    found = sorted((run_dir / "checkpoints").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    if not found:
        raise SystemExit(f"--resume: no step checkpoint in {run_dir / 'checkpoints'}; train with "
                         "trainer.checkpoint_every_n_steps > 0 first, or pass --resume PATH")
    return found[-1]


def checkpoint_step(path: Path) -> int:
    """The global step a Lightning checkpoint was written at (read lazily: the weights stay on disk)."""
    return torch.load(path, "cpu", weights_only=True, mmap=True)["global_step"]


class _NoAdvert(logging.Filter):
    """Drops Lightning's tip to install its cloud logger (printed at every Trainer start)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_lightning() -> None:
    """Silence two lines Lightning prints at every run that say nothing about it: the tip to install
    ``litlogger`` and the deprecation of ``isinstance(treespec, LeafSpec)`` inside Lightning's own ``_pytree``
    (torch's change, not ours to act on). Lightning's other messages (devices, warnings about the run) stay."""
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where rank_zero_info logs
    if not any(isinstance(f, _NoAdvert) for f in log.filters):
        log.addFilter(_NoAdvert())
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
