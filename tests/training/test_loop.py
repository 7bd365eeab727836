"""The training loop's pieces: data drawn at the model's input size, batches that split over devices."""

from pathlib import Path

import pytest

from mmgeo.data.pairs import open_split
from mmgeo.training.config import load_train_config
from mmgeo.training.loop import build_loader, resume_checkpoint
from mmgeo.training.module import RetrievalModule
from tests.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]
TINY_ARGS = [x for k, v in TINY.items() if k != "image_size" for x in (f"--model_args.{k}", str(v))]


@pytest.mark.parametrize("size", [32, 48])
def test_batches_are_drawn_at_the_models_image_size(size):
    cfg = load_train_config("configs/synthetic.yaml", TINY_ARGS + ["--model_args.image_size", str(size),
                                                                    "--trainer.batch_size", "4",
                                                                    "--data.num_workers", "0"])
    module = RetrievalModule(cfg)
    train = open_split(cfg.data, "train", 8, module.model.cfg.image_size)
    assert train.image_size == size
    loader = build_loader(cfg, module, train)
    batch = next(iter(loader))
    assert batch["pixels"].shape == (4, 3, size, size)
    assert int(batch["num_captions"]) == 4 and batch["input_ids"].shape[0] == 4 + 4 * 2  # 2 caption negatives each


@pytest.mark.parametrize("config", ["synthetic", "synthetic_clip", "synthetic_ddp"])
def test_synthetic_configs_keep_48_px_and_a_6x6_patch_grid(config):
    """The shapes world is drawn at geo-tiny's 48 px: 3×3 scene cells of 2×2 patches of 8 px."""
    cfg = load_train_config(ROOT / "configs" / f"{config}.yaml")
    model = RetrievalModule(cfg).model
    assert model.cfg.image_size == 48 and model.patch_grid == (6, 6)


def test_batch_must_split_over_devices_and_variants():
    cfg = load_train_config("configs/synthetic.yaml", TINY_ARGS + ["--trainer.batch_size", "6",
                                                                    "--data.hard_negatives", "true",
                                                                    "--trainer.devices", "2"])
    with pytest.raises(SystemExit, match=r"batch_size=6 must split into 2 device\(s\) × 2 pair\(s\) per image"):
        build_loader(cfg, RetrievalModule(cfg), open_split(cfg.data, "train", 8, 32))


def test_resume_names_a_missing_checkpoint(tmp_path):
    assert resume_checkpoint(tmp_path, None) is None
    with pytest.raises(SystemExit, match="does not exist"):
        resume_checkpoint(tmp_path, str(tmp_path / "nope.ckpt"))
