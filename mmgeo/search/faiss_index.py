"""FAISS indexes over global vectors, the first stage of two-stage search (docs/design.md): the one place
they are built and searched.

Inner product on L2-normalised vectors (= cosine). ``build_faiss`` picks the type by size unless told:
exact ``IndexFlatIP`` below ``FLAT_MAX`` vectors, HNSW below ``HNSW_MAX``, IVF-PQ above.
"""

from __future__ import annotations

import math

import numpy as np

INDEX_TYPES = ("auto", "flat", "hnsw", "ivfpq")
FLAT_MAX, HNSW_MAX = 10_000, 1_000_000  # auto: exact below 10k vectors, HNSW below 1M, IVF-PQ above


def as_float32(x) -> np.ndarray:
    """A torch tensor or array as a C-contiguous float32 array (what FAISS takes)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().float().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def choose_index_type(count: int, index_type: str = "auto") -> str:
    """The FAISS type for ``count`` vectors: ``index_type`` itself, or by size for ``auto``."""
    if index_type not in INDEX_TYPES:
        raise ValueError(f"index_type must be one of {INDEX_TYPES}, got {index_type!r}")
    if index_type != "auto":
        return index_type
    return "flat" if count < FLAT_MAX else "hnsw" if count < HNSW_MAX else "ivfpq"


def build_faiss(vectors, index_type: str = "auto"):
    """FAISS inner-product index over (N, d) vectors; type by size unless given."""
    import faiss

    vectors = as_float32(vectors)
    if vectors.ndim != 2:
        raise ValueError(f"vectors must be (N, d), got shape {vectors.shape}; reshape one vector to (1, d)")
    n, d = vectors.shape
    kind = choose_index_type(n, index_type)
    if kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction, index.hnsw.efSearch = 80, 128
    else:
        nlist = max(1, min(int(4 * math.sqrt(n)), n // 39))  # FAISS wants ~39 training points per list
        m = next(m for m in (16, 8, 4, 2, 1) if d % m == 0)  # PQ sub-quantizers must divide d
        nbits = min(8, max(4, int(math.log2(max(n // 39, 16)))))  # 8 bits (256 codes) once there is data for it
        index = faiss.IndexIVFPQ(faiss.IndexFlatIP(d), d, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
        index.train(vectors[np.random.default_rng(0).permutation(n)[:256 * nlist]])
        index.nprobe = min(nlist, 16)
    index.add(vectors)
    return index


def build_flat_index(vectors):
    """Exact inner-product index over (N, d) vectors (``build_faiss(vectors, "flat")``)."""
    return build_faiss(vectors, "flat")


def search(index, queries, k: int):
    """-> (scores (N_q, k), ids (N_q, k)) as torch tensors, best first; k is capped at the index size."""
    import torch

    k = min(k, index.ntotal)
    scores, ids = index.search(as_float32(queries), k)
    return torch.from_numpy(scores), torch.from_numpy(ids).long()
