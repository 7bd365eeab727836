"""Two-stage search (FAISS top-K' on global, geometric re-rank) equals exact geometric scoring on its candidates."""

import numpy as np
import pytest
import torch

from mmgeo.data import ShapesWorld
from mmgeo.gallery import Gallery, search_text
from mmgeo.models import Embedding


@pytest.fixture(scope="module")
def setup(serve_env):
    g = Gallery(serve_env.idx)
    captions = [ShapesWorld("test", 0, image_size=32)[i][1][0] for i in range(len(g))]
    texts = serve_env.model.encode_text(captions)
    gallery_emb = Embedding(torch.zeros(len(g), 1), torch.from_numpy(np.array(g.keys, np.float32)),
                            torch.from_numpy(np.array(g.values, np.float32)), torch.from_numpy(np.array(g.mask)))
    exact = serve_env.model.score(texts, gallery_emb).numpy()  # (N_text, N_image) geometric, every pair
    return serve_env.model, g, texts, exact


def test_rerank_over_all_images_is_exact_search(setup):
    model, g, texts, exact = setup
    for i in range(len(texts)):
        ids, scores = search_text(model, g, texts[i:i + 1], k=10, rerank=True, k_prime=len(g))
        np.testing.assert_array_equal(ids, np.argsort(-exact[i], kind="stable")[:10])
        np.testing.assert_allclose(scores, exact[i][ids], rtol=1e-5, atol=1e-6)


def test_rerank_orders_candidates_by_exact_score(setup):
    model, g, texts, exact = setup
    k_prime, hits = 8, 0
    for i in range(len(texts)):
        _, cand = g.index.search(texts.pooled[i:i + 1].numpy(), k_prime)  # first stage
        cand = cand[0]
        ids, scores = search_text(model, g, texts[i:i + 1], k=k_prime, rerank=True, k_prime=k_prime)
        assert set(ids) == set(cand)
        np.testing.assert_allclose(scores, exact[i][ids], rtol=1e-5, atol=1e-6)
        if i in cand:  # the true image is a candidate: it lands where exact scoring of the candidates puts it
            hits += 1
            exact_rank = int((exact[i][cand] > exact[i][i]).sum())
            assert int(np.flatnonzero(ids == i)[0]) == exact_rank
    assert hits > 0, "no query had its true image among the candidates: the test checked nothing"


def test_rerank_off_is_the_global_order(setup):
    model, g, texts, _ = setup
    glob = (texts.pooled @ torch.from_numpy(g.index.reconstruct_n(0, len(g))).T).numpy()  # (N_t, N_i)
    for i in range(5):
        ids, scores = search_text(model, g, texts[i:i + 1], k=5, rerank=False)
        np.testing.assert_array_equal(ids, np.argsort(-glob[i], kind="stable")[:5])
