"""Training aids (docs/design.md §3) in real runs: each switch does what it says, and eval.py reports diagnostics.

Unit tests of the module and callbacks are in tests/training/."""

import torch

import mmgeo.training as training
from mmgeo.eval.diagnostics import orthogonality_penalty
from mmgeo.training import RetrievalModule
from tests.conftest import TINY


def _train(tmp_path, steps, extra):
    args = ["--config", "configs/synthetic.yaml", "--out_dir", str(tmp_path), "--trainer.max_steps", str(steps),
            "--trainer.batch_size", "8", "--data.train_size", "32", "--data.num_workers", "0",
            "--trainer.log_every_n_steps", "1", "--aids.diagnostics_images", "2", *extra]
    for k, v in TINY.items():
        args += [f"--model_args.{k}", str(v)]
    return training.train(args)


def test_value_projection_frozen_in_stage_one_then_trained(tmp_path, monkeypatch):
    """freeze 50% of 4 steps: value params bit-identical after steps 1-2 (AdamW decay included), moved after."""
    seen = []
    original = RetrievalModule.on_train_batch_start

    def spy(self, batch, batch_idx):
        seen.append((self.global_step, [p.detach().clone() for p in self.groups["value"]],
                     [p.detach().clone() for p in self.groups["qk"]]))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(RetrievalModule, "on_train_batch_start", spy)
    _train(tmp_path, steps=4, extra=["--aids.freeze_value_fraction", "0.5", "--optim.weight_decay", "0.5",
                                     "--data.val_size", "0"])
    steps = [s for s, _, _ in seen]
    assert steps == [0, 1, 2, 3]
    v0, v2, v3 = seen[0][1], seen[2][1], seen[3][1]
    assert all(torch.equal(a, b) for a, b in zip(v0, v2))  # stage 1: untouched
    assert any(not torch.equal(a, b) for a, b in zip(v2, v3))  # stage 2: trained
    assert any(not torch.equal(a, b) for a, b in zip(seen[0][2], seen[1][2]))  # Q/K train from step 0


def test_orthogonality_regulariser_step_reduces_the_penalty():
    torch.manual_seed(0)
    for shape in [(16, 32), (32, 16), (8, 4, 1, 1)]:
        w = torch.nn.Parameter(torch.randn(shape) * 0.5)
        before = orthogonality_penalty(w)
        before.backward()
        with torch.no_grad():
            w -= 0.01 * w.grad
        assert orthogonality_penalty(w) < before
    q = torch.linalg.qr(torch.randn(32, 16)).Q
    assert float(orthogonality_penalty(q)) < 1e-10 and float(orthogonality_penalty(q.T)) < 1e-10


def test_orthogonality_loss_is_logged_and_clipping_norms_too(tmp_path, monkeypatch):
    """In a real run: right after Lightning's clipping hook every group's grad norm is within its limit."""
    after = []
    original = RetrievalModule.configure_gradient_clipping

    def spy(self, optimizer, *args, **kwargs):
        original(self, optimizer, *args, **kwargs)
        after.append({g: float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ps if p.grad is not None])))
                      for g, ps in self.groups.items()})

    monkeypatch.setattr(RetrievalModule, "configure_gradient_clipping", spy)
    run = _train(tmp_path, steps=2, extra=["--aids.ortho_weight", "0.01", "--aids.clip_qk", "0.5",
                                           "--aids.diagnostics_every_n_steps", "1", "--data.val_size", "0"]).parent
    header = (run / "metrics.csv").read_text().splitlines()[0]
    for col in ("train/ortho", "grad_norm/qk", "grad_norm/value", "grad_norm/rest", "diag/entropy_mean",
                "diag/erank_query", "diag/logit_max", "diag/head_redundancy_max"):
        assert col in header, col
    assert len(after) == 2
    col = header.split(",").index("diag/entropy_mean")
    logged = [r.split(",") for r in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert sum(1 for r in logged if r[col]) >= 3  # after steps 1 and 2, and at the end
    assert all(n["qk"] <= 0.5 + 1e-5 and n["value"] <= 1.0 + 1e-5 and n["rest"] <= 1.0 + 1e-5 for n in after)


def test_eval_json_carries_diagnostics(tmp_path):
    import json

    import eval as eval_app

    model = _train(tmp_path, steps=1, extra=["--data.val_size", "0", "--aids.diagnostics_every_n_steps", "0"])
    out = tmp_path / "r.json"
    eval_app.main(["--ckpt", str(model), "--limit", "4", "--out", str(out)])
    diag = json.loads(out.read_text())["diagnostics"]
    assert diag["images"] == 4 and {"entropy", "spectrum", "head_redundancy", "logits", "warnings"} <= set(diag)
    assert len(diag["entropy"]["per_head"]) == TINY["num_heads"]


def test_eval_json_notes_skipped_diagnostics_for_global_only(tmp_path):
    import eval as eval_app

    args = ["--config", "configs/synthetic_clip.yaml", "--out_dir", str(tmp_path), "--trainer.max_steps", "1",
            "--trainer.batch_size", "8", "--data.train_size", "16", "--data.num_workers", "0", "--data.val_size", "0"]
    args += [x for k, v in TINY.items() for x in (f"--model_args.{k}", str(v))]
    result = eval_app.main(["--ckpt", str(training.train(args)), "--limit", "3"])
    assert "global-only" in result["diagnostics"]["skipped"]
