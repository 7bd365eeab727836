"""Flickr30K and open_clip through the entry points, on format-faithful fixtures (no network)."""

import json

import pytest

import eval as eval_app
import mmgeo.training as training
from tests import openclip_tiny
from tests.conftest import TINY
from tests.data.flickr_fixtures import BAD_EXPECTED, COUNTS, MAX_PIXELS, WRITERS


def flickr_args(root, fmt):
    return ["--data", "flickr30k", "--data-root", str(root), "--data-format", fmt, "--max-pixels", str(MAX_PIXELS)]


def train_flickr(tmp_path, root, fmt, model="geo-tiny", steps=2, extra=()):
    args = ["--config", "configs/flickr30k_geo_vitb16_bert.yaml", "--model", model, "--out_dir", str(tmp_path),
            "--data.root", str(root), "--data.format", fmt, "--data.max_pixels", str(MAX_PIXELS),
            "--data.num_workers", "0", "--data.val_size", "3", "--trainer.max_steps", str(steps),
            "--trainer.batch_size", "4", "--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--trainer.val_every_n_steps", "0", "--trainer.log_every_n_steps", "1", "--optim.warmup_steps", "1",
            "--aids.diagnostics_every_n_steps", "0", *extra]
    if model == "geo-tiny":
        for k, v in TINY.items():
            args += [f"--model_args.{k}", str(v)]
    return training.train(args)


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_train_and_evaluate_from_each_layout(fmt, tmp_path, capsys):
    root = WRITERS[fmt](tmp_path / "data", bad=True)
    model = train_flickr(tmp_path / "runs", root, fmt, steps=3)  # 8 train images, batch 4: two epochs
    printed = capsys.readouterr().out
    assert "epoch 0: train skipped nothing (8 images used)" in printed
    out = tmp_path / "r.json"
    eval_app.main(["--ckpt", str(model), *flickr_args(root, fmt), "--split", "test", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["dataset"] == "flickr30k"
    assert result["counts"] == {"images": COUNTS["test"] + 1, "captions": 5 * COUNTS["test"] + 4,
                                "skipped": BAD_EXPECTED}
    assert "skipped bad samples" in capsys.readouterr().out


def test_training_log_reports_skipped_samples(tmp_path, capsys):
    root = WRITERS["karpathy"](tmp_path / "data", bad=True, bad_split="train")
    model = train_flickr(tmp_path / "runs", root, "karpathy", steps=2)
    assert f"epoch 0: train skipped {BAD_EXPECTED} ({COUNTS['train'] + 1} images used)" in capsys.readouterr().out
    header = (model.parent / "metrics.csv").read_text().splitlines()[0]
    assert "data/train_skipped_missing_file" in header and "data/train_skipped_too_large" in header


def test_hard_negatives_are_synthetic_only(tmp_path):
    root = WRITERS["csv"](tmp_path / "data")
    with pytest.raises(ValueError, match="hard_negatives: false"):
        train_flickr(tmp_path / "runs", root, "csv", extra=["--data.hard_negatives", "true"])


@pytest.fixture(scope="module")
def tiny_openclip(tmp_path_factory):
    return "openclip:" + openclip_tiny.register(tmp_path_factory.mktemp("oc"))


def test_openclip_model_evaluates_zero_shot(tiny_openclip, tmp_path):
    root = WRITERS["hf"](tmp_path / "data")
    result = eval_app.main(["--model", tiny_openclip, *flickr_args(root, "hf"), "--split", "val"])
    assert result["score"] == "global" and result["model"] == tiny_openclip
    assert result["counts"] == {"images": COUNTS["val"], "captions": 5 * COUNTS["val"], "skipped": {}}
    with pytest.raises(SystemExit):  # --ckpt and --model are mutually exclusive
        eval_app.main(["--model", tiny_openclip, "--ckpt", "x.pt"])


def test_missing_openclip_weights_name_the_download(monkeypatch):
    from mmgeo.models.hub import MissingDownloadError
    from mmgeo.models.openclip_adapter import load_openclip

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MissingDownloadError, match="huggingface-cli download laion/CLIP-ViT-B-32-laion2B-s34B-b79K"):
        load_openclip("openclip:ViT-B-32/laion2b_s34b_b79k")
