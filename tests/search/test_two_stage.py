"""Two-stage search (FAISS top-K' on global, geometric re-rank) equals exact geometric scoring on its candidates
(``rank_captions``, evaluation's use of it: tests/eval/test_two_stage.py)."""

import numpy as np
import pytest
import torch

import mmgeo
from mmgeo.models import Embedding
from mmgeo.search.two_stage import max_over_patches, rerank_scores, search_text
from tests.conftest import TINY

TIE = 1e-5  # scores this close may swap between code paths (BLAS rounding differs by CPU): ids compared up to ties


def assert_topk_up_to_ties(ids, scores_row, k: int) -> None:
    """``ids`` are a top-``k`` of ``scores_row``: distinct, and position p holds an item whose score is the p-th best
    up to ``TIE`` (so near-tied items may come in either order)."""
    assert len(ids) == k and len(set(ids.tolist())) == k
    np.testing.assert_allclose(scores_row[ids], np.sort(scores_row)[::-1][:k], rtol=0, atol=TIE)


@pytest.mark.parametrize("patches", [1, 2, 7, 16, 36, 49])
def test_max_over_patches_is_amax(patches):
    """The halving max equals torch's amax over the patch dimension, odd counts and masked (-inf) patches too."""
    x = torch.randn(2, 5, patches, 3)
    x[:, 1, : patches // 2] = float("-inf")
    torch.testing.assert_close(max_over_patches(x), x.amax(2, keepdim=True), rtol=0, atol=0)


def test_rerank_over_all_images_is_exact_search(ranked):
    model, g, texts, exact = ranked
    for i in range(len(texts)):
        ids, scores = search_text(model, g, texts[i:i + 1], k=10, rerank=True, k_prime=len(g))
        assert_topk_up_to_ties(ids, exact[i], 10)
        np.testing.assert_allclose(scores, exact[i][ids], rtol=1e-5, atol=1e-6)


def test_rerank_orders_candidates_by_exact_score(ranked):
    model, g, texts, exact = ranked
    k_prime, hits = 8, 0
    for i in range(len(texts)):
        _, cand = g.index.search(texts.pooled[i:i + 1].numpy(), k_prime)  # first stage
        cand = cand[0]
        ids, scores = search_text(model, g, texts[i:i + 1], k=k_prime, rerank=True, k_prime=k_prime)
        assert set(ids) == set(cand)
        np.testing.assert_allclose(scores, exact[i][ids], rtol=1e-5, atol=1e-6)
        if i in cand:  # the true image is a candidate: it lands where exact scoring of the candidates puts it
            hits += 1
            above = exact[i][cand] - exact[i][i]  # candidates' exact scores relative to the true image's
            rank = int(np.flatnonzero(ids == i)[0])
            assert int((above > TIE).sum()) <= rank <= int((above > -TIE).sum()) - 1  # its exact rank, up to ties
    assert hits > 0, "no query had its true image among the candidates: the test checked nothing"


def test_rerank_off_is_the_global_order(ranked):
    model, g, texts, _ = ranked
    glob = (texts.pooled @ torch.from_numpy(g.index.reconstruct_n(0, len(g))).T).numpy()  # (N_t, N_i)
    for i in range(5):
        ids, scores = search_text(model, g, texts[i:i + 1], k=5, rerank=False)
        assert_topk_up_to_ties(ids, glob[i], 5)


@pytest.mark.parametrize("coverage_weight", [0.0, 0.3])
def test_rerank_scores_are_the_models_geometric_scores(coverage_weight):
    """The serving re-rank (head-major GEMMs over all candidates) gives model.score's numbers, padding included,
    with the coverage term when the model has one."""
    torch.manual_seed(0)
    tiny_model = mmgeo.create_model("geo-tiny", **TINY, coverage_weight=coverage_weight).eval()
    if coverage_weight:  # a salience that differs between patches, not the zero init's 0.5 everywhere
        torch.nn.init.normal_(tiny_model.salience.proj.weight, std=0.5)
    g = torch.Generator().manual_seed(0)
    text = tiny_model.encode_text(["a red circle", "a small blue square on the left of a big green triangle"])
    K, H, S = 7, tiny_model.cfg.num_heads, 16
    keys = torch.randn(K, H, S, tiny_model.cfg.d_a, generator=g)
    values = torch.nn.functional.normalize(torch.randn(K, H, S, tiny_model.cfg.d_e, generator=g), dim=-1)
    mask = torch.ones(K, S, dtype=torch.bool)
    mask[2, 10:] = False  # an image with padding patches
    want = tiny_model.score(text, Embedding(torch.zeros(K, 1), keys, values, mask))  # (2, K)
    for i in range(2):  # caption 0 is padded in the batch, caption 1 is not
        got = rerank_scores(text.attn[i], text.mask[i], text.value[i], keys.transpose(0, 1).contiguous(),
                            values.transpose(0, 1).contiguous(), mask, tiny_model.coverage_term)
        torch.testing.assert_close(got, want[i], rtol=1e-5, atol=1e-6)
