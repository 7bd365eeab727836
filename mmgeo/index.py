"""FAISS index over global vectors: the first stage of two-stage retrieval (DESIGN §2).

Inner product on L2-normalised vectors (= cosine). Exact ``IndexFlatIP`` here; the search service
(issue 6) adds HNSW / IVF-PQ by gallery size.
"""

from __future__ import annotations

import numpy as np
import torch


def _as_f32(x: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def build_flat_index(vectors: torch.Tensor | np.ndarray):
    """Exact inner-product index over (N, d) vectors."""
    import faiss

    vectors = _as_f32(vectors)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    return index


def search(index, queries: torch.Tensor | np.ndarray, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (scores (N_q, k), ids (N_q, k)); k is capped at the index size."""
    k = min(k, index.ntotal)
    scores, ids = index.search(_as_f32(queries), k)
    return torch.from_numpy(scores), torch.from_numpy(ids).long()
