import torch

from mmgeo.data import ShapesWorld
from mmgeo.index import build_flat_index, search
from mmgeo.metrics import retrieval_metrics
from mmgeo.retrieval import encode_split, exact_scores, two_stage_scores


def test_flat_index_matches_brute_force():
    torch.manual_seed(0)
    gallery = torch.nn.functional.normalize(torch.randn(50, 8), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(7, 8), dim=-1)
    scores, ids = search(build_flat_index(gallery), queries, 5)
    ref = (queries @ gallery.T).topk(5)
    assert torch.equal(ids, ref.indices)
    torch.testing.assert_close(scores, ref.values)
    assert search(build_flat_index(gallery), queries, 500)[1].shape == (7, 50)


def test_encode_split_follows_the_protocol(tiny_model):
    split = encode_split(tiny_model, ShapesWorld("test", image_size=32, size=7), batch_size=3, progress=False)
    assert len(split.images) == 7 and len(split.texts) == 35
    assert split.text_to_image.tolist() == [i for i in range(7) for _ in range(5)]


def test_two_stage_equals_exact_when_every_item_is_a_candidate(tiny_model):
    split = encode_split(tiny_model, ShapesWorld("test", image_size=32, size=12), progress=False)
    exact = exact_scores(tiny_model, split.texts, split.images, "geometric", progress=False)
    t2i, i2t, first = two_stage_scores(tiny_model, split, k_prime=60, progress=False)
    assert retrieval_metrics(t2i, split.text_to_image, i2t) == retrieval_metrics(exact, split.text_to_image)
    assert first["text_to_image_first_stage_recall"] == 1.0


def test_two_stage_reranks_candidates_only(tiny_model):
    split = encode_split(tiny_model, ShapesWorld("test", image_size=32, size=12), progress=False)
    exact = exact_scores(tiny_model, split.texts, split.images, "geometric", progress=False)
    glob = exact_scores(tiny_model, split.texts, split.images, "global", progress=False)
    t2i, _, _ = two_stage_scores(tiny_model, split, k_prime=3, progress=False)
    for row in range(len(split.texts)):
        cand = glob[row].topk(3).indices
        others = torch.ones(12, dtype=torch.bool)
        others[cand] = False
        torch.testing.assert_close(t2i[row, cand] - 4.0, exact[row, cand], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(t2i[row, others], glob[row, others], atol=1e-5, rtol=1e-5)

