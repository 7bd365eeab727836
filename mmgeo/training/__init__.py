"""Contrastive training with Lightning, on one process or many (DDP / FSDP); train.py is its command line.

    config     the typed config (configs/*.yaml): TrainConfig and its sections, load_train_config
    module     RetrievalModule (loss, training aids, non-finite step skipping), step_seed
    callbacks  SkippedReport, AttentionDiagnostics, ValidationRecall
    io         AtomicCheckpointIO, RunCSVLogger, latest_checkpoint
    loop       train(argv) / fit(cfg): loader, callbacks, Trainer, run folder (refused when it holds a run)
    losses     symmetric InfoNCE on each score, on one rank or gathered across many (contrastive_loss)
    distributed  cross-rank gathering with gradients (gather_embedding), rank_and_world

Imports are lazy, so ``import mmgeo.training`` does no work.
"""

from importlib import import_module

_EXPORTS = {
    **dict.fromkeys(["TrainConfig", "DataConfig", "OptimConfig", "LossConfig", "TrainerConfig", "AidsConfig",
                     "load_train_config"], "mmgeo.training.config"),
    **dict.fromkeys(["RetrievalModule", "NonFiniteTraining", "step_seed"], "mmgeo.training.module"),
    **dict.fromkeys(["SkippedReport", "AttentionDiagnostics", "ValidationRecall"], "mmgeo.training.callbacks"),
    **dict.fromkeys(["AtomicCheckpointIO", "RunCSVLogger", "latest_checkpoint"], "mmgeo.training.io"),
    **dict.fromkeys(["ResumableLoader", "build_loader", "build_callbacks", "build_trainer", "fit", "parse_args",
                     "train", "RUN_OUTPUTS", "existing_run", "prepare_run_dir"], "mmgeo.training.loop"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mmgeo.training' has no attribute {name!r}")
