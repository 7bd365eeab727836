"""experiments/coverage_weight.py: object-phrase queries by caption text, and the four variants it scores."""

import json

import numpy as np


def test_phrase_queries_find_every_image_whose_captions_hold_the_phrase():
    from experiments.coverage_weight import phrase_queries

    captions = [["A dog on the grass and a man with a hat"], ["a man with a hat near the river"],
                ["a dog on the grass"], ["two dogs play , and a child watches them"]]
    texts, positives = phrase_queries(captions, np.random.default_rng(0))
    # captions naming two or more phrases give one query each: the first, the second and the last
    expected = {"A dog on the grass": {0, 2}, "a man": {0, 1}, "a hat": {0}, "a hat near the river": {1},
                "two dogs play": {3}, "a child": {3}}  # case aside, "a hat" is not "a hat near the river"
    assert len(texts) == 3 and all(expected[t] == p for t, p in zip(texts, positives))
    assert texts[0] in ("A dog on the grass", "a man", "a hat") and texts[2] in ("two dogs play", "a child")


def test_variants_are_scored_and_the_learned_weight_is_positive(tmp_path, tiny_model):
    from experiments import coverage_weight
    from mmgeo.models.checkpoint import save_model

    ckpt = save_model(tiny_model, tmp_path / "m.pt")
    out = tmp_path / "rows.json"
    assert coverage_weight.main(["--ckpt", str(ckpt), "--images", "16", "--steps", "5", "--test-images", "24",
                                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["no coverage", "fit, β set", "fit with phrases, β learned",
                                            "the same salience, β set"]
    assert rows[0]["beta"] == 0 and rows[1]["beta"] == rows[3]["beta"] == 0.05 and rows[2]["beta"] > 0
    assert rows[2]["beta"] != 0.05  # five Adam steps moved it
    for r in rows:
        assert all(0 <= r[k] <= 1 for k in ("full_caption_R@1", "one_object", "two_object", "typed"))
