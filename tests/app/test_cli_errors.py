"""Every entry point (train.py, eval.py, ``python -m serve``, ``python -m mmgeo.eval.viz``) ends a user's mistake —
a missing checkpoint, a damaged one, a bad flag combination — in one line ``error: ...`` on stderr and a non-zero
status, never a traceback (``mmgeo.config.call_cli``); with MMGEO_DEBUG=1 the traceback comes first."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"train": ["train.py"], "eval": ["eval.py"], "serve": ["-m", "serve"], "viz": ["-m", "mmgeo.eval.viz"]}


def _cases(tmp: Path) -> dict[tuple[str, str], tuple[list[str], str]]:
    """(entry point, case) -> (arguments, what the error line says)."""
    none, bad = str(tmp / "none" / "model.pt"), str(tmp / "model.pt")
    train = ["--config", "configs/synthetic.yaml", "--out_dir", str(tmp / "runs")]
    build = ["build", "--data", "synthetic", "--out", str(tmp / "index")]
    return {
        ("train", "missing"): ([*train, "--resume", none], "does not exist"),
        ("train", "damaged"): ([*train, "--resume", bad], "is not a step checkpoint"),
        ("train", "flags"): ([*train, "--resume", "--overwrite"], "not allowed with argument --resume"),
        ("eval", "missing"): (["--ckpt", none], "does not exist"),
        ("eval", "damaged"): (["--ckpt", bad], "checkpoint"),
        ("eval", "flags"): (["--index", str(tmp), "--mode", "exact"], "drop --mode exact"),
        ("serve", "missing"): ([*build, "--ckpt", none], "does not exist"),
        ("serve", "damaged"): ([*build, "--ckpt", bad], "checkpoint"),
        ("serve", "flags"): ([*build, "--ckpt", bad, "--keep-patches", "4"], "go together"),
        ("serve", "missing-index"): (["run", "--index", str(tmp / "none")], "not an index"),
        ("viz", "missing"): (["--ckpt", none, "--image", "synthetic:0"], "does not exist"),
        ("viz", "damaged"): (["--ckpt", bad, "--image", "synthetic:0"], "checkpoint"),
        ("viz", "flags"): (["curves", "--run", str(tmp), "--ckpt", bad], "unrecognized arguments"),
    }


CASES = sorted(_cases(Path("/")))


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "model.pt").write_bytes(random.Random(0).randbytes(24))  # a damaged checkpoint: a few random bytes
    return tmp


def _run(entry: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "MMGEO_DEBUG"}
    return subprocess.run([sys.executable, *ENTRY_POINTS[entry], *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**base, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env})


@pytest.fixture(scope="module")
def results(tmp) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every case's process, run side by side (each mostly imports torch, Lightning for train.py)."""
    cases = _cases(tmp)
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 2))) as pool:
        done = {key: pool.submit(_run, key[0], args) for key, (args, _) in cases.items()}
    return {key: f.result() for key, f in done.items()}


@pytest.mark.parametrize("entry, case", CASES, ids=[f"{e}-{c}" for e, c in CASES])
def test_a_users_mistake_ends_in_one_error_line(tmp, results, entry, case):
    _, says = _cases(tmp)[entry, case]
    res = results[entry, case]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp / "runs").exists() and not (tmp / "index").exists()  # refused before anything was written


def test_debug_shows_the_traceback(tmp):
    args, says = _cases(tmp)["eval", "missing"]
    res = _run("eval", args, MMGEO_DEBUG="1")
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and lines[0] == "Traceback (most recent call last):", res.stderr[-3000:]
    assert "FileNotFoundError" in res.stderr and lines[-1].startswith("error: ") and says in lines[-1]


def test_bad_config_values_end_in_one_error_line(tmp, capsys, monkeypatch):
    """train.py's config errors (a missing file, a value of the wrong type, an unknown key), in process."""
    from mmgeo.config import call_cli
    from mmgeo.training.loop import train

    monkeypatch.delenv("MMGEO_DEBUG", raising=False)
    for args, says in ((["--config", str(tmp / "none.yaml")], "does not exist"),
                       (["--config", "configs/synthetic.yaml", "--trainer.max_steps", "x"], "expected int"),
                       (["--config", "configs/synthetic.yaml", "--trainer.max_step", "3"], "did you mean 'max_steps'")):
        assert call_cli(train, args) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines
