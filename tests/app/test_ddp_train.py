"""train.py on 2 CPU processes (Lightning DDP, gloo) follows the single-process run step for step.

On the whole-caption recipe (configs/synthetic_full_captions.yaml): the default's conv stem normalises over each
rank's batch (BatchNorm, not synchronised) and its edit queries are asked within a rank, so by design its DDP loss
is not the single-process one.

Same global batches (samples.tsv) and the same loss at every step, with and without local loss; text
dropout off, since ranks draw their own masks. Weights are compared only loosely: Adam turns gradient
noise of ~1e-9 on parameters the loss cannot see (e.g. the key bias, which softmax ignores) into ±lr
steps, so weight equality after training is not a meaningful test of the loss — tests/training/test_distributed.py
checks loss and gradients to 1e-5 directly.
"""

from __future__ import annotations

import csv

import pytest

from mmgeo.data.sampler import read_samples
from tests.app.test_resume import _args, _finish, _run

STEPS = 6


def _losses(run_dir) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    common = ("--trainer.max_steps", str(STEPS), "--trainer.checkpoint_every_n_steps", "0",
              "--model_args.text_dropout", "0", "--trainer.accelerator", "cpu")
    ddp = ("--trainer.strategy", "ddp", "--trainer.devices", "2")
    cfg = "configs/synthetic_full_captions.yaml"
    procs = {"single": _run(_args(out, "single", *common, config=cfg)),
             "ddp": _run(_args(out, "ddp", *common, *ddp, config=cfg)),
             "ddp-local": _run(_args(out, "ddp-local", *common, *ddp, "--loss.local_loss", "true", config=cfg))}
    logs = {name: _finish(p) for name, p in procs.items()}
    return out, logs


@pytest.mark.parametrize("name", ["ddp", "ddp-local"])
def test_ddp_follows_single_process(runs, name):
    out, logs = runs
    assert "trained 6 steps" in logs[name]
    assert read_samples(out / name / "samples.tsv") == read_samples(out / "single" / "samples.tsv")
    a, b = _losses(out / "single"), _losses(out / name)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * max(1.0, abs(a[step])), f"step {step}: {a[step]} vs {b[step]}"
    assert (out / name / "model.pt").is_file()
