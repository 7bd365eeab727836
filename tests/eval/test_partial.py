"""Partial-query metrics (P@k, nDCG, AP, first-hit errors) and the evaluation over a tiny model and gallery."""

import math

import numpy as np
import pytest
import torch

from mmgeo.eval.partial import average_precision, exact_rankings, format_table, ndcg, ranking_metrics


def test_average_precision_and_ndcg_by_hand():
    ranked, relevant = np.array([3, 1, 4, 0, 2]), np.array([1, 0, 9])
    assert average_precision(ranked, relevant) == pytest.approx((1 / 2 + 2 / 4) / 3)  # 9 never retrieved
    assert average_precision(ranked, np.array([7])) == 0.0
    gains = 1 / math.log2(3) + 1 / math.log2(5)
    assert ndcg(ranked, relevant) == pytest.approx(gains / (1 + 1 / math.log2(3) + 1 / math.log2(4)))
    assert ndcg(np.array([1, 0, 9]), relevant) == pytest.approx(1.0)


def test_ranking_metrics_and_ties_broken_by_id():
    scores = torch.tensor([[0.1, 0.9, 0.9, 0.0], [0.5, 0.2, 0.1, 0.0]])
    rankings = exact_rankings(scores)
    assert [r.tolist() for r in rankings] == [[1, 2, 0, 3], [0, 1, 2, 3]]
    m = ranking_metrics(rankings, [np.array([2]), np.array([0, 3])])
    assert m["P@1"] == 0.5 and m["P@5"] == pytest.approx((1 / 5 + 2 / 5) / 2)
    assert m["mAP"] == pytest.approx((1 / 2 + (1 + 2 / 4) / 2) / 2)
    with pytest.raises(ValueError, match="at least one relevant"):
        ranking_metrics(rankings, [np.array([2]), np.array([], dtype=np.int64)])


def test_evaluation_exact_and_served_on_a_tiny_model(tmp_path):
    """End to end on an untrained tiny model: every ranking scored, served through a built gallery."""
    from mmgeo.data.shapes import ShapesWorld
    from mmgeo.eval.partial import evaluate_partial_queries
    from mmgeo.models import create_model
    from mmgeo.search.build import build_gallery_from_embedding
    from mmgeo.search.store import Gallery

    torch.manual_seed(0)
    model = create_model("geo-tiny", d_a=16, extra={"dataset": "synthetic"}).eval()
    world = ShapesWorld("test", image_size=model.cfg.image_size, size=60)
    images = model.encode_image([world[i][0] for i in range(len(world))])
    build_gallery_from_embedding(model, images, tmp_path / "index")
    record = evaluate_partial_queries(model, world, images, n=12, gallery=Gallery(tmp_path / "index"), k_prime=20)
    for kind in ("one_object", "two_object", "object", "relation", "count", "full_caption"):
        for ranking in ("exact_geometric", "exact_global", "served"):
            r = record[kind][ranking]
            assert 0 <= r["P@1"] <= 1 and 0 <= r["mAP"] <= 1
            assert r["wrong_first_hits"] == round(12 * (1 - r["P@1"]))
            assert r["own@1"] <= r["P@1"]  # a query's own image is always one it is true of
        # a served first hit that is relevant came through the first stage (a flat index: the exact global top K';
        # FAISS and torch may order one near-tie at the K' boundary differently)
        assert record[kind]["served"]["P@1"] <= record[kind]["served"]["relevant_in_first_stage"] + 1.01 / 12
        assert record[kind]["relevant_per_query"]["min"] >= 1
    table = format_table(record)
    assert all(kind in table for kind in ("one_object", "relation", "count", "full_caption"))
    assert "served" in table and "own@1" in table and "relation / count" in table
    assert "ties at random" in table and "the first stage" in table


def test_in_first_stage_counts_queries_with_a_relevant_image_in_the_top_k_prime():
    from mmgeo.eval.partial import in_first_stage

    rankings = [np.array([3, 1, 0, 2]), np.array([0, 1, 2, 3]), np.array([2, 3, 1, 0])]
    relevant = [np.array([1]), np.array([3]), np.array([0, 3])]
    assert in_first_stage(rankings, relevant, k_prime=2) == pytest.approx(2 / 3)  # the second's only image is 4th
    assert in_first_stage(rankings, relevant, k_prime=1) == 0.0
    assert in_first_stage(rankings, relevant, k_prime=4) == 1.0


def test_first_hit_confusions_count_what_was_asked_and_what_came_back():
    """Hand-made scenes: a first hit holding a red square where a red circle was asked is a shape confusion
    'circle -> square', alone; a right first hit counts nothing."""
    import numpy as np

    from mmgeo.data.shapes import ShapeObject
    from mmgeo.data.shapes_grammar import Mention
    from mmgeo.data.shapes_queries import PartialQuery
    from mmgeo.eval.partial import first_hit_errors

    circle = Mention("large", "red", "circle", "in the top left")
    query = PartialQuery("a large red circle in the top left", 0, (circle,))
    scenes = [[ShapeObject("circle", "red", "large", (0, 0))],  # 0: right
              [ShapeObject("square", "red", "large", (0, 0))],  # 1: the shape wrong
              [ShapeObject("square", "blue", "large", (0, 0))]]  # 2: shape and colour wrong
    rankings = [np.array([1, 0, 2]), np.array([2, 0, 1]), np.array([0, 1, 2])]
    out = first_hit_errors([query] * 3, rankings, [np.array([0])] * 3, scenes)
    assert out["wrong_first_hits"] == 2
    assert out["attribute_wrong"]["shape"] == 1.0 and out["attribute_wrong"]["color"] == 0.5
    assert out["attribute_wrong_alone"] == {"size": 0.0, "color": 0.0, "shape": 0.5, "cell": 0.0, "relation": 0.0,
                                            "count": 0.0}
    assert out["confusions"]["shape"] == {"circle -> square": 2} and out["confusions"]["color"] == {"red -> blue": 1}


def test_own_at_1_counts_the_image_a_query_was_drawn_from():
    """A full caption true of its own image and of another: a first hit on the other is right for P@1, not own@1."""
    from mmgeo.data.shapes import ShapeObject
    from mmgeo.data.shapes_queries import caption_queries, true_images
    from mmgeo.eval.partial import score_rankings

    circle, square = ShapeObject("circle", "red", "large", (0, 0)), ShapeObject("square", "blue", "small", (1, 1))
    scenes = [[circle], [circle, square], [square]]

    class World:
        def captions(self, i):
            return ["a big red circle in the top left"] if i == 0 else ["a small blue square in the middle"]

        def __len__(self):
            return 1  # draws image 0 only

    queries = caption_queries(World(), 2)
    relevant = [true_images(q.text, scenes) for q in queries]
    assert [r.tolist() for r in relevant] == [[0, 1], [0, 1]]
    r = score_rankings(queries, [np.array([1, 0, 2]), np.array([0, 1, 2])], relevant, scenes)
    assert r["P@1"] == 1.0 and r["own@1"] == 0.5 and r["wrong_first_hits"] == 0
    from mmgeo.eval.partial import relevant_counts

    counts = relevant_counts([np.array([0, 1]), np.array([3]), np.array([2, 4, 5, 6])])
    assert counts == pytest.approx({"mean": 7 / 3, "min": 1, "more_than_one": 2 / 3,
                                    "tied_own@1": (1 / 2 + 1 + 1 / 4) / 3})
