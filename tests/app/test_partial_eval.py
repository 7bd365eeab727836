"""eval.py --suite partial | all end to end on a random geo-tiny: exact, two-stage and over a built index."""

import json

import pytest

import eval as eval_app
import mmgeo

RANKINGS = {"exact_geometric", "exact_global"}


def test_partial_suite_exact_and_two_stage(random_geo_tiny, tmp_path, capsys):
    out = tmp_path / "r.json"
    eval_app.main(["--ckpt", str(random_geo_tiny), "--suite", "partial", "--limit", "40", "--partial-queries", "6",
                   "--mode", "two-stage", "--k-prime", "10", "--out", str(out)])
    record = json.loads(out.read_text())["partial_queries"]
    assert record["queries"] == 6 and record["images"] == 40 and record["k_prime"] == 10
    for kind in ("one_object", "two_object", "object", "relation", "count", "full_caption"):
        assert RANKINGS | {"served"} <= set(record[kind])
        assert {"P@1", "P@5", "nDCG@10", "mAP", "own@1", "attribute_wrong"} <= set(record[kind]["served"])
    printed = capsys.readouterr().out
    assert "partial queries: 6 naming one object" in printed and "6 of the split's full captions" in printed
    assert "6 typed objects, 6 typed relations, 6 typed counts" in printed
    assert "two_object" in printed and "full_caption" in printed


def test_partial_suite_over_a_built_index(random_geo_tiny, tmp_path):
    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.search.build import build_gallery_from_embedding

    model = mmgeo.load_model(random_geo_tiny)
    world = ShapesWorld("test", image_size=model.cfg.image_size, size=30)
    build_gallery_from_embedding(model, model.encode_image([world[i][0] for i in range(30)]), tmp_path / "index",
                                 ckpt=random_geo_tiny)
    result = eval_app.main(["--index", str(tmp_path / "index"), "--suite", "partial", "--partial-queries", "4"])
    assert result["mode"] == "two-stage" and "served" in result["partial_queries"]["one_object"]


def test_partial_suite_refuses_a_count_under_one(random_geo_tiny):
    with pytest.raises(SystemExit):
        eval_app.main(["--ckpt", str(random_geo_tiny), "--suite", "partial", "--partial-queries", "0"])
