import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgeo.metrics import image_to_text_ranks, retrieval_metrics, text_to_image_ranks


def brute_force(scores, owner):
    """Ranks by sorting, ties broken against the true item (it is placed after equal scores)."""
    scores, owner = np.asarray(scores), np.asarray(owner)
    n_t, n_i = scores.shape
    t2i = []
    for c in range(n_t):
        order = sorted(range(n_i), key=lambda j: (-scores[c, j], j == owner[c]))
        t2i.append(order.index(owner[c]) + 1)
    i2t = []
    for i in range(n_i):
        order = sorted(range(n_t), key=lambda c: (-scores[c, i], owner[c] == i))
        i2t.append(next(r for r, c in enumerate(order) if owner[c] == i) + 1)
    return np.array(t2i), np.array(i2t)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(0, 10_000), st.booleans())
def test_ranks_match_brute_force(n_images, caps, seed, coarse):
    rng = np.random.default_rng(seed)
    owner = np.repeat(np.arange(n_images), caps)  # several captions per image
    scores = rng.integers(0, 3, size=(len(owner), n_images)) if coarse else rng.normal(size=(len(owner), n_images))
    t2i, i2t = brute_force(scores, owner)  # coarse integer scores make many ties
    s, o = torch.tensor(scores, dtype=torch.float32), torch.tensor(owner)
    assert text_to_image_ranks(s, o).tolist() == t2i.tolist()
    assert image_to_text_ranks(s, o).tolist() == i2t.tolist()
    m = retrieval_metrics(s, o)
    for k in (1, 5, 10):
        assert m[f"text_to_image_R@{k}"] == pytest.approx((t2i <= k).mean())
        assert m[f"image_to_text_R@{k}"] == pytest.approx((i2t <= k).mean())
    assert m["text_to_image_median_rank"] == pytest.approx(np.median(t2i))
    assert m["image_to_text_mean_rank"] == pytest.approx(i2t.mean())


def test_ties_count_against_the_model():
    scores = torch.zeros(6, 3)  # a constant scorer
    owner = torch.tensor([0, 0, 1, 1, 2, 2])
    m = retrieval_metrics(scores, owner)
    assert m["text_to_image_R@1"] == 0.0 and m["text_to_image_mean_rank"] == 3.0
    assert m["image_to_text_R@1"] == 0.0 and m["image_to_text_mean_rank"] == 5.0


def test_perfect_scorer_and_any_caption_hits():
    owner = torch.tensor([0, 0, 1, 1])
    scores = torch.tensor([[1.0, 0.0], [0.0, 0.5], [0.0, 1.0], [0.2, 0.9]])  # caption 1 ranks wrongly
    m = retrieval_metrics(scores, owner)
    assert m["image_to_text_R@1"] == 1.0  # each image's best caption is its own
    assert m["text_to_image_R@1"] == 0.75


def test_shape_errors():
    with pytest.raises(ValueError, match="text_to_image"):
        retrieval_metrics(torch.zeros(4, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one caption"):
        image_to_text_ranks(torch.zeros(2, 3), torch.tensor([0, 1]))
