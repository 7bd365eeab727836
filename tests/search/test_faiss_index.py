"""FAISS indexes over global vectors: exact flat search, index type by size or by choice."""

import numpy as np
import pytest
import torch

from mmgeo.search.faiss_index import build_faiss, build_flat_index, choose_index_type, search


def test_flat_index_matches_brute_force():
    torch.manual_seed(0)
    gallery = torch.nn.functional.normalize(torch.randn(50, 8), dim=-1)
    queries = torch.nn.functional.normalize(torch.randn(7, 8), dim=-1)
    scores, ids = search(build_flat_index(gallery), queries, 5)
    ref = (queries @ gallery.T).topk(5)
    torch.testing.assert_close(scores, ref.values)  # FAISS's BLAS and torch round differently: ids up to ties
    picked = torch.gather(queries @ gallery.T, 1, ids)  # (7, 5) true scores of the returned ids
    torch.testing.assert_close(picked, ref.values, rtol=0, atol=1e-5)
    torch.testing.assert_close(scores, ref.values)
    assert search(build_flat_index(gallery), queries, 500)[1].shape == (7, 50)


def test_index_type_by_size_and_by_choice():
    assert [choose_index_type(n) for n in (10, 9_999, 10_000, 999_999, 1_000_000)] == \
        ["flat", "flat", "hnsw", "hnsw", "ivfpq"]
    x = np.random.default_rng(0).standard_normal((2_000, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for kind, min_hit in (("flat", 1.0), ("hnsw", 0.9), ("ivfpq", 0.3)):
        index = build_faiss(x, kind)
        _, ids = index.search(x[:50], 1)
        assert (ids[:, 0] == np.arange(50)).mean() >= min_hit, kind
    with pytest.raises(ValueError, match="index_type must be one of"):
        choose_index_type(5, "annoy")


def test_one_vector_must_be_a_row():
    with pytest.raises(ValueError, match=r"must be \(N, d\).*reshape one vector to \(1, d\)"):
        build_faiss(np.ones(8, np.float32), "flat")
