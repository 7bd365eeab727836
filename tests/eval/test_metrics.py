import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmgeo.eval.metrics import NonFiniteScores, image_to_text_ranks, retrieval_metrics, text_to_image_ranks


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


def _owner_and_finite(n_images=4, caps=2, seed=0):
    owner = torch.arange(n_images).repeat_interleave(caps)
    return owner, torch.randn(len(owner), n_images, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fn", [text_to_image_ranks, image_to_text_ranks, retrieval_metrics])
def test_all_nan_scores_are_refused_not_perfect(fn):
    """NaN compares false with everything: unchecked, the true item would rank first (R@1 = 1)."""
    owner, _ = _owner_and_finite()
    with pytest.raises(NonFiniteScores, match=r"^32 of 32 scores are not finite \(NaN 32\): captions "
                                              r"\[0, 1, 2, 3, 4 …\], images \[0, 1, 2, 3\]; the model produced"):
        fn(torch.full((8, 4), float("nan")), owner)


@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (float("inf"), "+inf"), (float("-inf"), "-inf")])
def test_some_non_finite_scores_are_counted_and_located(value, kind):
    owner, scores = _owner_and_finite()
    scores[3, 1] = scores[6, 2] = scores[6, 3] = value
    for fn in (text_to_image_ranks, image_to_text_ranks, retrieval_metrics):
        with pytest.raises(ValueError, match=rf"^3 of 32 scores are not finite \({re.escape(kind)} 3\): "
                                             r"captions \[3, 6\], images \[1, 2, 3\];.*lower lr"):
            fn(scores, owner)


def test_mixed_non_finite_kinds_are_each_counted():
    owner, scores = _owner_and_finite()
    scores[0, 0], scores[1, 0], scores[2, 1], scores[7, 3] = float("nan"), float("inf"), float("inf"), float("-inf")
    with pytest.raises(NonFiniteScores, match=r"4 of 32 scores are not finite \(NaN 1, \+inf 2, -inf 1\): "
                                              r"captions \[0, 1, 2, 7\], images \[0, 1, 3\]"):
        retrieval_metrics(scores, owner)


def test_non_finite_image_to_text_scores_are_refused_too():
    owner, scores = _owner_and_finite()
    i2t = scores.clone()
    i2t[5, 0] = float("nan")
    with pytest.raises(NonFiniteScores, match="1 of 32"):
        retrieval_metrics(scores, owner, scores_i2t=i2t)


def test_finite_ties_still_count_against_the_model():
    owner = torch.tensor([0, 0, 1, 1])
    scores = torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.5, 0.5], [0.0, 3.0]])  # captions 0 and 2 tie
    assert text_to_image_ranks(scores, owner).tolist() == [2, 1, 2, 1]
    m = retrieval_metrics(scores, owner)
    assert m["text_to_image_R@1"] == 0.5
