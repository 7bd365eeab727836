"""experiments/full_caption_misses.py: R@1's misses per caption template, and the ties the scene graph allows."""

import json


def test_misses_add_up_and_ties_are_scene_graph_truths(tmp_path, tiny_model):
    from experiments import full_caption_misses
    from mmgeo.models.checkpoint import save_model

    ckpt = save_model(tiny_model, tmp_path / "m.pt")
    out = tmp_path / "misses.json"
    assert full_caption_misses.main(["--ckpt", str(ckpt), "--images", "12", "--true-of-another",
                                      "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    per = row["per_template"].values()
    assert row["images"] == 12 and row["captions"] == sum(r.get("captions", 0) for r in per) == 60
    assert row["misses"] == sum(r.get("misses", 0) for r in per) > 0  # an untrained model misses most
    assert 0 <= row["misses_to_a_true_image"] <= row["misses"]
    assert 0 <= row["misses_to_a_denser_holder"] <= row["misses"]
    assert abs(row["R@1"] - (1 - row["misses"] / 60)) < 1e-9
    assert row["R@1_without_true_ties"] >= row["R@1"]
    truth = json.loads(out.read_text())["true_of_another"]
    from mmgeo.data.shapes_grammar import TEMPLATES

    assert set(truth) == set(TEMPLATES) and 0 <= sum(truth.values()) <= 60


def test_a_first_hit_is_a_tie_only_when_the_caption_is_true_of_it(monkeypatch, tiny_model):
    """Scores that put each caption's own image first miss nothing; scores that put one fixed image first miss every
    other image's captions, and count as ties exactly those the scene graph says are true of that image."""
    import torch

    import mmgeo.eval.retrieval as retrieval
    from experiments.full_caption_misses import _misses
    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.data.shapes_grammar import parse
    from mmgeo.data.shapes_queries import satisfies

    world = ShapesWorld("test", image_size=32)
    n, owners = 6, [i for i in range(6) for _ in world.captions(i)]
    monkeypatch.setattr(retrieval, "exact_scores", lambda *a, **k: torch.eye(n)[owners])
    own = _misses(tiny_model, world, n)
    assert own["misses"] == 0 and own["R@1"] == 1.0
    monkeypatch.setattr(retrieval, "exact_scores", lambda *a, **k: torch.eye(n)[[0] * len(owners)])
    fixed = _misses(tiny_model, world, n)
    others = [c for i in range(1, n) for c in world.captions(i)]
    assert fixed["misses"] == len(others)
    assert fixed["misses_to_a_true_image"] == sum(satisfies(parse(c), world.scene(0)) for c in others)
