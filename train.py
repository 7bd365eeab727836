"""Train a retrieval model contrastively with Lightning, on one process or many (DDP / FSDP).

    python train.py --config configs/synthetic.yaml [--trainer.max_steps 300 --model_args.d_a 64 ...]
    python train.py --config configs/synthetic.yaml --resume          # continue from the last step checkpoint
    python train.py --config configs/synthetic.yaml --overwrite       # replace the run already in runs/<name>/

Writes under runs/<name>/: config.yaml (the resolved config), metrics.csv (losses, temperatures,
validation R@K), checkpoints/ (step checkpoints, written atomically, for --resume), model.pt (for
eval.py / load_model), samples.tsv (with trainer.log_samples: the items of every step). A folder that already
holds a run (model.pt, step checkpoints or metrics.csv) is refused unless --resume or --overwrite is given;
--overwrite removes only those outputs, never other files in the folder. A run that seems hung prints every
thread's Python stack to stderr on ``kill -USR1 PID`` (each rank and loader worker is a process of its own).
"""

from __future__ import annotations

from pathlib import Path

from mmgeo.config import run_cli
from mmgeo.training import loop


def main(argv: list[str] | None = None, callbacks: list | None = None) -> Path:
    """Train as the command line says (mmgeo.training.loop.train); ``callbacks``: extra Lightning callbacks."""
    return loop.train(argv, callbacks, description=__doc__)


if __name__ == "__main__":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: every thread's stack (hung runs)
    run_cli(main)
