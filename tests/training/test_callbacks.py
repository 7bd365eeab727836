"""Training callbacks outside a Trainer: the attention diagnostics' grace period, validation's refusal of
non-finite scores."""

import types
import warnings

import pytest
import torch

from mmgeo.data import ShapesWorld
from mmgeo.training.callbacks import AttentionDiagnostics, ValidationRecall
from mmgeo.training.module import NonFiniteTraining


def test_diagnostic_warnings_wait_for_the_grace_period(tiny_model):
    """At initialisation attention is near-uniform by construction: no warning before grace_steps."""
    cb = AttentionDiagnostics(ShapesWorld("val", image_size=32, size=4), every_n_steps=1, grace_steps=5)
    module = types.SimpleNamespace(model=tiny_model)
    with warnings.catch_warnings(record=True) as early:
        warnings.simplefilter("always")
        cb._run(types.SimpleNamespace(global_step=1, logger=None), module)
    assert not [x for x in early if "step 1" in str(x.message)]
    with warnings.catch_warnings(record=True) as late:
        warnings.simplefilter("always")
        cb._run(types.SimpleNamespace(global_step=5, logger=None), module)
    assert any("near-uniform" in str(x.message) for x in late)  # an untrained model attends uniformly


def test_validation_refuses_non_finite_scores(tiny_model, monkeypatch):
    """NaN scores stop training with the counts instead of logging a recall (unchecked, NaN scores R@1 = 1)."""
    original = type(tiny_model).score

    def nan_geometric(self, texts, images, mode=None):
        s = original(self, texts, images, mode)
        return torch.full_like(s, float("nan")) if mode == "geometric" else s

    monkeypatch.setattr(type(tiny_model), "score", nan_geometric)
    logged = []
    logger = types.SimpleNamespace(log_metrics=lambda m, step: logged.append(m), save=lambda: None)
    cb = ValidationRecall(ShapesWorld("val", image_size=32, size=3), every_n_steps=1)
    tiny_model.train()
    with pytest.raises(NonFiniteTraining, match=r"step 7: validation \(geometric score\) got non-finite scores, "
                                                r"no recall logged\. 45 of 45 scores are not finite \(NaN 45\)"):
        cb._run(types.SimpleNamespace(global_step=7, logger=logger, is_global_zero=True),
                types.SimpleNamespace(model=tiny_model))
    assert not logged and tiny_model.training  # nothing logged, train mode restored
