"""One geometric score and one attention-weights function behind every path (docs/design.md §4, §7).

``candidate_scores`` (the score's per-token sums) and ``attention_logits`` (under ``attention_weights``) are
patched once, wherever a module of the product has bound them, by a recording wrapper that negates their output.
Training loss, exact eval, two-stage eval (``eval.py``), the service's re-rank and ``/explain`` must each call it
and change with it; a path with its own copy of the math would do neither.
"""

import importlib
import sys

import pytest
import torch
from fastapi.testclient import TestClient

import eval as eval_app
import mmgeo.training as training
from mmgeo.data import build_dataset
from mmgeo.eval.retrieval import encode_split, exact_scores
from mmgeo.eval.two_stage import evaluate_split
from tests.conftest import TINY
from tests.search.conftest import make_gallery_env, single_thread_faiss  # noqa: F401 (autouse fixture)

ROOTS = {"mmgeo", "serve", "eval", "train"}  # the product's modules: the library, the service, the entry points
PRODUCT_MODULES = ["mmgeo.training.module", "mmgeo.training.losses", "mmgeo.eval.retrieval", "mmgeo.search.two_stage",
                   "mmgeo.eval.two_stage", "mmgeo.eval.viz", "mmgeo.eval.diagnostics", "serve.app", "serve.explain",
                   "eval"]


class Negated:
    """Calls the original and returns minus its output; counts calls."""

    def __init__(self, original):
        self.original, self.calls = original, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return -self.original(*args, **kwargs)


def patch_everywhere(monkeypatch, name: str) -> Negated:
    """Replace the function ``mmgeo.kernels.pair_score.<name>`` in every product module that holds it."""
    for module in PRODUCT_MODULES:
        importlib.import_module(module)
    original = getattr(importlib.import_module("mmgeo.kernels.pair_score"), name)  # the module, not the function
    wrapper, bound = Negated(original), 0
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.split(".")[0] not in ROOTS:
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                monkeypatch.setattr(mod, attr, wrapper)
                bound += 1
    assert bound >= 1
    return wrapper


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return make_gallery_env(tmp_path_factory)


def first_step_loss(tmp_path) -> float:
    """train.py's loss at its first optimiser step (tiny model, same seed every time)."""
    from lightning.pytorch import Callback

    losses = []

    class RecordLoss(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    args = ["--config", "configs/synthetic.yaml", "--out_dir", str(tmp_path), "--trainer.max_steps", "1",
            "--trainer.batch_size", "8", "--trainer.val_every_n_steps", "0", "--data.train_size", "16",
            "--data.val_size", "0", "--data.num_workers", "0", "--trainer.checkpoint_every_n_steps", "0",
            "--aids.diagnostics_every_n_steps", "0"]
    for k, v in TINY.items():
        args += [f"--model_args.{k}", str(v)]
    training.train(args, [RecordLoss()])
    return losses[0]


def observe_scores(env, k_prime: int = 24) -> dict:
    """What each evaluation and service path returns for the same model, split and gallery."""
    split = encode_split(env.model, build_dataset("synthetic", "test", image_size=env.model.cfg.image_size, size=24),
                         progress=False)
    out = {"exact": exact_scores(env.model, split.texts, split.images, "geometric", progress=False),
           "two_stage": evaluate_split(env.model, split, k_prime=k_prime, progress=False)[0]}
    with TestClient(importlib.import_module("serve.app").create_app(env.idx)) as client:
        r = client.post("/search", json={"text": "a big red circle in the center", "k": 5, "rerank": True})
        assert r.status_code == 200, r.text
        out["service"] = {row["id"]: row["score"] for row in r.json()["results"]}
        r = client.get("/explain", params={"id": 2, "text": "a red circle on the left"})
        assert r.status_code == 200, r.text
        out["explain"] = r.content
    return out


def test_every_path_scores_through_candidate_scores(env, tmp_path, monkeypatch):
    loss = first_step_loss(tmp_path / "plain")
    plain = observe_scores(env)

    wrapper = patch_everywhere(monkeypatch, "candidate_scores")
    calls = {}
    patched_loss = first_step_loss(tmp_path / "patched")
    calls["training"] = wrapper.calls
    patched = observe_scores(env)
    calls["evaluation and service"] = wrapper.calls - calls["training"]
    for mode in ("exact", "two-stage"):
        before = wrapper.calls
        eval_app.main(["--ckpt", str(env.ckpt), "--split", "test", "--limit", "6", "--mode", mode, "--k-prime", "3"])
        calls[f"eval.py --mode {mode}"] = wrapper.calls - before

    assert all(n > 0 for n in calls.values()), calls
    assert patched_loss != pytest.approx(loss, rel=1e-3)
    torch.testing.assert_close(patched["exact"], -plain["exact"])  # the whole score is the negated sums
    assert not torch.equal(patched["two_stage"], plain["two_stage"])  # the re-ranked candidates changed
    assert patched["service"] != plain["service"]
    assert patched["explain"] == plain["explain"]  # heatmaps use the attention weights, not the score


def test_explain_uses_the_attention_weights(env, monkeypatch):
    plain = observe_scores(env)
    wrapper = patch_everywhere(monkeypatch, "attention_logits")
    patched = observe_scores(env)
    assert wrapper.calls > 0
    assert patched["explain"] != plain["explain"]  # negated logits: each word looks elsewhere
    torch.testing.assert_close(patched["exact"], plain["exact"])  # the score has its own fused path
