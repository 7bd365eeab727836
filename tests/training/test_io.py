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


def test_a_trainer_starts_without_lightnings_advert_or_its_own_deprecation(tmp_path):
    """build_trainer silences the litlogger tip and the LeafSpec deprecation; Lightning's other lines stay."""
    import logging
    import warnings

    from mmgeo.training.config import load_train_config
    from mmgeo.training.loop import build_trainer

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        cfg = load_train_config("configs/synthetic.yaml")
        cfg.out_dir = str(tmp_path)
        build_trainer(cfg, [])
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records]
    assert any("GPU available" in m for m in said)  # what Lightning says about the run is kept
    assert not any("litlogger" in m for m in said)
    with warnings.catch_warnings(record=True) as caught:  # the filters build_trainer set, kept
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`",
                      FutureWarning, stacklevel=1)
        warnings.warn("a warning about the run", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning about the run"]
