"""Fault tolerance of train.py: SIGKILL mid-epoch, --resume, same weights and same samples.

Training runs as a real subprocess so that the kill is a real SIGKILL. The uninterrupted reference and the
killed + resumed run use the same config; dropout is on (0.1; the default config has none), and per-step seeds
make it reproducible.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mmgeo.training as training
from mmgeo.data.sampler import read_samples
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY, ITEMS, ITEMS_PER_STEP = 30, 3, 64, 8  # 8 steps per epoch: checkpoints 3, 6, 9 are mid-epoch


def _args(out: Path, name: str, *extra: str, config: str = "configs/synthetic.yaml") -> list[str]:
    args = ["--config", config, "--name", name, "--out_dir", str(out),
            "--trainer.max_steps", str(STEPS), "--trainer.batch_size", str(ITEMS_PER_STEP),
            "--trainer.checkpoint_every_n_steps", str(EVERY), "--trainer.log_samples", "true",
            "--trainer.val_every_n_steps", "0", "--trainer.log_every_n_steps", "1", "--trainer.threads", "1",
            "--data.train_size", str(ITEMS), "--data.val_size", "0", "--data.num_workers", "1",
            "--aids.diagnostics_every_n_steps", "0", "--model_args.text_dropout", "0.1", *extra]
    for k, v in TINY.items():
        args += [f"--model_args.{k}", str(v)]
    return args


def _run(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """The run's output once it ends; past ``timeout`` every process of it (ranks, loader workers) prints its
    stacks (train.py's SIGUSR1) and is killed, and the test fails with them."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [proc.pid, *_descendants(proc.pid)]
        for sig in (signal.SIGUSR1, signal.SIGKILL):
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            time.sleep(3)
        out, _ = proc.communicate()
        pytest.fail(f"train.py still running after {timeout} s; the stacks of its processes {tree}:\n{out[-30000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (each thread's /proc children list)."""
    out, todo = [], [pid]
    while todo:
        with contextlib.suppress(OSError):  # a process that ended meanwhile has no children left
            tasks = Path(f"/proc/{todo.pop()}/task").iterdir()
            kids = [int(c) for t in tasks for c in (t / "children").read_text().split()]
            out += kids
            todo += kids
    return out


def _samples_reached(path: Path, step: int) -> bool:
    return path.is_file() and any(int(line.split("\t")[0]) >= step for line in path.read_text().splitlines())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    reference = _run(_args(out, "straight"))
    victim = _run(_args(out, "killed"))
    samples = out / "killed" / "samples.tsv"
    deadline = time.time() + 240
    while not _samples_reached(samples, EVERY + 1) and victim.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert victim.poll() is None, "training finished before it could be killed: " + victim.communicate()[0][-2000:]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = max(int(line.split("\t")[0]) for line in samples.read_text().splitlines())
    ckpt = training.latest_checkpoint(out / "killed")
    resumed_out = _finish(_run(_args(out, "killed", "--resume")))
    _finish(reference)
    return {"out": out, "killed_at": killed_at, "resumed_from": int(ckpt.stem.split("=")[1]), "log": resumed_out}


def test_kill_happened_mid_epoch_and_resumed(runs):
    frm, killed = runs["resumed_from"], runs["killed_at"]
    assert 0 < frm < STEPS and frm % (ITEMS // ITEMS_PER_STEP) != 0, f"resumed from step {frm}: not mid-epoch"
    assert frm <= killed < STEPS, f"killed at step {killed} of {STEPS}"
    assert f"resumed from step={frm:06d}.ckpt" in runs["log"]


def test_resumed_weights_equal_uninterrupted(runs):
    a = torch.load(runs["out"] / "straight" / "model.pt", weights_only=True)["state_dict"]
    b = torch.load(runs["out"] / "killed" / "model.pt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=f"{k} differs after resume")
    moved = torch.load(runs["out"] / "killed" / "checkpoints" / f"step={STEPS - STEPS % EVERY:06d}.ckpt",
                       weights_only=True)["global_step"]
    assert moved == STEPS - STEPS % EVERY


def test_same_samples_none_repeated_or_skipped(runs):
    a = read_samples(runs["out"] / "straight" / "samples.tsv")
    b = read_samples(runs["out"] / "killed" / "samples.tsv")
    assert sorted(a) == sorted(b) == list(range(STEPS))
    assert a == b
    epochs = {}
    for step, (epoch, items) in b.items():
        assert len(items) == ITEMS_PER_STEP and epoch == step // (ITEMS // ITEMS_PER_STEP)
        epochs.setdefault(epoch, []).extend(items)
    for epoch, items in epochs.items():  # within an epoch, every item at most once (all of them when complete)
        assert len(items) == len(set(items)), f"epoch {epoch} repeats items"
        if len(items) == ITEMS:
            assert sorted(items) == list(range(ITEMS))
    lines = (runs["out"] / "killed" / "samples.tsv").read_text().splitlines()
    redone = len(lines) - STEPS  # steps after the checkpoint that the kill threw away, trained again
    assert redone == runs["killed_at"] + 1 - runs["resumed_from"]


def test_metrics_log_survives_the_resume(runs):
    """Rows before the checkpoint are kept, rows of the thrown-away steps are not duplicated."""
    a, b = ((runs["out"] / name / "metrics.csv").read_text().splitlines() for name in ("straight", "killed"))
    assert a[0] == b[0] and sorted(a) == sorted(b)


def test_resume_needs_a_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="no step checkpoint"):
        training.train(_args(tmp_path, "none", "--resume"))


def test_resume_refuses_another_data_order(runs):
    ckpt = training.latest_checkpoint(runs["out"] / "killed")
    with pytest.raises(ValueError, match="cannot resume this data order"):
        training.train(_args(runs["out"], "other", "--trainer.seed", "1", "--resume", str(ckpt)))


def test_resume_at_an_epoch_boundary(tmp_path):
    """A checkpoint written on the last step of an epoch resumes into the next epoch's order."""
    import shutil

    args = lambda name, *x: _args(tmp_path, name, "--trainer.max_steps", "12", "--trainer.checkpoint_every_n_steps",  # noqa: E731
                                  "4", "--data.num_workers", "0", *x)
    training.train(args("straight"))
    boundary = tmp_path / "straight" / "checkpoints" / "step=000008.ckpt"  # 8 steps per epoch
    assert boundary.is_file()
    shutil.copy(boundary, tmp_path / "boundary.ckpt")
    training.train(args("resumed", "--resume", str(tmp_path / "boundary.ckpt")))
    a, b = (torch.load(tmp_path / n / "model.pt", weights_only=True)["state_dict"] for n in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    samples = read_samples(tmp_path / "resumed" / "samples.tsv")
    assert sorted(samples) == list(range(8, 12)) and {e for e, _ in samples.values()} == {1}
    assert samples == {s: v for s, v in read_samples(tmp_path / "straight" / "samples.tsv").items() if s >= 8}


@pytest.mark.parametrize("target", ["main", "group"])
def test_sigterm_stops_in_one_line_that_says_how_to_continue(tmp_path, target):
    """SIGTERM to the trainer alone (Lightning stops the loop) or to its process group (the data loader worker dies
    too): exit status 143, one line naming the step and the command that continues, no traceback; with the group,
    that command is run and finishes the run."""
    name = f"stopped_{target}"
    victim = _run(_args(tmp_path, name, "--trainer.max_steps", "300"), start_new_session=True)
    samples = tmp_path / name / "samples.tsv"
    deadline = time.time() + 240
    while not _samples_reached(samples, EVERY + 1) and victim.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert victim.poll() is None, "training finished before it could be stopped: " + victim.communicate()[0][-2000:]
    if target == "main":
        victim.send_signal(signal.SIGTERM)
    else:
        os.killpg(victim.pid, signal.SIGTERM)
    out, _ = victim.communicate(timeout=120)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out[-3000:]  # (a progress bar may still print after it)
    last = errors[0]
    assert victim.returncode == 143, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert last.startswith("error: training stopped at step ") and last.endswith(
        f"with: python train.py --config {tmp_path / name / 'config.yaml'} --resume"), last
    if target == "group":
        command = last.split("with: python train.py ")[1].split() + ["--trainer.max_steps", str(STEPS)]
        resumed = _finish(_run(command))
        assert "resumed from step=" in resumed and (tmp_path / name / "model.pt").is_file()
