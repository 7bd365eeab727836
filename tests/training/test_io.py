"""Run-folder I/O: the newest step checkpoint, atomic checkpoint writes."""

import pytest
import torch

from mmgeo.training.io import AtomicCheckpointIO, checkpoint_step, latest_checkpoint


def test_latest_checkpoint_by_step_ignoring_partial_writes(tmp_path):
    with pytest.raises(SystemExit, match="no step checkpoint"):
        latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    for name in ("step=000009.ckpt", "step=000010.ckpt", ".step=000012.ckpt.abc.tmp"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    assert latest_checkpoint(tmp_path).name == "step=000010.ckpt"  # 10 > 9 as numbers; the temp file is not one


def test_atomic_checkpoint_round_trip(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "step=000003.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.arange(4.0)}, path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    back = io.load_checkpoint(path)
    assert back["global_step"] == checkpoint_step(path) == 3 and torch.equal(back["w"], torch.arange(4.0))
