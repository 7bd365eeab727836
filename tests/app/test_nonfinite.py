"""Non-finite steps: skipped (no update) and reported; N in a row stop training with the likely cause."""

from __future__ import annotations

import lightning as L
import pytest
import torch

import mmgeo.training as training
from mmgeo.data.pairs import CaptionPairs
from tests.conftest import TINY


def _args(tmp_path, steps, *extra):
    args = ["--config", "configs/synthetic.yaml", "--out_dir", str(tmp_path), "--trainer.max_steps", str(steps),
            "--data.hard_negatives", "true",  # image variants: half of each batch stays finite when poisoned
            "--trainer.batch_size", "8", "--data.train_size", "32", "--data.num_workers", "0", "--data.val_size", "0",
            "--trainer.log_every_n_steps", "1",
            "--trainer.checkpoint_every_n_steps", "0", "--aids.diagnostics_every_n_steps", "0", *extra]
    return args + [x for k, v in TINY.items() for x in (f"--model_args.{k}", str(v))]


@pytest.fixture
def nan_at(monkeypatch):
    """In the given global steps, every item's own image (not its variant) is all-NaN: 4 of 8 pairs."""
    bad: set[int] = set()
    original = CaptionPairs.__getitem__

    def poisoned(self, key):
        item = original(self, key)
        if key[2] in bad:
            item["pairs"][0] = (torch.full_like(item["pairs"][0][0], float("nan")), *item["pairs"][0][1:])
        return item

    monkeypatch.setattr(CaptionPairs, "__getitem__", poisoned)
    return bad


class Moves(L.Callback):
    """Records, per global step, whether any weight or optimiser state changed."""

    def __init__(self):
        self.changed = {}

    def _snapshot(self, module, trainer):
        opt = trainer.optimizers[0]
        state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return [p.detach().clone() for p in module.parameters()] + [t.clone() for t in state]

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before = self._snapshot(module, trainer)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        after = self._snapshot(module, trainer)
        self.changed[trainer.global_step - 1] = len(after) != len(self.before) or any(
            not torch.equal(a, b) for a, b in zip(after, self.before))


def test_nan_step_is_skipped_and_reported(tmp_path, nan_at, capsys):
    nan_at.add(3)
    moves = Moves()
    training.train(_args(tmp_path, 6), callbacks=[moves])
    assert moves.changed == {0: True, 1: True, 2: True, 3: False, 4: True, 5: True}
    err = capsys.readouterr().err
    assert "step 3: non-finite loss — step skipped (no update); 1 in a row, 1 in total" in err
    header, *rows = (tmp_path / "synthetic" / "metrics.csv").read_text().splitlines()
    col = header.split(",").index("train/skipped_nonfinite")
    assert [r.split(",")[col] for r in rows if r.split(",")[col]] == ["0.0"] * 3 + ["1.0"] * 3  # running total
    model = torch.load(tmp_path / "synthetic" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())


def test_nan_streak_stops_training_with_the_cause(tmp_path, nan_at):
    nan_at.update(range(2, 100))
    with pytest.raises(SystemExit) as stop:
        training.train(_args(tmp_path, 20, "--trainer.max_nonfinite_steps", "3"))
    msg = str(stop.value)
    assert "training stopped at step 4: non-finite loss 3 steps in a row (steps [2, 3, 4])" in msg
    assert "Likely cause: the batch itself holds non-finite pixel values (4 of 8 images)" in msg
    assert not (tmp_path / "synthetic" / "model.pt").exists()


def test_exploding_logits_are_named(tmp_path):
    """Finite data, Q/K maps blown up: the stop message points at the logit explosion (docs/design.md §8)."""

    class Blow(L.Callback):
        def on_train_start(self, trainer, module):
            with torch.no_grad():
                module.model.query_mlp.fc2.weight.mul_(1e25)
                module.model.key_head.proj.weight.mul_(1e25)

    with pytest.raises(SystemExit, match="Likely cause: attention logits explode"):
        training.train(_args(tmp_path, 10, "--trainer.max_nonfinite_steps", "2"), callbacks=[Blow()])


def test_eval_of_a_model_with_nan_scores_exits_with_the_counts(tmp_path, capsys):
    """A checkpoint whose geometric scores are all NaN: eval.py stops (unchecked, NaN scores R@1 = 1.0)."""
    import eval as eval_app
    import mmgeo

    model = mmgeo.create_model("geo-tiny", **TINY).eval()
    with torch.no_grad():
        model.query_mlp.fc2.weight.fill_(float("nan"))  # every caption's queries: NaN
    ckpt = mmgeo.save_model(model, tmp_path / "nan.pt")
    with pytest.raises(SystemExit) as stop:
        eval_app.main(["--ckpt", str(ckpt), "--limit", "4", "--out", str(tmp_path / "r.json")])
    msg = str(stop.value)
    assert msg.startswith("80 of 80 scores are not finite (NaN 80): captions [0, 1, 2, 3, 4 …], images [0, 1, 2, 3]")
    assert "the model produced non-finite scores" in msg and "attention diagnostics" in msg
    assert not (tmp_path / "r.json").exists()


def test_eval_refuses_partly_infinite_scores(tmp_path, monkeypatch):
    import eval as eval_app
    import mmgeo

    model = mmgeo.create_model("geo-tiny", **TINY).eval()
    ckpt = mmgeo.save_model(model, tmp_path / "m.pt")
    original = type(model).score

    def some_inf(self, texts, images, mode=None):
        s = original(self, texts, images, mode).clone()
        s[:2, 1] = float("inf")  # rows scored in one block (20 captions): captions 0 and 1, image 1
        return s

    monkeypatch.setattr(type(model), "score", some_inf)
    with pytest.raises(SystemExit, match=r"^2 of 80 scores are not finite \(\+inf 2\): captions \[0, 1\], "
                                         r"images \[1\]"):
        eval_app.main(["--ckpt", str(ckpt), "--limit", "4"])
