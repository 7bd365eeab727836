"""The entry points end to end at test size: training (train.py's CLI) -> model.pt -> eval.py -> JSON."""

import json

import pytest
import torch

import eval as eval_app
import mmgeo.training as training
from tests.conftest import TINY

METRIC_KEYS = {f"{d}_R@{k}" for d in ("image_to_text", "text_to_image") for k in (1, 5, 10)} | {
    f"{d}_{s}_rank" for d in ("image_to_text", "text_to_image") for s in ("mean", "median")}


def _train(tmp_path, config="configs/synthetic.yaml", steps=3, extra=()):
    args = ["--config", config, "--out_dir", str(tmp_path), "--trainer.max_steps", str(steps),
            "--trainer.batch_size", "8", "--trainer.val_every_n_steps", "2", "--data.train_size", "64",
            "--data.val_size", "6", "--data.num_workers", "0",
            "--trainer.checkpoint_every_n_steps", "2", "--trainer.log_every_n_steps", "1"]
    for k, v in TINY.items():
        args += [f"--model_args.{k}", str(v)]
    return training.train(args + list(extra))  # TINY: 32 px images


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("run"))


def test_train_writes_run_folder(trained):
    run = trained.parent
    assert trained.name == "model.pt" and trained.is_file()
    assert (run / "config.yaml").read_text().startswith("# python train.py --config")
    assert list((run / "checkpoints").glob("*.ckpt"))
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert "train/loss_geometric" in header and "val/geometric/text_to_image_R@1" in header


@pytest.mark.parametrize("mode", ["exact", "two-stage"])
def test_eval_writes_the_protocol_json(trained, tmp_path, mode, capsys):
    out = tmp_path / "r.json"
    eval_app.main(["--ckpt", str(trained), "--split", "test", "--limit", "10", "--out", str(out), "--mode", mode,
                   "--k-prime", "4", "--plot", str(tmp_path / "recall.png")])
    result = json.loads(out.read_text())
    assert {"dataset", "model", "task", "metrics", "counts", "mode"} <= set(result)
    assert set(result["metrics"]) == METRIC_KEYS
    assert result["counts"] == {"images": 10, "captions": 50}
    assert all(0 <= result["metrics"][k] <= 1 for k in METRIC_KEYS if "R@" in k)
    assert ("first_stage" in result) == (mode == "two-stage")
    assert (tmp_path / "recall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "text to image" in printed and "R@10" in printed


def test_lightning_checkpoint_evaluates_too(trained, tmp_path):
    ckpt = training.latest_checkpoint(trained.parent)  # a step checkpoint
    result = eval_app.main(["--ckpt", str(ckpt), "--limit", "5"])
    assert result["counts"]["images"] == 5


def test_clip_baseline_trains_and_refuses_two_stage(tmp_path):
    model = _train(tmp_path, "configs/synthetic_clip.yaml", steps=2)
    result = eval_app.main(["--ckpt", str(model), "--limit", "5"])
    assert result["score"] == "global"
    with pytest.raises(SystemExit, match="two-stage"):
        eval_app.main(["--ckpt", str(model), "--limit", "5", "--mode", "two-stage"])


def test_init_from_starts_a_run_from_a_trained_model(trained, tmp_path):
    """A warm start: one step at learning rate 0 leaves the weights as they were loaded (not BatchNorm's running
    statistics, which a training step updates at any rate), less the coverage fitted after its training (the
    default config fits one; this run does not)."""
    import mmgeo

    out = _train(tmp_path, steps=1, extra=["--trainer.init_from", str(trained), "--optim.lr", "0",
                                            "--trainer.val_every_n_steps", "0", "--coverage.weight", "0"])
    loaded, started = mmgeo.load_model(trained), mmgeo.load_model(out)
    assert loaded.cfg.coverage_weight == 0.05 and started.cfg.coverage_weight == 0
    a = {k: v for k, v in loaded.named_parameters() if not k.startswith("salience.")}
    b = dict(started.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_a_different_model_is_refused(trained, tmp_path):
    with pytest.raises(ValueError, match="holds a different model"):
        _train(tmp_path, steps=1, extra=["--trainer.init_from", str(trained), "--model_args.d_a", "12"])


def test_coverage_fit_after_training_writes_the_model_with_it(trained, tmp_path, capsys):
    """coverage.weight: the run's model.pt is the trained model plus the fitted salience, scored with β."""
    import mmgeo

    out = _train(tmp_path, steps=1, extra=["--trainer.init_from", str(trained), "--optim.lr", "0",
                                            "--trainer.val_every_n_steps", "0", "--coverage.weight", "0.1",
                                            "--coverage.images", "16", "--coverage.steps", "5"])
    assert "coverage fitted on" in capsys.readouterr().out
    fitted, plain = mmgeo.load_model(out), mmgeo.load_model(trained)
    assert fitted.coverage_term[0] == 0.1 and fitted.salience.proj.weight.abs().sum() > 0
    shared = dict(plain.named_parameters())  # weights, not BatchNorm's running statistics (a step updates them)
    assert all(torch.equal(v, shared[k]) for k, v in fitted.named_parameters() if not k.startswith("salience."))


def test_coverage_fit_needs_a_geometric_model(tmp_path):
    with pytest.raises(ValueError, match="coverage fit needs a geometric model"):
        _train(tmp_path, "configs/synthetic_clip.yaml", steps=1, extra=["--coverage.weight", "0.1"])
