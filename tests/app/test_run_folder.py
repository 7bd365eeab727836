"""train.py and an existing run folder: a second run of the same name is refused, --overwrite replaces only what
training writes, --resume continues, both flags are an error."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import mmgeo.training as training
from tests.conftest import TINY


def _args(out: Path, *extra: str) -> list[str]:
    args = ["--config", "configs/synthetic.yaml", "--out_dir", str(out), "--name", "run", "--trainer.max_steps", "4",
            "--trainer.batch_size", "8", "--data.train_size", "16", "--data.val_size", "0",
            "--data.num_workers", "0", "--trainer.checkpoint_every_n_steps", "2", "--trainer.log_every_n_steps", "1",
            "--trainer.log_samples", "true", "--aids.diagnostics_every_n_steps", "0", *extra]
    return args + [x for k, v in TINY.items() for x in (f"--model_args.{k}", str(v))]


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[int]:
    with open(run / "metrics.csv", newline="") as f:
        return sorted({int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")})


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    training.train(_args(out))
    return out, out / "run"


def test_second_run_of_the_same_name_is_refused_and_the_first_untouched(first):
    out, run = first
    before = _files(run)
    assert {"model.pt", "config.yaml", "metrics.csv", "samples.tsv", "checkpoints/step=000004.ckpt"} <= set(before)
    with pytest.raises(SystemExit) as stop:
        training.train(_args(out, "--trainer.seed", "1"))
    msg = str(stop.value)
    assert msg.startswith(f"run folder {run} already holds a run (model.pt, checkpoints/ (2 step checkpoints, "
                          "newest step=000004.ckpt), metrics.csv)")
    assert "--name OTHER" in msg and "--resume" in msg and "--overwrite" in msg
    assert _files(run) == before  # byte-identical


def test_resume_and_overwrite_together_is_an_error(first, capsys):
    out, run = first
    before = _files(run)
    with pytest.raises(SystemExit):
        training.train(_args(out, "--resume", "--overwrite"))
    assert "not allowed with argument" in capsys.readouterr().err
    assert _files(run) == before


def test_overwrite_replaces_the_run_and_keeps_other_files(tmp_path):
    training.train(_args(tmp_path))
    run = tmp_path / "run"
    (run / "notes.txt").write_text("my notes")
    (run / "plots").mkdir()
    (run / "plots" / "a.png").write_bytes(b"png")
    old_model = (run / "model.pt").read_bytes()
    training.train(_args(tmp_path, "--overwrite", "--trainer.seed", "1", "--trainer.max_steps", "3",
                         "--trainer.checkpoint_every_n_steps", "3"))
    assert (run / "notes.txt").read_text() == "my notes" and (run / "plots" / "a.png").read_bytes() == b"png"
    assert (run / "model.pt").read_bytes() != old_model
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step=000003.ckpt"]  # none of the first run
    assert _steps(run) == [0, 1, 2]
    assert "seed: 1" in (run / "config.yaml").read_text()
    assert len((run / "samples.tsv").read_text().splitlines()) == 3


def test_resume_continues_the_run(tmp_path):
    training.train(_args(tmp_path))
    run = tmp_path / "run"
    training.train(_args(tmp_path, "--resume", "--trainer.max_steps", "6"))
    assert _steps(run) == list(range(6))
    assert (run / "checkpoints" / "step=000006.ckpt").is_file()
