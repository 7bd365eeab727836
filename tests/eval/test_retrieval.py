"""Exact evaluation of a split (two-stage evaluation goes through mmgeo.search: tests/search/)."""

import torch

from mmgeo.data import ShapesWorld
from mmgeo.eval.metrics import text_to_image_ranks
from mmgeo.eval.retrieval import encode_split, exact_scores


def test_encode_split_follows_the_protocol(tiny_model):
    split = encode_split(tiny_model, ShapesWorld("test", image_size=32, size=7), batch_size=3, progress=False)
    assert len(split.images) == 7 and len(split.texts) == 35
    assert split.text_to_image.tolist() == [i for i in range(7) for _ in range(5)]


def test_exact_scores_are_model_scores_in_steps(tiny_model):
    split = encode_split(tiny_model, ShapesWorld("test", image_size=32, size=6), progress=False)
    for mode in ("geometric", "global"):
        got = exact_scores(tiny_model, split.texts, split.images, mode, rows_per_step=7, progress=False)
        assert got.shape == (30, 6)
        with torch.inference_mode():
            want = tiny_model.score(split.texts, split.images, mode).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    glob = exact_scores(tiny_model, split.texts, split.images, "global", progress=False)
    torch.testing.assert_close(glob, split.texts.pooled @ split.images.pooled.T, rtol=1e-5, atol=1e-6)
    ranks = text_to_image_ranks(glob, split.text_to_image)
    assert ranks.min() >= 1 and ranks.max() <= 6
